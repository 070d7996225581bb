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

        try:
            return compile_template(self.source)
        except TemplateError as e:
            raise UserError("the checkpoint's chat template does not parse: "
                            + describe_error(e)) from None

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


def compile_template(source: str):
    """The Jinja template of `source` in transformers' environment; raises jinja2's TemplateError
    (a TemplateSyntaxError with its line) when it does not parse."""
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
    return env.from_string(source)


def describe_error(e) -> str:
    """A Jinja error in one line: its message and, for a syntax error, the line it is on."""
    message = " ".join((getattr(e, "message", None) or str(e) or type(e).__name__).split())
    line = getattr(e, "lineno", None)
    return f"{message} (line {line})" if line else message


def read_template(path) -> str:
    """The source of the Jinja chat template file `path` (vLLM's --chat-template): UserError (field
    chat_template) naming the file when it cannot be read (`check_template` compiles it)."""
    from pathlib import Path

    try:
        return Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read the chat template {path} ({e.strerror or e}): give the path "
                        "of a Jinja template file", field="chat_template") from None
    except UnicodeDecodeError as e:
        raise UserError(f"the chat template {path} is not UTF-8 text ({e.reason} at byte "
                        f"{e.start}): give a Jinja template file", field="chat_template") from None


def check_template(source: str, path) -> None:
    """Compile the template `source` read from the file `path`: UserError (field chat_template)
    naming the file and the Jinja error, with its line, when it does not parse."""
    from jinja2.exceptions import TemplateError

    try:
        compile_template(source)
    except TemplateError as e:
        raise UserError(f"the chat template {path} does not parse: {describe_error(e)}; fix the "
                        "template", field="chat_template") from None
