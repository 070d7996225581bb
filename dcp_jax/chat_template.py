"""A checkpoint's chat template: Jinja source and the BOS/EOS strings it may use, rendered the way
transformers renders it (a sandboxed environment with trim_blocks/lstrip_blocks, `raise_exception`,
`tojson`, and the variables messages, add_generation_prompt, bos_token, eos_token and any others
the caller passes, such as tools)."""

from __future__ import annotations

import dataclasses
import functools
import json

from dcp_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @functools.cached_property
    def compiled(self):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, indent=None, ensure_ascii=False, **_):
            return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.source)
        except TemplateError as e:
            raise UserError(f"the checkpoint's chat template does not parse: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **variables) -> str:
        """The prompt text; UserError (field "messages") when the template refuses them.
        `continue_final_message` (transformers' option, for a final assistant message the model is
        to go on writing: Anthropic's prefill): the text ends right after that message's content,
        without the end of its turn; it excludes `add_generation_prompt`."""
        from jinja2.exceptions import TemplateError

        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        try:
            text = self.compiled.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token,
                                        **variables)
        except TemplateError as e:
            raise UserError(f"the chat template refused the messages: {e}",
                            field="messages") from None
        if not continue_final_message:
            return text
        final = messages[-1].get("content") or ""
        for part in (final, final.strip()):  # (a template may strip the content)
            at = text.rfind(part) if part else -1
            if at >= 0:
                return text[:at + len(part)]
        raise UserError("the chat template does not render the final message's text as given, so "
                        "the model cannot go on from it: end the messages with a user turn",
                        field="messages")
