"""Generate tiny random Hugging Face checkpoints + reference outputs for tests.

Run once, by hand (NOT in CI), from the repository root:

    python3.11 -m venv ../venv311    # torch==2.13.0 is a local CPU wheel for Python 3.11 here
    ../venv311/bin/pip install torch==2.13.0 transformers safetensors tokenizers numpy
    ../venv311/bin/python scripts/make_fixtures.py

It (re)writes ``tests/fixtures/<name>/`` for every fixture below and is
deterministic: running it twice yields identical files (same torch /
transformers / tokenizers versions assumed).  The generated files are
committed; the tests only read them and never import torch/transformers.

Each fixture directory holds:

* ``config.json`` / ``model.safetensors`` (float32, ``save_pretrained``) and,
  if transformers writes one, ``generation_config.json``;
* ``tokenizer.json`` (+ ``tokenizer_config.json``) for ``llama-tokenizer``;
* ``expected.json`` with the reference outputs:

  - ``prompts``: ragged list of prompt token ids (3 prompts, distinct lengths);
  - ``max_new_tokens``: 8;
  - ``greedy``: the 8 greedily generated ids per prompt, each prompt run
    ALONE (batch 1, no padding), EOS never stops generation;
  - ``greedy_logprobs``: log-prob of each chosen greedy token (8 per prompt);
  - ``first_logprobs``: full float32 ``log_softmax`` over the vocab of the
    logits that produce the first generated token, rounded to 6 decimals;
  - ``min_margin``: smallest top1 - top2 logit gap over all greedy steps of
    all prompts (>= MIN_MARGIN, so greedy choices are not near-ties);
  - ``seed``, ``transformers_version``, ``torch_version``;
  - ``llama-tokenizer`` only: ``prompt_texts`` and ``greedy_texts``
    (``tokenizer.decode(greedy_ids, skip_special_tokens=False)``);
  - ``llama-dynamic`` only: ``max_seq_len``, the context its dynamic RoPE base is
    for (``DYNAMIC_SEQ_LEN``): dcp_jax reproduces the reference with that
    max_model_len / max_seq_len.

Weights are random with a large init (``initializer_range=0.5``) so logits
are well separated, except q_proj/k_proj which are then scaled by QK_SCALE so
attention stays soft (not one-hot) and the softmax is really exercised; biases (Qwen2 q/k/v) are re-drawn with std 0.1 and Qwen3
q_norm/k_norm weights uniformly in [0.5, 1.5] so they matter.  All other norm
weights stay at ones.  DeepSeek-V3 (MLA): q_proj/q_b_proj, kv_a_proj_with_mqa and kv_b_proj are scaled
like q/k, and the router's e_score_correction_bias is drawn with std 0.1.  For each fixture the seed is looped deterministically
until ``min_margin >= MIN_MARGIN``.

The greedy reference is a manual loop with the KV cache (eager attention); it
is cross-checked against ``model.generate`` and against a cache-free forward
pass over the full sequence.
"""

from __future__ import annotations

import inspect
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "fixtures"

MAX_NEW_TOKENS = 8
MIN_MARGIN = 0.05
PROMPT_LENGTHS = (5, 11, 17)
MAX_SEED_TRIES = 100
# With initializer_range=0.5 the raw attention scores have std ~16, i.e.
# near one-hot attention, which would hide bugs in the (sharded) softmax.
# q_proj/k_proj weights are scaled by this factor after init so attention is
# soft (score std ~1.5).  No effect on Qwen3 (q/k RMSNorm undoes it).
QK_SCALE = 0.3

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.5,
    dtype="float32",
)

LLAMA_GQA = dict(
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)

DEEPSEEK_V3 = dict(
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# Dynamic NTK RoPE: transformers recomputes the base in every forward from the longest position in
# it (growing, never shrinking while past max_position_embeddings), so its cached generate rotates
# older keys with older bases; dcp_jax uses one base per run, the one for its whole context
# (`RopeConfig.inv_freq`: max_model_len, a dense run's max_seq_len). The reference therefore first
# grows the rotary state to DYNAMIC_SEQ_LEN tokens (one forward that long): every forward after it,
# cached or not, uses the base for DYNAMIC_SEQ_LEN, as dcp_jax does with that context
# (``max_seq_len`` in expected.json). max_position_embeddings (the original context) is below every
# prompt's length, so the scaling applies from the first token and transformers never resets it.
DYNAMIC_SEQ_LEN = 48

# name -> (config class, model class, extra config kwargs, base seed)
FIXTURES = {
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, dict(LLAMA_GQA), 1000),
    "llama-mha-tied": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
        ),
        2000,
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        3000,
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        4000,
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        5000,
    ),
    "llama-tokenizer": (LlamaConfig, LlamaForCausalLM, dict(LLAMA_GQA), 6000),
    # MLA + MoE: layer 0 dense, layer 1 MoE (8 routed experts in 4 groups, top-2 of the best 2 groups,
    # one shared expert); with q_lora_rank and default RoPE ...
    "deepseek-v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(DEEPSEEK_V3), 7000),
    # ... and without q_lora_rank, with YaRN scaling (mscale != mscale_all_dim, so both the cos/sin
    # factor and the softmax-scale correction are exercised).
    "deepseek-v3-yarn": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            DEEPSEEK_V3,
            q_lora_rank=None,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        ),
        8000,
    ),
    # DeepSeek-V2: the same MLA; softmax router scores, group-limited greedy top-k, no score bias.
    "deepseek-v2": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            {k: v for k, v in DEEPSEEK_V3.items() if k != "norm_topk_prob"},
            q_lora_rank=None,
            topk_method="group_limited_greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
        ),
        9000,
    ),
    # Dynamic NTK RoPE (see DYNAMIC_SEQ_LEN): a 4-token original context, every prompt past it.
    "llama-dynamic": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            LLAMA_GQA,
            max_position_embeddings=4,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
        10000,
    ),
}

PROMPT_TEXTS = [
    "The cat sat.",
    "A list is a mutable sequence of items.",
    "Return a new object with the same value, or raise an error if the argument is not valid.",
]


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------
def _training_text() -> str:
    """A few KB of English from stdlib docstrings (deterministic for a given Python)."""
    import collections
    import functools
    import itertools
    import json as json_mod
    import os
    import string
    import textwrap

    parts = []
    for mod in (json_mod, collections, functools, itertools, os, string, textwrap):
        parts.append(inspect.getdoc(mod) or "")
    for obj in (
        collections.OrderedDict,
        collections.Counter,
        functools.reduce,
        functools.partial,
        textwrap.wrap,
        textwrap.dedent,
        os.path.join,
        json_mod.dumps,
        json_mod.loads,
    ):
        parts.append(inspect.getdoc(obj) or "")
    parts.extend(PROMPT_TEXTS)
    return "\n\n".join(parts)


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No initial_alphabet: the full 256-byte alphabet alone would exceed the
    # 256-token budget; the alphabet is the characters seen in the text.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator([_training_text()], trainer=trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok, bos, eos


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------
def build_model(cfg_cls, model_cls, extra: dict, seed: int, bos_eos=None):
    kwargs = dict(COMMON)
    kwargs.update(extra)
    # deep-copy the rope dict: config standardization mutates it in place
    kwargs["rope_parameters"] = dict(kwargs["rope_parameters"])
    if bos_eos is not None:
        kwargs["bos_token_id"], kwargs["eos_token_id"] = bos_eos
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()

    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_b_proj.weight",
                              "kv_a_proj_with_mqa.weight")):
                p.mul_(QK_SCALE)
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 routing bias: make it matter
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def is_dynamic(extra: dict) -> bool:
    return extra["rope_parameters"]["rope_type"] == "dynamic"


@torch.no_grad()
def grow_rope(model) -> None:
    """Dynamic RoPE: one forward of DYNAMIC_SEQ_LEN tokens, so every later forward (none longer)
    uses the base for that length."""
    model(input_ids=torch.zeros(1, DYNAMIC_SEQ_LEN, dtype=torch.long), use_cache=False)
    rotary = model.model.rotary_emb
    assert rotary.max_seq_len_cached == DYNAMIC_SEQ_LEN > rotary.original_max_seq_len


@torch.no_grad()
def check_scaling_matters(cfg_cls, model_cls, extra: dict, seed: int, prompts, results) -> None:
    """The same weights without the scaling (default RoPE) give other first-token logprobs: the
    fixture tests the dynamic base."""
    plain = build_model(cfg_cls, model_cls, dict(extra, rope_parameters={
        "rope_type": "default", "rope_theta": extra["rope_parameters"]["rope_theta"]}), seed)
    for p, r in zip(prompts, results):
        logits = plain(input_ids=torch.tensor([p])).logits[0, -1].float()
        diff = (torch.log_softmax(logits, -1) - r[2]).abs().max().item()
        assert diff > 0.05, f"the dynamic scaling changes prompt {len(p)}'s logprobs by only {diff}"


def _cache_kw(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def save_reference(model, out_dir: Path, seed: int, prompts, results, min_margin: float) -> dict:
    """Write `model` to a fresh `out_dir` and return the expected.json fields every fixture has:
    the seed, the versions, the prompts and the greedy reference (`greedy_reference`'s results)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return {
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "max_new_tokens": MAX_NEW_TOKENS,
        "prompts": prompts,
        "greedy": [r[0] for r in results],
        "greedy_logprobs": [[round(x, 6) for x in r[1]] for r in results],
        "min_margin": round(min_margin, 6),
        "first_logprobs": [[round(float(x), 6) for x in r[2].tolist()] for r in results],
    }


def greedy_reference(model, prompt: list[int]):
    """Manual greedy loop with the KV cache, batch 1, no padding, no EOS stop."""
    kw = _cache_kw(model)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, **{kw: cache})
    logits = out.logits[0, -1].float()
    first_logprobs = torch.log_softmax(logits, dim=-1)
    tokens, logprobs, margins = [], [], []
    for step in range(MAX_NEW_TOKENS):
        top = torch.topk(logits, 2)
        margins.append(float(top.values[0] - top.values[1]))
        tok = int(top.indices[0])
        tokens.append(tok)
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        if step + 1 < MAX_NEW_TOKENS:
            out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{kw: cache})
            logits = out.logits[0, -1].float()
    return tokens, logprobs, first_logprobs, margins


@torch.no_grad()
def cross_check(model, prompt: list[int], tokens: list[int], first_logprobs: torch.Tensor):
    # 1) cache-free forward over the full sequence reproduces every greedy choice
    full = torch.tensor([prompt + tokens])
    logits = model(input_ids=full, use_cache=False).logits[0].float()
    n = len(prompt)
    nocache = logits[n - 1 : n - 1 + MAX_NEW_TOKENS].argmax(-1).tolist()
    assert nocache == tokens, (nocache, tokens)
    diff = (torch.log_softmax(logits[n - 1], -1) - first_logprobs).abs().max().item()
    assert diff < 1e-3, diff
    # 2) HF generate (greedy, EOS disabled) agrees
    gcfg = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    model.generation_config.eos_token_id = None  # EOS never stops the reference (as in greedy_reference)
    gen = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, n, dtype=torch.long), generation_config=gcfg
    )
    gen_tokens = gen[0, n:].tolist()
    assert gen_tokens == tokens, (gen_tokens, tokens)


def make_fixture(name: str) -> dict:
    cfg_cls, model_cls, extra, base_seed = FIXTURES[name]
    out_dir = OUT_DIR / name

    tokenizer = None
    bos_eos = None
    if name == "llama-tokenizer":
        tokenizer, bos, eos = build_tokenizer(COMMON["vocab_size"])
        bos_eos = (bos, eos)

    for attempt in range(MAX_SEED_TRIES):
        seed = base_seed + attempt
        if tokenizer is not None:
            prompts = [tokenizer.encode(t).ids for t in PROMPT_TEXTS]
        else:
            rng = np.random.default_rng(seed)
            prompts = [rng.integers(0, COMMON["vocab_size"], size=L).tolist() for L in PROMPT_LENGTHS]
        assert len({len(p) for p in prompts}) == len(prompts), "prompt lengths must differ"

        model = build_model(cfg_cls, model_cls, extra, seed, bos_eos)
        if is_dynamic(extra):
            grow_rope(model)
        results = [greedy_reference(model, p) for p in prompts]
        min_margin = min(min(r[3]) for r in results)
        if min_margin >= MIN_MARGIN:
            break
        print(f"  {name}: seed {seed} min_margin {min_margin:.4f} < {MIN_MARGIN}, retrying")
    else:
        raise RuntimeError(f"{name}: no seed gave min_margin >= {MIN_MARGIN}")

    for p, (tokens, _, first_lp, _) in zip(prompts, results):
        cross_check(model, p, tokens, first_lp)
    if is_dynamic(extra):
        check_scaling_matters(cfg_cls, model_cls, extra, seed, prompts, results)

    expected = save_reference(model, out_dir, seed, prompts, results, min_margin)
    if is_dynamic(extra):  # the context the reference's RoPE base is for: run dcp_jax with it
        expected["max_seq_len"] = DYNAMIC_SEQ_LEN
    if tokenizer is not None:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(out_dir)
        expected["prompt_texts"] = PROMPT_TEXTS
        expected["greedy_texts"] = [
            tokenizer.decode(r[0], skip_special_tokens=False) for r in results
        ]

    with open(out_dir / "expected.json", "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    return expected


def main(argv: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    names = argv or list(FIXTURES)
    for name in names:
        exp = make_fixture(name)
        print(
            f"{name}: seed={exp['seed']} min_margin={exp['min_margin']:.4f} "
            f"prompt_lens={[len(p) for p in exp['prompts']]} greedy={exp['greedy']}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
