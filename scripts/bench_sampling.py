"""What the request-surface features cost per decode step on CPU, side by side in one run: structured
outputs' token bitmask, penalties, bad words, top logprobs and prompt logprobs, each against the same
batch without it.

The model: a random-weight ~30M-parameter Llama (bench_serving's "chat" shape) with a real-sized
vocabulary and a BPE tokenizer trained here (the `tokenizers` library) on Python's documentation topics
(pydoc_data, shipped with CPython), so llguidance walks a vocabulary of --vocab tokens; written once
to --checkpoint. Each row runs --rows requests (one per slot) of 64 prompt tokens, greedy:

  plain K=1        one decode step per program call (what a constrained batch runs)
  json mask K=1    every row under a JSON schema (a long string field): the host fills each row's
                   packed bitmask from its llguidance matcher, the program unpacks it and masks the logits
  plain K          the K-step decode loop (the engine's default)
  penalties K      every row with presence / frequency / repetition penalties (the token history read)
  bad words K      every row with 8 bad words
  top-20 K         every row reporting its 20 most likely tokens
  prompt lp        prefill time with prompt logprobs (every prompt token scored) against without

Reported: milliseconds per decode step (or per prefill) and the ratio to its reference row, best of
--repeats interleaved runs; the bitmask's share of a step is (json mask K=1) / (plain K=1) - 1, with
the host's own fill time per step beside it.

    python scripts/bench_sampling.py                  # 32 rows, vocabulary 32,000
    python scripts/bench_sampling.py --quick          # 8 rows, vocabulary 4,096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # the scripts' shared helpers
import random_llama  # noqa: E402

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1536, max_position_embeddings=8192)
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 400},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["title", "n"], "additionalProperties": False}


def ensure_model(path: Path, vocab: int) -> Path:
    """A random Llama of SHAPE with a BPE tokenizer of `vocab` ids trained on pydoc_data (once)."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cfg = dict(SHAPE, architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, head_dim=64,
               rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
               torch_dtype="float32")
    path = random_llama.ensure_checkpoint(path, cfg)
    if not (path / "tokenizer.json").is_file():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(pydoc_data.topics.topics.values(), trainer)
        tmp = path / "tokenizer.json.tmp"
        tok.save(str(tmp))
        tmp.rename(path / "tokenizer.json")
    return path


def decode_ms(llm, prompts, steps: int, **kw) -> tuple[float, float]:
    """(ms per decode step, ms of host mask filling per step) of one generate call."""
    eng = llm.engine
    t0 = dict(eng.timing)
    fill = [0.0]
    grammars = eng.grammars
    if grammars is not None:  # time the host's mask fills (wrap the one method)
        inner = type(grammars).fill

        def timed(self, mask, rows):
            t = time.perf_counter()
            inner(self, mask, rows)
            fill[0] += time.perf_counter() - t

        grammars.fill = timed.__get__(grammars)
    from dcp_jax import SamplingParams

    try:
        llm.generate(prompts, SamplingParams(max_tokens=steps, **kw))
    finally:
        if grammars is not None:
            del grammars.fill
    d = {k: eng.timing[k] - t0[k] for k in ("decode_s", "decode_steps", "prefill_s", "ragged_steps")}
    return 1000 * d["decode_s"] / max(d["decode_steps"], 1), 1000 * fill[0] / max(d["decode_steps"], 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/dcp_jax_bench/sampling"))
    p.add_argument("--vocab", type=int, default=None, help="tokenizer and model vocabulary (default 32000)")
    p.add_argument("--rows", type=int, default=None, help="requests = slots (default 32)")
    p.add_argument("--steps", type=int, default=48, help="decode steps per request (default 48)")
    p.add_argument("--decode-steps", type=int, default=8, help="K of the decode loop (default 8)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="context of the pool (the token history the penalties read is [rows, this]; default 4096)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8 rows, vocabulary 4096, 1 repeat")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    vocab = args.vocab or (4096 if args.quick else 32000)
    rows = args.rows or (8 if args.quick else 32)
    repeats = 1 if args.quick else args.repeats

    import dcp_jax
    from dcp_jax import LLM

    dcp_jax.ensure_cpu_devices(1)
    path = ensure_model(args.checkpoint.with_name(f"{args.checkpoint.name}-{vocab}"), vocab)
    common = dict(tp=1, dcp=1, page_size=16, max_num_seqs=rows, max_model_len=args.max_model_len, prefill_chunk=256)
    one = LLM.load(path, decode_steps=1, **common)
    many = LLM.load(path, decode_steps=args.decode_steps, **common)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, vocab, 64)] for _ in range(rows)]
    words = [one.decode([int(t)]).strip() or "x" for t in rng.integers(3, vocab, 8)]
    k = args.decode_steps
    configs = {  # name: (llm, keywords, reference row)
        "plain K=1": (one, dict(ignore_eos=True), None),
        "json mask K=1": (one, dict(structured={"json": SCHEMA}), "plain K=1"),
        f"plain K={k}": (many, dict(ignore_eos=True), None),
        f"penalties K={k}": (many, dict(ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5,
                                        repetition_penalty=1.2), f"plain K={k}"),
        f"bad words K={k}": (many, dict(ignore_eos=True, bad_words=words), f"plain K={k}"),
        f"top-20 K={k}": (many, dict(ignore_eos=True, top_logprobs=20), f"plain K={k}"),
    }
    for llm, kw, _ in configs.values():  # compile and warm every program outside the clock
        llm.generate(prompts, dcp_jax.SamplingParams(max_tokens=4, **kw))
    best: dict[str, tuple[float, float]] = {}
    prefill: dict[str, float] = {}
    for _ in range(repeats):
        for name, (llm, kw, _) in configs.items():
            ms, fill = decode_ms(llm, prompts, args.steps, **kw)
            if name not in best or ms < best[name][0]:
                best[name] = (ms, fill)
        for name, kw in (("prefill", {}), ("prefill + prompt lp", dict(prompt_logprobs=5))):
            many.reset_prefix_cache()
            out = many.generate(prompts, dcp_jax.SamplingParams(max_tokens=1, ignore_eos=True,
                                                                **kw))
            prefill[name] = min(prefill.get(name, 1e9), 1000 * out.stats["prefill_s"])
    table = []
    for name, (llm, kw, ref) in configs.items():
        ms, fill = best[name]
        table.append(dict(row=name, ms_per_step=round(ms, 3), host_fill_ms=round(fill, 3),
                          ratio=round(ms / best[ref][0], 3) if ref else 1.0))
    table.append(dict(row="prefill + prompt lp", ms_per_step=round(prefill["prefill + prompt lp"], 3),
                      host_fill_ms=0.0, ratio=round(prefill["prefill + prompt lp"] / prefill["prefill"], 3)))
    mask_share = best["json mask K=1"][0] / best["plain K=1"][0] - 1
    if args.json:
        print(json.dumps(dict(rows=rows, vocab=vocab, table=table, bitmask_share_of_step=mask_share)))
        return 0
    print(f"{rows} rows, vocabulary {vocab:,}, max_model_len {args.max_model_len}, {args.steps} decode steps, "
          f"best of {repeats} ({path})")
    print(f"{'row':22} {'ms/step':>9} {'host fill ms':>13} {'ratio':>7}")
    for r in table:
        print(f"{r['row']:22} {r['ms_per_step']:9.3f} {r['host_fill_ms']:13.3f} {r['ratio']:7.3f}")
    print(f"the bitmask's share of a constrained step: {100 * mask_share:+.1f}% "
          f"(host fill {best['json mask K=1'][1]:.3f} ms of {best['json mask K=1'][0]:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
