"""Hugging Face checkpoints: config.json + safetensors (single or sharded) + tokenizer.json.

Tensors are read with the `safetensors` library straight into the mesh's shardings: each device's
shard is read from the file by slice (`get_slice`), so no device ever holds a full copy of a
sharded weight and the host never materialises more than one shard at a time.

FP8 block-scaled checkpoints (DeepSeek-V3/R1's format: `quantization_config` {"quant_method": "fp8",
"weight_block_size": [128, 128]}, each quantized linear weight float8_e4m3fn with a float32
`<name>_scale_inv` [⌈out/128⌉, ⌈in/128⌉]) are dequantized shard by shard as they are read: a device's
slice of the fp8 tensor times the scales of the blocks it covers, in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes  # registers bfloat16 with NumPy so safetensors can read bf16 tensors
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from dcp_jax import mesh as mesh_lib
from dcp_jax.chat_template import ChatTemplate, check_template, read_template
from dcp_jax.config import ModelConfig
from dcp_jax.errors import UserError
from dcp_jax.layers import expand_kv_rows, kv_source_rows, stack_names

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
if not hasattr(np, "float8_e4m3fn"):  # safetensors looks fp8 up on the numpy module; ml_dtypes has it
    np.float8_e4m3fn = ml_dtypes.float8_e4m3fn
DTYPE_NAMES = ("auto", *DTYPES)


def resolve_dtype(dtype: str, mesh: Mesh) -> str:
    """The weights' and KV's dtype name. "auto" (the default): bfloat16 where the mesh's devices are
    GPUs (float32 dots there run at full precision without tensor cores, and the cache is twice the
    size), float32 elsewhere (XLA:CPU computes bfloat16 dots in float32 anyway, and float32 stays exact
    against float32 references)."""
    if dtype == "auto":
        return "bfloat16" if mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm") else "float32"
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    return dtype


class SafetensorsSource:
    """A WeightSource reading a Hugging Face safetensors checkpoint onto a mesh."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, mesh: Mesh, dtype):
        self.cfg, self.mesh, self.dtype = cfg, mesh, dtype
        self.block = fp8_block(cfg.hf_config)  # (rows, cols) of a weight scale's block, or None
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

    def _tensor(self, name: str, expected: tuple):
        if name not in self.files:
            raise UserError(f"the checkpoint has no tensor {name!r}; is it a {self.cfg.architecture}?")
        tensor = self._handles[self.files[name]].get_slice(name)
        stored = tuple(tensor.get_shape())
        if stored != expected:
            raise UserError(f"tensor {name} has shape {stored}, config.json implies {expected}")
        return tensor

    def __call__(self, name: str, shape, spec, kv_rep: int = 1) -> jax.Array:
        shape = tuple(shape)
        dtype = self.dtype
        if "*" in name:  # a stack (e.g. the experts): each device reads only its members, by slice
            tensors = [self._tensor(n, shape[1:]) for n in stack_names(name, shape[0])]

            scales = [self._scales(n, shape[1:]) for n in stack_names(name, shape[0])]

            def read(index):
                members = range(shape[0])[index[0]]
                try:
                    block = np.stack([self._dequantize(np.asarray(tensors[j][tuple(index[1:])]), scales[j], index[1:],
                                                       shape[1:]) for j in members])
                except UserError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise UserError(f"cannot read tensor {name}: {e} (truncated or corrupt weights?)") from None
                return block.astype(dtype)
        else:
            stored = (shape[0] // kv_rep,) + shape[1:]
            tensor, scales = self._tensor(name, stored), self._scales(name, stored)

            def read(index):
                try:
                    if kv_rep == 1:
                        block = self._dequantize(np.asarray(tensor[index]), scales, index, stored)
                    else:
                        src = kv_source_rows(np.arange(shape[0])[index[0]], kv_rep,
                                             self.cfg.head_dim)
                        lo, hi = int(src.min()), int(src.max()) + 1
                        rows = (slice(lo, hi),) + tuple(index[1:])
                        block = self._dequantize(np.asarray(tensor[rows]), scales, rows, stored)[src - lo]
                except UserError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise UserError(f"cannot read tensor {name}: {e} (truncated or corrupt weights?)") from None
                return np.asarray(block).astype(dtype)

        return jax.make_array_from_callback(shape, mesh_lib.named(self.mesh, spec), read, dtype=jnp.dtype(dtype))


    def _scales(self, name: str, stored: tuple):
        """The float32 block scales of an fp8 weight (`<name>_scale_inv`, whole: they are small), or None
        for a weight stored in a float dtype."""
        key = name + "_scale_inv"
        if key not in self.files:
            return None
        if self.block is None:
            raise UserError(f"{key} is in the checkpoint but config.json has no fp8 quantization_config with "
                            "weight_block_size")
        want = tuple(-(-d // b) for d, b in zip(stored, self.block))
        scales = self._tensor(key, want)
        return np.asarray(scales[tuple(slice(None) for _ in want)], np.float32)

    def _dequantize(self, block: np.ndarray, scales, index, stored: tuple) -> np.ndarray:
        """`block` (the slice `index` of a weight of shape `stored`) times its blocks' scales, float32;
        as it is when the weight has none."""
        if scales is None:
            if block.dtype == ml_dtypes.float8_e4m3fn:
                raise UserError("an fp8 weight has no _scale_inv tensor beside it: the checkpoint is incomplete")
            return block
        idx = [np.arange(d)[i] if isinstance(i, slice) else np.asarray([i]) for i, d in zip(tuple(index), stored)]
        s = scales[np.ix_(*(ix // b for ix, b in zip(idx, self.block)))]
        return block.astype(np.float32) * s.reshape(block.shape)


def fp8_block(hf_config: dict) -> tuple[int, int] | None:
    """The weight block of an FP8 block-scaled checkpoint's quantization_config ((rows, cols)), None
    without one; UserError for a quantization this loader does not read."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise UserError(f"quantization {method!r} ({q.get('fmt', '')}) is not supported: dcp_jax reads fp8 "
                        "e4m3 block-scaled checkpoints (DeepSeek-V3's format) and unquantized ones")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"quantization_config weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


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
    """The path of a checkpoint: a directory, a GGUF file, or a known model's name
    (`dcp_jax.fetch`)."""
    from dcp_jax.fetch import resolve
    from dcp_jax.gguf_checkpoint import is_gguf

    path = resolve(model_dir)  # a known model's name: its file in the model cache
    if not path.exists():
        raise UserError(f"model path {path} does not exist")
    if not path.is_dir() and not is_gguf(path):
        raise UserError(f"{path} is neither a directory nor a GGUF file; --model takes a "
                        "checkpoint directory (Hugging Face or orbax) or a .gguf file")
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


def chat_template_of(model_dir: Path, source: str | None = None) -> ChatTemplate | None:
    """A Hugging Face directory's chat template: `chat_template` in tokenizer_config.json (named
    templates: the default one), else chat_template.jinja (what transformers 5 writes), else
    chat_template.json; BOS/EOS strings from tokenizer_config.json. None when it has none.
    `source`: this template's text instead of the directory's."""
    cfg = {}
    path = model_dir / "tokenizer_config.json"
    try:
        if path.is_file():
            cfg = json.loads(path.read_text())
        source = source or cfg.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source and (model_dir / "chat_template.jinja").is_file():
            source = (model_dir / "chat_template.jinja").read_text()
        if not source and (model_dir / "chat_template.json").is_file():
            path = model_dir / "chat_template.json"
            source = json.loads(path.read_text()).get("chat_template")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not source:
        return None

    def token(x):
        return (x.get("content", "") if isinstance(x, dict) else x) or ""

    return ChatTemplate(source, token(cfg.get("bos_token")), token(cfg.get("eos_token")))


def template_file(path, loaded: ChatTemplate | None, model_dir) -> ChatTemplate:
    """The chat template in the file `path` (vLLM's --chat-template), served instead of the
    checkpoint's `loaded` one, with its BOS/EOS strings (else the directory's)."""
    source = read_template(path)  # UserError naming the file when it is unreadable
    check_template(source, path)  # or does not parse
    if loaded is not None:
        return dataclasses.replace(loaded, source=source)
    model_dir = Path(model_dir)
    return (chat_template_of(model_dir, source) if model_dir.is_dir() else None) or ChatTemplate(source)


def load_hf(model_dir, mesh: Mesh, dtype: str = "auto", *, q_gather: bool = False, scan_layers: bool = True):
    """(model, tokenizer or None) from a Hugging Face checkpoint directory, placed on `mesh`
    (`q_gather`: see `CausalLM`)."""
    from dcp_jax.model import CausalLM

    dtype = resolve_dtype(dtype, mesh)
    path = check_model_dir(model_dir)
    cfg = ModelConfig.from_file(path / "config.json")
    model = CausalLM(cfg, SafetensorsSource(path, cfg, mesh, DTYPES[dtype]), mesh, q_gather=q_gather,
                     scan_layers=scan_layers)
    return model, load_tokenizer(path)


class ByteTokenizer:
    """Byte-level text <-> ids (ids are UTF-8 bytes), the vocabulary of the embedded default model.

    Same surface as `tokenizers.Tokenizer` where dcp_jax uses it: encode(text).ids, decode(ids),
    to_str(); and token_bytes(), each id's bytes (structured outputs' vocabulary:
    `dcp_jax.structured`).
    """

    KIND = "bytes"

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text: str):
        return self._Encoding(list(text.encode("utf-8")))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # (a byte tokenizer has no special tokens)
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_str(self) -> str:
        return self.KIND

    def token_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)]

    def get_vocab(self) -> dict[str, int]:  # one byte per token: a token stands for at most one character
        return {chr(i): i for i in range(256)}


def tokenizer_from_str(text: str | None):
    if not text:
        return None
    if text == ByteTokenizer.KIND:
        return ByteTokenizer()
    from tokenizers import Tokenizer

    return Tokenizer.from_str(text)


# --- orbax checkpoints ----------------------------------------------------------------------------
# A checkpoint directory is an orbax CheckpointManager root: one step directory per save, each holding
# the weights by Hugging Face name (KV heads un-replicated, so any mesh can restore them), the HF-style
# config and the tokenizer. Orbax writes a step into a temporary directory and renames it when it is
# complete, so an interrupted save leaves no step that looks whole and the previous one still loads.


def is_orbax_checkpoint(path: Path) -> bool:
    return path.is_dir() and not (path / "config.json").exists() and any(
        p.is_dir() and p.name.isdigit() for p in path.iterdir())


def _manager(path: Path, *, read_only: bool):
    import orbax.checkpoint as ocp

    # Loading never creates or deletes anything (create=False, nothing saved); orbax's read_only flag
    # would only add warnings.
    options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else 2, create=not read_only,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(path.absolute(), options=options, item_names=("weights", "meta"))


def check_save_target(path) -> None:
    """UserError unless the directory `path` may take an orbax checkpoint: not a file, and not a
    Hugging Face checkpoint's directory (a checkpoint beside its config.json would shadow it)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"cannot save to {path}: it is a file, not a directory")
    if (path / "config.json").exists():
        raise UserError(f"{path} holds a Hugging Face checkpoint; save to another directory")


def save_checkpoint(model, path, tokenizer=None,
                    chat_template: ChatTemplate | None = None) -> int:
    """Save `model` (its tokenizer and chat template) as a new step under `path`; returns the step
    number."""
    import orbax.checkpoint as ocp

    path = Path(path)
    check_save_target(path)
    meta = {"config": model.config.hf_config,
            "tokenizer": tokenizer.to_str() if tokenizer else None,
            "chat_template": dataclasses.asdict(chat_template) if chat_template else None}
    with _manager(path, read_only=False) as mngr:
        step = (mngr.latest_step() or 0) + 1
        mngr.save(step, args=ocp.args.Composite(weights=ocp.args.StandardSave(model.hf_weights()),
                                                meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()
    return step


class DictSource:
    """A WeightSource over restored arrays, expanding replicated KV heads on the mesh."""

    def __init__(self, arrays: dict, cfg: ModelConfig, mesh: Mesh, dtype):
        self.arrays, self.cfg, self.mesh, self.dtype = arrays, cfg, mesh, dtype

    def __call__(self, name, shape, spec, kv_rep=1):
        if name not in self.arrays:
            raise UserError(f"the checkpoint has no tensor {name!r}")
        x = self.arrays[name]
        # a module-level function with static arguments: jit's cache compiles it once per shape and placement
        expand = jax.jit(_expand, static_argnums=(1, 2, 3), out_shardings=mesh_lib.named(self.mesh, spec))
        return expand(x, kv_rep, self.cfg.head_dim, jnp.dtype(self.dtype))


def _expand(a, kv_rep: int, head_dim: int, dtype):
    return jnp.asarray(expand_kv_rows(a, kv_rep, head_dim), dtype)


def load_checkpoint(path, mesh: Mesh, dtype: str = "auto", *, scan_layers: bool = True):
    """(model, tokenizer or None, chat template or None, step) from an orbax checkpoint, restored
    onto `mesh`'s shardings."""
    import orbax.checkpoint as ocp
    from dcp_jax.model import CausalLM

    dtype = resolve_dtype(dtype, mesh)
    path = check_model_dir(path)
    with _manager(path, read_only=True) as mngr:
        step = mngr.latest_step()
        if step is None:
            raise UserError(f"{path} holds no complete orbax checkpoint")
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        cfg = ModelConfig.from_dict(meta["config"])
        # The shapes and shardings this mesh wants, from an abstract build (nothing allocated).
        wanted = {}

        def record(name, shape, spec, kv_rep=1):
            wanted[name] = (shape, spec, kv_rep)
            return jax.ShapeDtypeStruct(shape, DTYPES[dtype], sharding=mesh_lib.named(mesh, spec))

        CausalLM(cfg, record, mesh, scan_layers=scan_layers)  # abstract: every weight is a ShapeDtypeStruct
        target = {}
        for name, (shape, spec, rep) in wanted.items():
            stored = (shape[0] // rep,) + tuple(shape[1:])
            sharding = mesh_lib.named(mesh, spec if rep == 1 else mesh_lib.spec())
            target[name] = jax.ShapeDtypeStruct(stored, DTYPES[dtype], sharding=sharding)
        try:
            arrays = mngr.restore(step, args=ocp.args.Composite(weights=ocp.args.StandardRestore(target)))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise UserError(f"cannot restore {path} step {step}: {e}") from None
    model = CausalLM(cfg, DictSource(arrays["weights"], cfg, mesh, DTYPES[dtype]), mesh, scan_layers=scan_layers)
    template = meta.get("chat_template")
    template = template and ChatTemplate(**template)
    return model, tokenizer_from_str(meta.get("tokenizer")), template, step


class Loaded(NamedTuple):
    model: object  # a CausalLM
    tokenizer: object | None
    chat_template: ChatTemplate | None
    source: str  # what was loaded, in words


def load_any(model_dir, mesh: Mesh, dtype: str = "auto", *, scan_layers: bool = True) -> Loaded:
    """The model, tokenizer and chat template of a Hugging Face directory, an orbax checkpoint or a
    GGUF file."""
    path = check_model_dir(model_dir)
    if not path.is_dir():
        from dcp_jax.gguf_checkpoint import load_gguf

        dtype = resolve_dtype(dtype, mesh)
        model, tokenizer, template = load_gguf(path, mesh, DTYPES[dtype], scan_layers=scan_layers)
        return Loaded(model, tokenizer, template, f"GGUF file {path}")
    if is_orbax_checkpoint(path):
        model, tokenizer, template, step = load_checkpoint(path, mesh, dtype,
                                                           scan_layers=scan_layers)
        return Loaded(model, tokenizer, template, f"orbax checkpoint {path} (step {step})")
    if not (path / "config.json").exists():
        raise UserError(f"{path} is neither a Hugging Face checkpoint (no config.json) nor an orbax "
                        "checkpoint (no complete step directory)")
    model, tokenizer = load_hf(path, mesh, dtype, scan_layers=scan_layers)
    return Loaded(model, tokenizer, chat_template_of(path), f"Hugging Face checkpoint {path}")
