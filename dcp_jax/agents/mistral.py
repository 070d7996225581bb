"""mistral: Mistral's `[TOOL_CALLS]`, followed by a JSON list of calls (tokenizer v3, Mistral 7B
v0.3, Mixtral) or by `name[ARGS]{...}` per call (tokenizer v11+, Mistral Small 3.2, Devstral):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}

`[TOOL_CALLS]` is a control token of Mistral's tokenizers: a request must keep special tokens in
its text (skip_special_tokens false) for the parser to see it. Call ids are 9 letters and digits
(Mistral's templates refuse others).
"""

from __future__ import annotations

import random
import string

from dcp_jax.agents.calls import (
    Malformed,
    PartialCall,
    ToolParser,
    call_list,
    json_call,
    lark_str,
    object_text,
    skip_ws,
    until,
)

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"


class Mistral(ToolParser):
    name = "mistral"
    markers = (MARK,)

    def scan(self, text: str, calls: list[PartialCall], final: bool) -> int:
        i = skip_ws(text, len(MARK))
        if text.startswith("[", i):  # v3: a JSON list
            return call_list(text, i + 1, calls, self.names)
        calls.append(PartialCall())
        name, i = until(text, i, ARGS)
        if self.names is not None and name not in self.names:
            raise Malformed
        calls[-1].set(name)
        return object_text(text, i, calls[-1])

    def call_syntax(self, name: str, parameters: dict) -> str:
        return json_call(name, parameters)

    def sequence(self, parallel: bool) -> str:
        more = f' ({lark_str(",")} call)*' if parallel else ""
        return f'{lark_str(MARK + "[")} call{more} {lark_str("]")}'

    def new_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
