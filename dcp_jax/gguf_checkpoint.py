"""GGUF checkpoints (llama.cpp's one-file format): configuration, tensors, tokenizer, chat template.

Everything comes from the one file, read with the `gguf` package (ggml's own reader: a memory map
and numpy):

- the configuration from the architecture's metadata keys, as the Hugging Face config dict
  `ModelConfig.from_dict` reads (one parser of model configurations);
- each tensor by its Hugging Face name (gguf's own name map), each device reading and dequantizing
  only the rows of its slice into the compute dtype, as the safetensors path does; every ggml type
  the package dequantizes loads; llama.cpp's converter interleaves the two rotary halves of each
  head's Q and K rows for the `llama` architecture, and the read undoes it;
- the tokenizer (vocabulary, merges, pre-tokenizer, special tokens) as a `tokenizers` Tokenizer,
  and the chat template with the BOS/EOS strings it may use.

What it cannot load (an architecture, a tensor type, a tokenizer, a truncated file) is one
UserError.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.chat_template import ChatTemplate
from dcp_jax.config import ModelConfig
from dcp_jax.errors import UserError
from dcp_jax.layers import kv_source_rows, stack_names

MAGIC = b"GGUF"
# GGUF architecture -> the Hugging Face family it maps onto
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# architectures whose converter permutes Q/K rows (llama.cpp's LlamaModel.permute)
PERMUTED = ("llama",)


def is_gguf(path: Path) -> bool:
    """A regular file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def open_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, struct errors, ...
        raise UserError(f"cannot read GGUF file {path}: {e} (truncated or corrupt?)") from None


def metadata(reader) -> dict:
    """Every metadata key -> its value (arrays as lists), except the tensor list."""
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            out[name] = field.contents()
        except Exception as e:  # noqa: BLE001
            raise UserError(f"cannot read GGUF metadata {name!r}: {e} (corrupt file?)") from None
    return out


# --- configuration --------------------------------------------------------------------------------
def hf_config(meta: dict, tensors: dict) -> dict:
    """The Hugging Face config dict the file's metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"GGUF architecture {arch!r} is not supported; dcp_jax loads "
                        f"{', '.join(ARCHITECTURES)} GGUF files (or a Hugging Face directory)")

    def key(name, default=KeyError):
        value = meta.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise UserError(f"the GGUF file lacks metadata {arch}.{name}")
        return value[0] if isinstance(value, list) else value  # a per-layer list: all the same here

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    d = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_size": hidden,
         "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
         "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
         "head_dim": key("attention.key_length", hidden // heads),
         "max_position_embeddings": key("context_length"),
         "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
         "rope_theta": key("rope.freq_base", 10000.0),
         "vocab_size": key("vocab_size", None) or int(tensors["token_embd.weight"].shape[-1]),
         "tie_word_embeddings": "output.weight" not in tensors,
         "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
         "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    if "token_embd.weight" not in tensors:
        raise UserError("the GGUF file has no tensor 'token_embd.weight': not a language model?")
    if "rope_freqs.weight" in tensors:
        raise UserError("the GGUF file scales RoPE by a rope_freqs tensor (Llama 3.1 style), which "
                        "dcp_jax does not read yet: load the Hugging Face checkpoint instead")
    scaling = key("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        d["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor")}
        if scaling == "yarn":
            d["rope_scaling"]["original_max_position_embeddings"] = key(
                "rope.scaling.original_context_length")
    elif scaling != "none":
        raise UserError(f"the GGUF file's RoPE scaling {scaling!r} is not supported "
                        "(none, linear, yarn)")
    return d


# --- tensors --------------------------------------------------------------------------------------
def _source_rows(rows: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Stored rows behind Hugging Face rows `rows` of a permuted Q/K weight: the converter stores
    row (head h, half t, pair d) of each head at 2*d + t."""
    half = head_dim // 2
    h, j = rows // head_dim, rows % head_dim
    return h * head_dim + 2 * (j % half) + j // half


class GGUFSource:
    """A WeightSource reading a GGUF file's tensors by Hugging Face name onto a mesh."""

    def __init__(self, reader, arch: str, cfg: ModelConfig, mesh: Mesh, dtype):
        import gguf

        self.cfg, self.mesh, self.dtype, self.arch = cfg, mesh, dtype, arch
        self.tensors = {t.name: t for t in reader.tensors}
        model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
        self.names = gguf.get_tensor_name_map(model_arch, cfg.num_layers)
        for t in reader.tensors:  # every type is checked before anything is read
            self._rows(t, np.arange(1))

    def gguf_name(self, name: str) -> str:
        found = self.names.get_name(name, try_suffixes=(".weight", ".bias"))
        if found is None or found not in self.tensors:
            raise UserError(f"the GGUF file has no tensor for {name!r} ({found or 'unmapped'}); "
                            f"is it a complete {self.arch} model?")
        return found

    def _rows(self, tensor, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` of `tensor` (leading axes flattened), dequantized to float32."""
        import gguf

        data = tensor.data
        if data.ndim > 1:  # a stack of matrices (experts): one row axis
            data = data.reshape(-1, data.shape[-1])
        try:
            block = data[rows] if data.ndim > 1 else data
            if data.dtype != np.uint8:  # F32, F16, F64 and the integer types: stored as numbers
                return np.asarray(block, np.float32)
            return gguf.quants.dequantize(np.asarray(block), tensor.tensor_type)
        except NotImplementedError:
            raise UserError(f"tensor {tensor.name} has ggml type {tensor.tensor_type.name}, which "
                            "the gguf package cannot dequantize") from None
        except Exception as e:  # noqa: BLE001
            raise UserError(f"cannot read tensor {tensor.name}: {e} "
                            "(truncated or corrupt?)") from None

    def _heads(self, gguf_name: str) -> int | None:
        """Heads of a converter-permuted Q/K weight, None for every other tensor."""
        if self.arch not in PERMUTED or not gguf_name.endswith(".weight"):
            return None
        if ".attn_q." in gguf_name:
            return self.cfg.num_heads
        return self.cfg.num_kv_heads if ".attn_k." in gguf_name else None

    def read(self, name: str, shape: tuple, kv_rep: int):
        """A reader of `index` slices of `name`'s [shape] (kv heads replicated `kv_rep` times)."""
        gname = self.gguf_name(name)
        tensor, heads = self.tensors[gname], self._heads(gname)
        stored = (shape[0] // kv_rep,) + tuple(shape[1:])
        got = tuple(int(n) for n in reversed(tensor.shape))
        if got != stored:
            raise UserError(f"tensor {gname} has shape {got}, the metadata implies {stored}")

        def read(index):
            index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
            rows = np.arange(shape[0])[index[0]]
            if kv_rep > 1:
                rows = kv_source_rows(rows, kv_rep, self.cfg.head_dim)
            if heads is not None:
                rows = _source_rows(rows, heads, self.cfg.head_dim)
            if len(shape) == 1:
                return self._rows(tensor, rows)[rows].astype(self.dtype)
            return self._rows(tensor, rows)[(slice(None),) + index[1:]].astype(self.dtype)

        return read

    def __call__(self, name: str, shape, spec, kv_rep: int = 1) -> jax.Array:
        shape = tuple(shape)
        if "*" in name:  # a stack of layers: each device reads only its members
            readers = [self.read(n, shape[1:], kv_rep) for n in stack_names(name, shape[0])]

            def read(index):
                members = range(shape[0])[index[0]]
                return np.stack([readers[j](index[1:]) for j in members])
        else:
            read = self.read(name, shape, kv_rep)
        return jax.make_array_from_callback(shape, mesh_lib.named(self.mesh, spec), read,
                                            dtype=jnp.dtype(self.dtype))


# --- tokenizer ------------------------------------------------------------------------------------
# The text splits llama.cpp applies before byte-level BPE, by the file's `tokenizer.ggml.pre`
# (llama.cpp's llama-vocab.cpp); the model's merges were learned on text split this way.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo"), [GPT2_SPLIT]),
    # each digit alone, then GPT-2's split
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"),
                    [r"\p{N}", GPT2_SPLIT]),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                    [LLAMA3_SPLIT]),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), [QWEN2_SPLIT]),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def tokenizer(meta: dict):
    """The file's tokenizer as a `tokenizers` Tokenizer, or None when it describes none."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise UserError(f"the GGUF file's tokenizer is {kind!r}; dcp_jax reads byte-level BPE "
                        "('gpt2') tokenizers from GGUF files")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise UserError(f"the GGUF file's pre-tokenizer {pre!r} is not known; known: "
                        f"{', '.join(sorted(PRE_SPLITS))}")
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        from tokenizers import processors

        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, bos_id)])
    return tok


def chat_template(meta: dict):
    """The file's chat template with the BOS/EOS strings it may use, or None."""
    source = meta.get("tokenizer.chat_template")
    if not source:
        return None
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

    return ChatTemplate(source, token("bos_token_id"), token("eos_token_id"))


def load_gguf(path, mesh: Mesh, dtype, *, scan_layers: bool = True):
    """(model, tokenizer or None, chat template or None) from a GGUF file, placed on `mesh` in
    `dtype` (a jnp dtype)."""
    from dcp_jax.model import CausalLM

    path = Path(path)
    reader = open_reader(path)
    meta = metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = ModelConfig.from_dict(hf_config(meta, tensors))
    source = GGUFSource(reader, meta["general.architecture"], cfg, mesh, dtype)
    tok, template = tokenizer(meta), chat_template(meta)
    return CausalLM(cfg, source, mesh, scan_layers=scan_layers), tok, template
