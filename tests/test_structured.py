"""Structured outputs (llguidance): on the random-weight llama-tokenizer fixture, whose free text is noise,
200 constrained completions over 10 JSON schemas, 6 regexes, choice lists and a Lark grammar, greedy and
sampled, every one parsing and validating (jsonschema); the same under n-gram
speculation (drafts the grammar refuses are rejected), exact against plain decoding; the errors."""

import json
import re

import jsonschema
import pytest

from dcp_jax import LLM
from dcp_jax.errors import UserError
from dcp_jax.sampling import SamplingParams
from tests.util import FIXTURES

# (the fixture's 256-token vocabulary has no '@', '!', '?', '%', '&', '^', '~' nor G K Q X Y Z)
S = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer",
     "minimum": 1, "maximum": 9}}, "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
     "minItems": 1, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{6}$"}}, "required": ["id"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "draft": {"type": "boolean"}, "pages": {"type": "integer",
     "minimum": 1, "maximum": 500}}, "required": ["title", "draft", "pages"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "when": {"type": "string",
     "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}, "required": ["kind", "when"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
     {"type": "null"}]}, "unit": {"enum": ["cm", "m", "km"]}}, "required": ["value", "unit"],
     "additionalProperties": False},
]
REGEXES = [r"[a-z]{3,6}\.example\.com", r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no)", r"[A-F][0-9]{2,4}",
           r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}", r"[1-9][0-9]{0,2}(,[0-9]{3}){0,2}"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin", "Madrid"], ["a", "bb", "ccc"]]
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
PROMPTS = ["Hello", "The cat sat", "Return the", "x = 3 +", "Dear sir,"]


def cases():
    """(structured spec, check(text) -> bool) over every kind; 20 in all."""
    out = [({"json": s}, lambda t, s=s: jsonschema.validate(json.loads(t), s) is None) for s in SCHEMAS]
    out += [({"regex": r}, lambda t, r=r: re.fullmatch(r, t) is not None) for r in REGEXES]
    out += [({"choice": c}, lambda t, c=c: t in c) for c in CHOICES]
    out += [({"grammar": GRAMMAR}, lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t) is not None)]
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM.load(FIXTURES / "llama-tokenizer", tp=1, dcp=2, page_size=4, max_num_seqs=10, decode_steps=4)


def test_200_constrained_completions_parse_and_validate(llm):
    # each spec: the 5 prompts greedy, and sampled (temperature 1, top-k 50); 20 specs x 10 = 200
    total = 0
    for spec, check in cases():
        greedy = llm.generate(PROMPTS, max_new_tokens=80, structured=spec)
        sampled = llm.generate(PROMPTS, max_new_tokens=80, structured=spec, temperature=1.0, top_k=50, seed=11)
        for text, reason in zip(greedy.text + sampled.text, greedy.finish_reasons + sampled.finish_reasons):
            assert reason == "stop" and check(text), (spec, text, reason)
            total += 1
    assert total == 200


def test_any_json_object(llm):
    # unbounded strings: a noise model may not close one within max_tokens ("length": a prefix), but
    # what stops is a JSON object
    kw = dict(max_new_tokens=80, structured={"json_object": True})
    out = llm.generate(PROMPTS, **kw)
    sampled = llm.generate(PROMPTS, temperature=1.0, top_k=50, seed=11, **kw)
    pairs = list(zip(out.text + sampled.text, out.finish_reasons + sampled.finish_reasons))
    assert all(t.startswith("{") for t, _ in pairs) and any(r == "stop" for _, r in pairs)
    assert all(isinstance(json.loads(t), dict) for t, r in pairs if r == "stop")


def test_free_text_would_not_parse(llm):
    # the test can fail: without the grammar the fixture's text is noise
    out = llm.generate(PROMPTS, max_new_tokens=30, temperature=1.0, seed=11)
    assert not any(text.startswith("{") and text.endswith("}") for text in out.text)


def test_speculation_rejects_drafts_the_grammar_refuses():
    # n-gram drafts are checked against each position's mask: greedy tokens equal plain decoding's, and
    # sampled outputs still validate
    kw = dict(tp=1, dcp=2, page_size=4, max_num_seqs=10)
    plain = LLM.load(FIXTURES / "llama-tokenizer", **kw)
    spec = LLM.load(FIXTURES / "llama-tokenizer", speculative="ngram", num_speculative_tokens=3,
                    speculative_auto_off=False, **kw)
    for structured, check in cases()[::3]:
        want = plain.generate(PROMPTS, max_new_tokens=80, structured=structured)
        got = spec.generate(PROMPTS, max_new_tokens=80, structured=structured)
        assert got.tokens == want.tokens, structured
        sampled = spec.generate(PROMPTS, max_new_tokens=80, structured=structured, temperature=1.0, seed=5)
        assert all(check(t) for t in sampled.text), (structured, sampled.text)
    assert spec.engine.stats()["spec_drafted_tokens"] > 0


def test_constrained_and_free_requests_share_steps(llm):
    # per row: a free request in the same steps gets the tokens it gets alone
    alone = llm.generate(PROMPTS[:2], max_new_tokens=12, ignore_eos=True)
    from dcp_jax.serving.engine import run_requests

    reqs = llm.requests(PROMPTS[:2], max_new_tokens=12, ignore_eos=True, prefix="free")
    reqs += llm.requests(PROMPTS[2:], max_new_tokens=40, structured={"json": SCHEMAS[0]}, prefix="json")
    run_requests(llm.engine, reqs)
    assert [r.output_token_ids for r in reqs[:2]] == alone.tokens
    assert all(jsonschema.validate(json.loads(llm.decode(r.output_token_ids)), SCHEMAS[0]) is None for r in reqs[2:])


@pytest.mark.parametrize("spec,match", [
    ({"json": {"type": "wat"}}, "the json grammar cannot be compiled: Invalid type: wat"),
    ({"regex": "[a-"}, "the regex grammar cannot be compiled"),
    ({"grammar": "start: ???"}, "the grammar grammar cannot be compiled"),
    # llguidance's reason is several lines: all of it comes, on one line
    ({"regex": "(("}, r"the regex grammar cannot be compiled: at 1\(8\): invalid regex \"\(\(\" "
     r"\(in regex\): regex parse error: \(\( error: unclosed group$"),
])
def test_a_grammar_that_cannot_compile_fails_its_request(llm, spec, match):
    with pytest.raises(UserError, match=match) as e:
        llm.generate(["Hello"], max_new_tokens=4, structured=spec)
    assert "\n" not in str(e.value)


def test_gbnf_grammar(llm):
    # a grammar that is not Lark is tried as GBNF (llama.cpp's)
    out = llm.generate(PROMPTS, max_new_tokens=8, structured={"grammar": 'root ::= "yes" | "no"'})
    assert all(t in ("yes", "no") for t in out.text), out.text


@pytest.mark.parametrize("spec,match", [
    (("regex", "(("), "unclosed group$"),
    (("json", '{"type": "foo"}'), "Invalid type: foo"),
    (("grammar", "start: ???"), "Expected value"),
    (("grammar", 'start: "a" <|im_end|>'), None),  # special tokens: the tokenizer's check
    (("grammar", 'root ::= "a"'), None),
])
def test_check_before_a_model_loads(spec, match):
    # what the CLIs check before loading a model: no tokenizer, and no grammar refused that a
    # tokenizer could accept
    from dcp_jax.structured import check

    if match is None:
        check(spec)
    else:
        with pytest.raises(UserError, match=match):
            check(spec)


@pytest.mark.parametrize("spec,match", [
    ({"json": "{not json"}, "the schema is not valid JSON"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"yaml": "a"}, "exactly one of"),
    ("json", "must be a dict"),
])
def test_structured_values_are_checked(spec, match):
    with pytest.raises(UserError, match=match):
        SamplingParams(structured=spec)


def test_no_tokenizer_no_grammar():
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=1, page_size=4)
    with pytest.raises(UserError, match="structured outputs need the model's tokenizer"):
        llm.generate([[5, 6]], max_new_tokens=2, structured={"choice": ["a"]})


def test_200_constrained_completions_on_the_embedded_byte_model():
    # the default model's tokenizer is byte-level and it has no EOS token: llguidance gets its 256
    # byte tokens and an EOS past them, and each output ends where its grammar is complete ("stop");
    # the 20 specs x 5 prompts, greedy and sampled, in one batched generate
    from dcp_jax.cli import DEFAULT_MODEL

    llm = LLM.load(DEFAULT_MODEL, tp=1, dcp=2, max_model_len=256, page_size=8, max_num_seqs=40)
    assert llm.model.config.eos_token_ids == () and llm.tokenizer.to_str() == "bytes"
    rows = [(prompt, spec, check, kw) for spec, check in cases() for prompt in PROMPTS
            for kw in ({}, dict(temperature=1.0, top_k=50, seed=11))]
    params = [SamplingParams(max_tokens=80, structured=spec, **kw) for _, spec, _, kw in rows]
    out = llm.generate([prompt for prompt, *_ in rows], params)
    for text, reason, (_, spec, check, _) in zip(out.text, out.finish_reasons, rows, strict=True):
        assert reason == "stop" and check(text), (spec, text, reason)
    assert len(rows) == 200
