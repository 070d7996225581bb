"""Hugging Face checkpoints: config.json + safetensors (single or sharded) + tokenizer.json.

Tensors are read with the `safetensors` library straight into the mesh's shardings: each device's
shard is read from the file by slice (`get_slice`), so no device ever holds a full copy of a
sharded weight and the host never materialises more than one shard at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy so safetensors can read bf16 tensors)
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from dcp_jax import mesh as mesh_lib
from dcp_jax.config import ModelConfig
from dcp_jax.errors import UserError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def expand_kv_rows(x: np.ndarray, rep: int, head_dim: int) -> np.ndarray:
    """Repeat each kv head's rows `rep` times along axis 0 (KV heads replicated over tp ranks)."""
    if rep == 1:
        return x
    heads = x.reshape((-1, head_dim) + x.shape[1:])
    return np.repeat(heads, rep, axis=0).reshape((-1,) + x.shape[1:])


def _kv_source_rows(rows: slice, n_rows: int, rep: int, head_dim: int) -> np.ndarray:
    """Rows of the original tensor that back rows `rows` of the kv-replicated one."""
    r = np.arange(n_rows)[rows]
    return (r // head_dim // rep) * head_dim + r % head_dim


class SafetensorsSource:
    """A WeightSource reading a Hugging Face safetensors checkpoint onto a mesh."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, mesh: Mesh, dtype):
        self.cfg, self.mesh, self.dtype = cfg, mesh, dtype
        self.files = _weight_map(model_dir)
        self._handles = {}
        for name in sorted(set(self.files.values())):
            path = model_dir / name
            try:
                self._handles[name] = safe_open(str(path), framework="numpy")
            except FileNotFoundError:
                raise UserError(f"weights file {path} is missing (listed in the checkpoint index)") from None
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise UserError(f"cannot read weights file {path}: {e} (truncated or corrupt?)") from None

    def __call__(self, name: str, shape, spec, kv_rep: int = 1) -> jax.Array:
        if name not in self.files:
            raise UserError(f"the checkpoint has no tensor {name!r}; is it a {self.cfg.architecture}?")
        tensor = self._handles[self.files[name]].get_slice(name)
        stored = tuple(tensor.get_shape())
        expected = (shape[0] // kv_rep,) + tuple(shape[1:])
        if stored != expected:
            raise UserError(f"tensor {name} has shape {stored}, config.json implies {expected}")
        dtype = self.dtype

        def read(index):
            try:
                if kv_rep == 1:
                    block = tensor[index]
                else:
                    src = _kv_source_rows(index[0], shape[0], kv_rep, self.cfg.head_dim)
                    lo, hi = int(src.min()), int(src.max()) + 1
                    block = np.asarray(tensor[(slice(lo, hi),) + tuple(index[1:])])[src - lo]
            except Exception as e:  # noqa: BLE001
                raise UserError(f"cannot read tensor {name}: {e} (truncated or corrupt weights?)") from None
            return np.asarray(block).astype(dtype)

        return jax.make_array_from_callback(tuple(shape), mesh_lib.named(self.mesh, spec), read)


def _weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> file name, from model.safetensors or a sharded checkpoint's index."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"cannot read {index}: {e}") from None
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors weights in {model_dir}")
    out = {}
    for f in files:
        try:
            with safe_open(str(model_dir / f), framework="numpy") as h:
                out.update({k: f for k in h.keys()})
        except Exception as e:  # noqa: BLE001
            raise UserError(f"cannot read weights file {model_dir / f}: {e} (truncated or corrupt?)") from None
    return out


def check_model_dir(model_dir) -> Path:
    path = Path(model_dir)
    if not path.exists():
        raise UserError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; --model takes a checkpoint directory")
    return path


def load_tokenizer(model_dir: Path):
    """The `tokenizers` Tokenizer from tokenizer.json, or None when the checkpoint has none."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot read {path}: {e}") from None


def load_hf(model_dir, mesh: Mesh, dtype: str = "float32"):
    """(model, tokenizer or None) from a Hugging Face checkpoint directory, placed on `mesh`."""
    from dcp_jax.model import CausalLM

    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = check_model_dir(model_dir)
    cfg = ModelConfig.from_file(path / "config.json")
    model = CausalLM(cfg, SafetensorsSource(path, cfg, mesh, DTYPES[dtype]), mesh)
    return model, load_tokenizer(path)
