"""The grammar of a required or named tool choice: the family's call syntax
(`ToolParser.call_syntax`, `sequence`) around each offered function's JSON schema, as a Lark
grammar for llguidance (the structured outputs' `{"grammar": ...}`, compiled and masked by
`dcp_jax.structured`). So such an answer always parses as the family's calls, and their arguments
are valid under the schemas (JSON without whitespace between tokens, as structured outputs write
it). With a reasoning parser the thinking may come first, unconstrained."""

from __future__ import annotations

from dcp_jax.agents.calls import ToolParser
from dcp_jax.agents.reasoning import ReasoningParser

NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_grammar(parser: ToolParser, functions: list[dict], parallel: bool,
                 reasoning: ReasoningParser | None = None) -> str:
    """Calls of `functions` (OpenAI's `function` dicts: name, parameters): one, or with `parallel`
    one or more."""
    rules = [f"call_{k}: {parser.call_syntax(f['name'], f.get('parameters') or NO_PARAMETERS)}"
             for k, f in enumerate(functions)]
    prefix = ""
    if reasoning is not None:
        prefix, rule = reasoning.grammar_prefix()
        prefix += " "
        rules.append(rule)
    calls = " | ".join(f"call_{k}" for k in range(len(functions)))
    return "\n".join([f"start: {prefix}{parser.sequence(parallel)}", f"call: {calls}", *rules])
