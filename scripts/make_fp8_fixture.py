"""The FP8 block-scaled DeepSeek fixture: tests/fixtures/deepseek-v3 quantized the way DeepSeek-V3/R1
are released, and its reference tokens.

Run by hand (NOT in CI; it needs torch and transformers), from the repository root:

    python scripts/make_fp8_fixture.py        # writes tests/fixtures/deepseek-v3-fp8/

Every linear weight of the attention and the MLPs (q_a/q_b/kv_a/kv_b/o projections; gate/up/down of
the dense MLP, the routed experts and the shared experts) is stored as float8_e4m3fn with a float32
`<name>_scale_inv` per block: scale = max|W| over the block / 448 (e4m3's largest value), W_fp8 =
W / scale, and W = W_fp8 * scale_inv. Embeddings, norms, the router and lm_head stay float32, as in the
release. config.json gains `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [16, 16]}: the release uses [128, 128]; the tiny
fixture's dimensions (24..128) need 16 to have several blocks, and partial ones, per weight.

transformers reads this format only on GPUs (its fine-grained FP8 kernels), so the reference tokens are
transformers' greedy tokens on the dequantized float32 checkpoint (W_fp8 * scale_inv, exactly what the
loader computes), prompts and length as tests/fixtures/deepseek-v3's.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import greedy_reference  # noqa: E402

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SRC, DST = FIX / "deepseek-v3", FIX / "deepseek-v3-fp8"
BLOCK = (16, 16)
FP8_MAX = 448.0
QUANTIZED = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W as float8_e4m3fn, float32 scale_inv per BLOCK) of a float32 matrix."""
    rows, cols = (-(-d // b) for d, b in zip(w.shape, BLOCK))
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            s = np.float32(max(np.abs(blk).max(), 1e-12) / FP8_MAX)
            scale[i, j] = s
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    s = np.repeat(np.repeat(scale, BLOCK[0], axis=0), BLOCK[1], axis=1)[:q.shape[0], :q.shape[1]]
    return q.astype(np.float32) * s


def main() -> None:
    tensors = load_file(str(SRC / "model.safetensors"))
    fp8, dense, n = {}, {}, 0
    for name, w in tensors.items():
        if QUANTIZED.search(name) and w.ndim == 2:
            q, s = quantize(w)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dense[name] = dequantize(q, s)
            n += 1
        else:
            fp8[name] = dense[name] = w
    cfg = json.loads((SRC / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                      weight_block_size=list(BLOCK))
    exp = json.loads((SRC / "expected.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp)
        shutil.copy(SRC / "config.json", ref / "config.json")
        save_file(dense, str(ref / "model.safetensors"), metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
        greedy = [greedy_reference(model, p)[0] for p in exp["prompts"]]
    DST.mkdir(exist_ok=True)
    save_file(fp8, str(DST / "model.safetensors"), metadata={"format": "pt"})
    (DST / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if (SRC / "generation_config.json").is_file():
        shutil.copy(SRC / "generation_config.json", DST / "generation_config.json")
    (DST / "expected.json").write_text(json.dumps(dict(
        reference="transformers, greedy, on the dequantized float32 checkpoint", quantized_weights=n,
        weight_block_size=list(BLOCK), transformers_version=transformers.__version__, torch_version=torch.__version__,
        prompts=exp["prompts"], max_new_tokens=exp["max_new_tokens"], greedy=greedy,
        unquantized_greedy=exp["greedy"]), indent=1) + "\n")
    print(f"wrote {DST}: {n} fp8 weights; greedy {'equals' if greedy == exp['greedy'] else 'differs from'} "
          "the float32 fixture's")


if __name__ == "__main__":
    main()
