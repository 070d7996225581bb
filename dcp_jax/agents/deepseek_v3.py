"""deepseek_v3: DeepSeek-V3 / R1-0528's calls between its tool-call tokens, each call's arguments in
a JSON code block (V3), or right after the separator (V3.1 and later):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>          (one line)
"""

from __future__ import annotations

from dcp_jax.agents.calls import (
    Malformed,
    PartialCall,
    ToolParser,
    closing,
    lark_json,
    lark_str,
    literal,
    object_text,
    skip_ws,
    until,
)

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3(ToolParser):
    name = "deepseek_v3"
    markers = (BEGIN,)

    def scan(self, text: str, calls: list[PartialCall], final: bool) -> int:
        i = len(BEGIN)
        while True:
            i = skip_ws(text, i)
            rest = text[i:]
            if calls and (rest.startswith(END) or (END.startswith(rest)
                                                   and (final or not CALL.startswith(rest)))):
                return closing(text, i, END, final)
            i = literal(text, i, CALL)
            call = PartialCall()
            calls.append(call)
            head, i = until(text, i, SEP)
            v3 = head == "function"
            name, i = until(text, i, "\n") if v3 else (head, i)
            if self.names is not None and name not in self.names:
                raise Malformed
            if v3:
                i = literal(text, i, "```json\n")
            call.set(name)
            i = object_text(text, i, call)
            if v3:
                i = literal(text, skip_ws(text, i), "```")
            i = closing(text, i, CALL_END, final)

    def call_syntax(self, name: str, parameters: dict) -> str:
        head = lark_str(f"{CALL}function{SEP}{name}\n```json\n")
        return f'{head} {lark_json(parameters)} {lark_str(f"\n```{CALL_END}")}'

    def sequence(self, parallel: bool) -> str:
        return f"{lark_str(BEGIN)} call{' call*' if parallel else ''} {lark_str(END)}"
