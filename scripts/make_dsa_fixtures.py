"""Tiny random DeepSeek-V3.2 (DSA: MLA + the lightning indexer) checkpoints and transformers'
greedy reference, for tests/test_dsa.py.

Run once, by hand (NOT in CI), from the repository root with the reference interpreter (see
scripts/make_fixtures.py):

    ../venv311/bin/python scripts/make_dsa_fixtures.py

It (re)writes ``tests/fixtures/deepseek-v32/`` deterministically, in make_fixtures.py's format
(config.json, model.safetensors, expected.json: prompts, greedy ids, their logprobs, the first
step's full logprobs, min_margin), with prompts several times longer than ``index_topk`` (16) so
that the indexer's selection decides what every late query attends.

Besides make_fixtures.py's checks (greedy margins, a cache-free forward and ``generate`` agree),
every top-k the indexer takes during the reference run (each layer, each query of each prefill and
decode step) is recorded: the gap between the k-th and the (k+1)-th visible score, relative to the
k-th's magnitude, must exceed MIN_TOPK_GAP. So the reference's choice is never a tie (transformers'
``torch.topk`` breaks ties in no documented order) nor a near-tie that float32 rounding in another
implementation could flip; ``min_topk_gap`` and the number of selections that mattered (a query
seeing more than ``index_topk`` tokens) go into expected.json.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf

OUT = mf.OUT_DIR / "deepseek-v32"
INDEX_TOPK = 16
PROMPT_LENGTHS = (40, 67, 97)  # 2.5x to 6x index_topk (the last query of each sees 46..104 tokens)
MIN_TOPK_GAP = 1e-4  # relative gap at every selection boundary (float32 rounding: ~1e-6)
# the indexer's projections scaled like MLA's q/k (make_fixtures.QK_SCALE) so scores spread
# without a few tokens dominating every query
INDEX_SCALE = 0.3

CONFIG = dict(
    mf.DEEPSEEK_V3,
    index_topk=INDEX_TOPK,
    index_n_heads=16,  # (with few heads, relu zeroes every head of many tokens: exact ties)
    index_head_dim=32,  # its first qk_rope_head_dim (8) dims rotated (half-split RoPE)
    max_position_embeddings=256,
)


class TopkRecorder:
    """Patches the indexer's forward to record, at each top-k it takes, the relative gap between
    the k-th and (k+1)-th visible scores of every query row (rows seeing <= k tokens: no choice)."""

    def __init__(self):
        self.gaps: list[float] = []
        self.chosen = 0  # selections that dropped a visible token

    @contextlib.contextmanager
    def active(self):
        original_forward, original_topk = v32.DeepseekV32Indexer.forward, torch.Tensor.topk
        recorder = self

        def topk(t, k, *args, **kwargs):
            recorder.record(t, k)
            return original_topk(t, k, *args, **kwargs)

        def forward(self, *args, **kwargs):
            torch.Tensor.topk = topk
            try:
                return original_forward(self, *args, **kwargs)
            finally:
                torch.Tensor.topk = original_topk

        v32.DeepseekV32Indexer.forward = forward
        try:
            yield self
        finally:
            v32.DeepseekV32Indexer.forward = original_forward

    def record(self, scores: torch.Tensor, k: int) -> None:
        s = scores.detach().double().reshape(-1, scores.shape[-1])
        for row in s:
            visible = row[row > -1e30]  # masked scores are -inf or finfo.min added
            if visible.numel() <= k:
                continue
            top = torch.sort(visible, descending=True).values
            self.gaps.append(float((top[k - 1] - top[k]) / max(abs(float(top[k - 1])), 1e-6)))
            self.chosen += 1


def build(seed: int, **extra):
    model = mf.build_model(DeepseekV32Config, DeepseekV32ForCausalLM, dict(CONFIG, **extra), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("indexer.wq_b.weight", "indexer.wk.weight")):
                p.mul_(INDEX_SCALE)
    return model


@torch.no_grad()
def check_selection_matters(seed: int, prompts, results) -> float:
    """The same weights attending every token (index_topk past every context) give other
    first-step logprobs: the fixture tests the selection. Returns the smallest difference."""
    dense = build(seed, index_topk=10 ** 6)
    diffs = []
    for p, r in zip(prompts, results):
        logits = dense(input_ids=torch.tensor([p])).logits[0, -1].float()
        diffs.append((torch.log_softmax(logits, -1) - r[2]).abs().max().item())
    assert min(diffs) > 0.05, f"attending every token changes the logprobs by only {diffs}"
    return min(diffs)


def make() -> dict:
    for attempt in range(mf.MAX_SEED_TRIES):
        seed = 11000 + attempt
        rng = np.random.default_rng(seed)
        vocab = mf.COMMON["vocab_size"]
        prompts = [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]
        model = build(seed)
        recorder = TopkRecorder()
        with recorder.active():
            results = [mf.greedy_reference(model, p) for p in prompts]
        min_margin = min(min(r[3]) for r in results)
        gap = min(recorder.gaps)
        if min_margin >= mf.MIN_MARGIN and gap >= MIN_TOPK_GAP:
            break
        print(f"  seed {seed}: min_margin {min_margin:.4f}, min top-k gap {gap:.2e}, retrying")
    else:
        raise RuntimeError("no seed gave well separated logits and top-k boundaries")
    for p, (tokens, _, first, _) in zip(prompts, results):
        mf.cross_check(model, p, tokens, first)
    dense_diff = check_selection_matters(seed, prompts, results)
    expected = mf.save_reference(model, OUT, seed, prompts, results, min_margin)
    expected.update({
        "index_topk": INDEX_TOPK,
        "min_topk_gap": float(f"{gap:.3e}"),
        "topk_selections": recorder.chosen,
        # the first step's logprobs move this much (at least) when every token is attended
        "dense_logprob_diff": round(dense_diff, 4),
    })
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    return expected


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    exp = make()
    print(f"deepseek-v32: seed={exp['seed']} min_margin={exp['min_margin']:.4f} "
          f"min_topk_gap={exp['min_topk_gap']:.2e} selections={exp['topk_selections']} "
          f"greedy={exp['greedy']}")


if __name__ == "__main__":
    main()
