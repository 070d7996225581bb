"""Structured outputs: what a request's output must match (a JSON schema, any JSON object, a regex,
one of a list of choices, a Lark grammar), compiled with llguidance, and the packed token masks the
step programs take.

    structured_spec  a request's `structured=` (LLM.generate) as SamplingParams' (kind, text) pair
    StructuredOutputs  one engine's: its `Grammars`, made when the first such request comes;
                     handed to the scheduler (a request's `problem` when it enters, `advance` after
                     it emits) and to the runner (`fill` a step's masks)
    Grammars         one per engine (its tokenizer, its vocabulary): checks and compiles a spec (cached),
                     makes each request's matcher, and fills the bitmask [rows, T, ⌈V/32⌉] int32 of a
                     step (bit v of a row: token v may come next), several rows at once
                     (llguidance's executor), drafts included (speculation)
    mask_logits      on the device: each constrained row's disallowed logits at -inf

The host advances a request's matcher by every token it emits (`advance`); a token the grammar
refuses (one it could not have sampled) is a bug and fails the request. When the grammar is complete
it allows only EOS; a request whose matcher has stopped finishes ("stop"). A model with no EOS token
(the embedded byte-level model) gives llguidance one past its vocabulary, which it can never sample:
its output ends at the token that completes the grammar (`StructuredOutputs.ended`).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax.errors import UserError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON without whitespace between its tokens (as json.dumps(..., separators=(",", ":")) writes it):
# a weak model cannot pad forever; a schema's "x-guidance" options may ask for flexible whitespace
COMPACT = {"whitespace_flexible": False}


def structured_spec(value) -> tuple[str, str] | None:
    """`{"json": schema}`, `{"json_object": True}`, `{"regex": r}`, `{"choice": [...]}` or
    `{"grammar": lark}` (exactly one key; vLLM's `structured_outputs`) as a (kind, text) pair: the
    schema and the choices as JSON text. None for None; UserError names what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UserError(f"structured must be a dict with one of {', '.join(KINDS)}, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1 or next(iter(given)) not in KINDS:
        raise UserError(f"structured takes exactly one of {', '.join(KINDS)}, got {sorted(value)}")
    kind, v = next(iter(given.items()))
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise UserError(f"structured json: the schema is not valid JSON ({e})") from None
        if not isinstance(v, (dict, bool)):
            raise UserError("structured json: the schema must be a JSON object")
        return kind, json.dumps(v, sort_keys=True)
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        if not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) and c for c in v):
            raise UserError("structured choice: give a non-empty list of non-empty strings")
        return kind, json.dumps(list(v))
    if not isinstance(v, str) or not v:
        raise UserError(f"structured {kind}: give a non-empty string")
    return kind, v


def one_line(error: str) -> str:
    """llguidance's error (several lines: the reason, the source line, a caret under the place) as
    one line: every line of the reason, without the source excerpt (`  1 | ...`) and the carets."""
    lines = (ln.strip() for ln in error.strip().splitlines())
    kept = (ln for ln in lines if ln and set(ln) - set("^ ") and not re.match(r"\d+ \| ", ln))
    return " ".join(kept)


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the mask fillers
    except ImportError:  # pragma: no cover - a core dependency; the message names the fix
        raise UserError("structured outputs need llguidance: pip install llguidance") from None
    return llguidance


def compile_spec(llg, spec: tuple[str, str], tokenizer=None) -> str:
    """The llguidance grammar of `spec` (a `structured_spec` pair), checked against `tokenizer`
    (None: the checks that need none), or UserError with llguidance's reason on one line. A
    `grammar` that is not Lark is tried as GBNF (llama.cpp's, what some vLLM clients send)."""
    kind, text = spec
    m = llg.LLMatcher
    try:
        if kind == "json":
            grammar = m.grammar_from_json_schema(json.loads(text), defaults=COMPACT)
        elif kind == "json_object":
            grammar = m.grammar_from_json_schema({"type": "object"}, defaults=COMPACT)
        elif kind == "regex":
            grammar = m.grammar_from_regex(text)
        elif kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
            grammar = m.grammar_from_lark("start: " + alternatives)
        else:
            grammar = m.grammar_from_lark(text)
    except ValueError as e:
        raise UserError(f"the {kind} grammar cannot be compiled: {one_line(str(e))}") from None
    error = m.validate_grammar(grammar, tokenizer)
    if error and kind == "grammar":
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            converted = m.grammar_from_lark(gbnf_to_lark(text))
            if not m.validate_grammar(converted, tokenizer):
                grammar, error = converted, ""
        except Exception:  # noqa: BLE001 - not GBNF either: the Lark error is the one to report
            pass
    if error:
        raise UserError(f"the {kind} grammar cannot be compiled: {one_line(error)}")
    return grammar


def check(spec: tuple[str, str] | None) -> None:
    """UserError (one line) when `spec` cannot compile whatever the tokenizer: what a front end
    checks before a model loads (a tokenizer's own checks, its special tokens, come with it)."""
    if spec is not None:
        compile_spec(_llguidance(), spec)


class ByteVocabulary:
    """What llguidance's `TokenizerWrapper` reads of a byte-level tokenizer: each id's bytes
    (`tokens`), the EOS id, and encoding (valid UTF-8, as the tokenizer encodes its text)."""

    def __init__(self, tokenizer, tokens: list[bytes], eos_token_id: int):
        self.tokenizer, self.tokens, self.eos_token_id = tokenizer, tokens, eos_token_id
        self.bos_token_id, self.special_token_ids = None, [eos_token_id]

    def __call__(self, data: bytes) -> list[int]:
        return list(self.tokenizer.encode(data.decode("utf-8")).ids)


def ll_tokenizer(llg, tokenizer, vocab_size: int, eos_token_ids):
    """llguidance's tokenizer over the model's `vocab_size` ids, EOS ids the model's. A Hugging Face
    tokenizer goes as its JSON. A byte-level one (the embedded model's `ByteTokenizer`: it has
    `token_bytes()`, each id's bytes) goes as its tokens, ids past them empty; a model with no EOS
    gets id `vocab_size` as llguidance's EOS (past what the model can sample)."""
    eos = list(eos_token_ids)
    if not hasattr(tokenizer, "token_bytes"):
        return llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos or None)
    tokens = list(tokenizer.token_bytes())[:vocab_size]
    tokens += [b""] * (vocab_size - len(tokens))
    if not eos:
        eos, tokens = [vocab_size], tokens + [b""]
    vocab = llg.TokenizerWrapper(ByteVocabulary(tokenizer, tokens, eos[0]))
    return llg.LLTokenizer(vocab, n_vocab=len(tokens), eos_token=eos)


class Grammars:
    """Grammar compilation and masks for one tokenizer and vocabulary (model vocab_size; tokens past
    the tokenizer's never allowed), EOS ids the model's."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.llg = llguidance = _llguidance()
        self.tokenizer = ll_tokenizer(llguidance, tokenizer, vocab_size, eos_token_ids)
        self.vocab_size, self.words = vocab_size, (vocab_size + 31) // 32
        # llguidance's masks: wider than the model's when its EOS is past the model's vocabulary
        self.ll_words = (self.tokenizer.vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor()
        self.compiled: dict[tuple[str, str], str] = {}

    def grammar(self, spec: tuple[str, str]) -> str:
        """The llguidance grammar of `spec`, compiled and checked once; UserError names what is
        wrong."""
        if spec in self.compiled:
            return self.compiled[spec]
        grammar = compile_spec(self.llg, spec, self.tokenizer)
        if len(self.compiled) > 256:
            self.compiled.clear()
        self.compiled[spec] = grammar
        return grammar

    def problem(self, request) -> str | None:
        """Why `request`'s structured spec cannot run (one line), or None."""
        try:
            self.grammar(request.sampling.structured)
        except UserError as e:
            return str(e)
        return None

    def matcher(self, request):
        """`request`'s matcher (made on first use, advanced over any output it already has)."""
        if request.matcher is None:
            request.matcher = self.llg.LLMatcher(self.tokenizer, self.grammar(request.sampling.structured))
            request.matched = 0
            self.advance(request)
        return request.matcher

    def advance(self, request) -> str | None:
        """Feed the matcher the output tokens it has not seen; the error, if the grammar refused
        one."""
        m, new = request.matcher, request.output_token_ids[request.matched:]
        if new:
            m.consume_tokens(new)
            request.matched += len(new)
        return m.get_error() if m.is_error() else None

    def fill(self, mask: np.ndarray, rows) -> None:
        """Fill `mask` [R, T, W] int32 for `rows`: (row, request, drafts) each, drafts a list of up
        to T - 1 tokens (position t + 1's mask assumes drafts[:t] were emitted); other rows keep
        theirs."""
        flat = mask.reshape(-1, mask.shape[-1])
        t = mask.shape[1]
        plain = [(self.matcher(r), row * t) for row, r, drafts in rows if not drafts]
        drafted = [(self.matcher(r), row * t, list(drafts)) for row, r, drafts in rows if drafts]
        wide = flat
        if self.ll_words != flat.shape[-1]:  # llguidance's EOS past the vocabulary: its bit dropped
            wide = np.full((flat.shape[0], self.ll_words), -1, np.int32)
            wide[:, :flat.shape[-1]] = flat
        if plain:
            self.llg.numpy.fill_next_token_bitmask_par(self.executor, plain, wide)
        if drafted:
            fill = self.llg.numpy.fill_next_token_bitmask_par_with_draft_tokens
            fill(self.executor, drafted, wide)
        if wide is not flat:
            flat[:] = wide[:, :flat.shape[-1]]

    def stopped(self, request) -> bool:
        """Whether `request`'s grammar is complete (its matcher advanced over its whole output):
        nothing but EOS may follow. False on a refused token (`advance` reports it)."""
        m = self.matcher(request)
        return self.advance(request) is None and m.is_stopped()


class StructuredOutputs:
    """One engine's structured outputs over its tokenizer (None: every such request is refused) and
    vocabulary; the grammars (llguidance) are made when the first structured request comes."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.grammars: Grammars | None = None

    def problem(self, request) -> str | None:
        """Why `request`'s structured output cannot run (one line), or None."""
        if self.tokenizer is None:
            return "structured outputs need the model's tokenizer (tokenizer.json)"
        try:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self.grammars.problem(request)
        except ValueError as e:  # UserError included: one line
            return str(e)

    def fill(self, mask: np.ndarray, rows) -> None:
        """Fill a step's mask rows of constrained requests (`Grammars.fill`)."""
        self.grammars.fill(mask, rows)

    def advance(self, request) -> str | None:
        """Feed `request`'s matcher what it emitted; the error, if its grammar refused a token."""
        return self.grammars.advance(request)

    def ended(self, request) -> bool:
        """Whether `request`'s output ends at its last token: its grammar is complete and the model
        has no EOS token to end it (llguidance's is past the vocabulary: nothing may follow)."""
        if self.eos_token_ids or self.grammars is None or request.sampling.structured is None:
            return False
        return self.grammars.stopped(request)


def mask_logits(logits, constrained, mask):
    """logits [R, T, V] with each constrained row's (constrained [R] bool) tokens whose bit is 0 in
    mask [R, T, ⌈V/32⌉] int32 at -inf; skipped (a `lax.cond`) when no row is constrained."""
    v = logits.shape[-1]

    def apply():
        ids = jnp.arange(v, dtype=jnp.int32)
        bits = (jnp.take(mask, ids // 32, axis=-1) >> (ids % 32)) & 1
        return jnp.where((bits == 1) | ~constrained[:, None, None], logits, -jnp.inf)

    return jax.lax.cond(jnp.any(constrained), apply, lambda: logits)
