"""Random-weight Hugging Face Llama checkpoints for the benchmarks (written atomically, read by any
loader that reads a real checkpoint: config.json + model.safetensors)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """Each layer's linear weights: name under `model.layers.{i}.` -> shape [out, in]."""
    e, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    h, k = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"self_attn.q_proj": (h, e), "self_attn.k_proj": (k, e), "self_attn.v_proj": (k, e),
            "self_attn.o_proj": (e, h), "mlp.gate_proj": (i, e), "mlp.up_proj": (i, e), "mlp.down_proj": (e, i)}


def hf_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face Llama weights, [out, in]: normal * 0.02, norms = 1."""
    rng = np.random.default_rng(seed)
    e, v = cfg["hidden_size"], cfg["vocab_size"]

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    out = {"model.embed_tokens.weight": w(v, e)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out.update({f"{p}.{name}.weight": w(*shape) for name, shape in linear_shapes(cfg).items()})
        out.update({
            f"{p}.input_layernorm.weight": np.ones(e, np.float32),
            f"{p}.post_attention_layernorm.weight": np.ones(e, np.float32),
        })
    out["model.norm.weight"] = np.ones(e, np.float32)
    out["lm_head.weight"] = w(v, e)
    return out


def ensure_checkpoint(path: Path, cfg: dict) -> Path:
    """`path` as is when it holds a config.json; else write a random checkpoint of `cfg` there
    (atomically: a temporary sibling renamed into place)."""
    from safetensors.numpy import save_file

    path = Path(path).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"error: {path} exists but has no config.json; give an empty or new --checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_file(hf_tensors(cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp made it private
        if path.exists():
            path.rmdir()
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
