"""The GGUF quantization-type fixtures: tiny Llama checkpoints in llama.cpp's GGUF format whose
tensors, between them, use every ggml type the loader supports, and the weights transformers' GGUF
reader gives for each (tests/fixtures/gguf-types/).

Run by hand (NOT in CI; it needs torch, transformers and gguf), from the repository root:

    ../venv311/bin/python scripts/make_gguf_fixtures.py   # writes tests/fixtures/gguf-types/

Two files, written deterministically (no random state from NumPy's generators: the weights come from
a counter-based hash, so the test regenerates the original floats bit for bit):

- quant-types.gguf (1 layer): the types gguf-py can quantize: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1, each on its own tensors, quantized from known float weights (gguf.quants.quantize);
- k-quants.gguf (2 layers): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. gguf-py has no quantizer for these, so
  their blocks are made directly: random quant codes and sub-block scales with small, finite float16
  super-block scales `d`/`dmin`, laid out as gguf.quants' dequantize_blocks reads them.

The metadata is what llama.cpp's convert_hf_to_gguf.py writes for a llama model (general.*,
llama.block_count, context_length, embedding_length, feed_forward_length, attention.head_count,
attention.head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon, rope.dimension_count,
vocab_size; no tokenizer). attn_q/attn_k rows are permuted as the converter's LlamaModel.permute
does (see `permute`), so a reader must undo it. Hidden size 256: a K-quant block is 256 values of
a row.

expected.json records, per file and Hugging Face tensor name, what transformers'
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` gives in float32: shape, GGUF type, the
SHA-256 of the float32 bytes (C order) and 64 (flat index, value) samples; and, for the tensors
quantized from known floats, the seed and SHA-256 of those floats (`original_weights`), so a test
can check the loaded weights lie within the type's rounding of them (tests/test_gguf.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf-types"
CONFIG = {"hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 256, "vocab": 32,
          "context": 256, "rope_theta": 10000.0, "rms_eps": 1e-5}
N_SAMPLES = 64

# per file: layers, general.file_type (llama-quantize records its target type; a mixed file names
# one), and each tensor's ggml type ({n}: every layer; a name with a layer index overrides it).
# 1-D norms stay F32, as llama.cpp writes them.
FILES = {
    "quant-types.gguf": {
        "layers": 1, "file_type": gguf.LlamaFileType.MOSTLY_Q8_0,
        "types": {"token_embd": Q.Q5_1, "output": Q.F16, "blk.{n}.attn_q": Q.F16,
                  "blk.{n}.attn_k": Q.Q4_0, "blk.{n}.attn_v": Q.F32, "blk.{n}.attn_output": Q.Q8_0,
                  "blk.{n}.ffn_gate": Q.Q4_1, "blk.{n}.ffn_up": Q.BF16, "blk.{n}.ffn_down": Q.Q5_0},
    },
    "k-quants.gguf": {
        "layers": 2, "file_type": gguf.LlamaFileType.MOSTLY_Q4_K_M,
        "types": {"token_embd": Q.Q4_K, "output": Q.Q6_K, "blk.{n}.attn_q": Q.Q4_K,
                  "blk.{n}.attn_k": Q.Q5_K, "blk.{n}.attn_v": Q.Q6_K, "blk.{n}.attn_output": Q.Q3_K,
                  "blk.{n}.ffn_gate": Q.Q2_K, "blk.{n}.ffn_up": Q.Q5_K, "blk.{n}.ffn_down": Q.Q6_K,
                  "blk.1.attn_q": Q.Q2_K, "blk.1.attn_k": Q.Q3_K, "blk.1.ffn_up": Q.Q4_K},
    },
}

# GGUF tensor name (without ".weight") -> Hugging Face name
HF_NAMES = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight",
            "output": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

# the K-quant block layouts gguf.quants reads: bytes per 256-value block, the offsets of the float16
# super-block scales (d, then dmin where the type has one) and their sizes (values stay within
# 1 in magnitude)
K_QUANTS = {Q.Q2_K: (84, (80, 82), (0.5 / 45, 0.25 / 15)),
            Q.Q3_K: (110, (108,), (0.5 / 128,)),
            Q.Q4_K: (144, (0, 2), (0.5 / 945, 0.25 / 63)),
            Q.Q5_K: (176, (0, 2), (0.5 / 1953, 0.25 / 63)),
            Q.Q6_K: (210, (208,), (1.0 / 4096,))}
QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)


def hf_name(gguf_name: str) -> str:
    """A GGUF tensor name ("blk.0.attn_q.weight") -> its Hugging Face name."""
    base = gguf_name.removesuffix(".weight")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight"
    return HF_NAMES[base]


def hf_shapes(layers: int, cfg: dict = CONFIG) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the Hugging Face (out, in) shape of its weight, in the converter's
    order."""
    e, i, v = cfg["hidden"], cfg["intermediate"], cfg["vocab"]
    kv = cfg["kv_heads"] * e // cfg["heads"]
    shapes = {"token_embd.weight": (v, e)}
    for n in range(layers):
        shapes.update({f"blk.{n}.attn_norm.weight": (e,), f"blk.{n}.attn_q.weight": (e, e),
                       f"blk.{n}.attn_k.weight": (kv, e), f"blk.{n}.attn_v.weight": (kv, e),
                       f"blk.{n}.attn_output.weight": (e, e), f"blk.{n}.ffn_norm.weight": (e,),
                       f"blk.{n}.ffn_gate.weight": (i, e), f"blk.{n}.ffn_up.weight": (i, e),
                       f"blk.{n}.ffn_down.weight": (e, i)})
    shapes.update({"output_norm.weight": (e,), "output.weight": (v, e)})
    return shapes


def tensor_type(spec: dict, gguf_name: str) -> Q:
    base = gguf_name.removesuffix(".weight")
    if base.endswith("_norm"):
        return Q.F32
    if base in spec["types"]:
        return spec["types"][base]
    parts = base.split(".")
    return spec["types"][".".join(["blk", "{n}", *parts[2:]])]


def seed_of(file: str, gguf_name: str) -> int:
    """A stable seed per (file, tensor): the first 4 bytes of the SHA-256 of "file/tensor"."""
    return int.from_bytes(hashlib.sha256(f"{file}/{gguf_name}".encode()).digest()[:4], "little")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def original_weights(seed: int, shape, norm: bool = False) -> np.ndarray:
    """The float32 weights a quantizer-backed tensor is made from, in Hugging Face layout: a
    counter-based hash of (seed, index), so any NumPy gives the same bits. Values (u - 1/2) * 2^-k
    with u a 24-bit uniform and k in 0..3 (magnitudes over several octaves, small ones included);
    norms 1 + that / 8. Every step is exact in float32/float64."""
    n = int(np.prod(shape))
    with np.errstate(over="ignore"):
        z = _splitmix64(np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(1 << 32))
    u = (z >> np.uint64(40)).astype(np.float64) / 2.0 ** 24
    k = ((z >> np.uint64(8)) & np.uint64(3)).astype(np.float64)
    x = (u - 0.5) * 2.0 ** -k
    x = 1.0 + x / 8 if norm else x
    return x.astype(np.float32).reshape(shape)


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, applied to q_proj (n_head, n_head) and
    k_proj (n_head, n_head_kv): per head, the rows [first half; second half] (HF's rotate_half
    layout) become interleaved pairs (Meta's layout):
    w.reshape(h, 2, rows // h // 2, cols).swapaxes(1, 2).reshape(rows, cols), h = n_head_kv when
    given and different from n_head."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute` (transformers' LlamaTensorProcessor._reverse_permute_weights)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(2, 1).reshape(w.shape))


def permute_heads(gguf_name: str, cfg: dict = CONFIG) -> int | None:
    """The head count `permute` splits a tensor's rows by (None: not permuted)."""
    if ".attn_q." in gguf_name:
        return cfg["heads"]
    if ".attn_k." in gguf_name:
        return cfg["kv_heads"]
    return None


def k_quant_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid `qtype` blocks for a [rows, cols] tensor as uint8 [rows, cols / 256 * block bytes]:
    random codes and sub-block scales, float16 d (and dmin) in [1/2, 1] x the type's size."""
    nbytes, offsets, sizes = K_QUANTS[qtype]
    assert gguf.GGML_QUANT_SIZES[qtype] == (gguf.QK_K, nbytes) and cols % gguf.QK_K == 0
    rng = np.random.Generator(np.random.PCG64(seed))
    blocks = rng.integers(0, 256, size=(rows * cols // gguf.QK_K, nbytes), dtype=np.uint8)
    for offset, size in zip(offsets, sizes):
        scale = (size * rng.uniform(0.5, 1.0, size=(blocks.shape[0], 1))).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


def encode(qtype: Q, w: np.ndarray) -> np.ndarray:
    """Float weights in GGUF row order -> the array GGUFWriter.add_tensor stores as `qtype`."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def rounding_bound(qtype: Q, x: np.ndarray) -> np.ndarray:
    """Per element, how far `qtype`'s rounding (gguf.quants.quantize) may move the float32 weights
    `x` (rows a multiple of 32 long): F16/BF16 half an ulp of 11/8 significant bits (f16
    subnormals: 2^-25); the 32-value block types their step times the rounding each can make (a
    Q4_0/Q5_0 block's far end is clipped a whole step: d = max / -8 leaves +8 d out of range), plus
    the float16 rounding of the block's d (x 2^-11 per unit of the largest code) and m."""
    a = np.abs(x.astype(np.float64))
    if qtype == Q.F32:
        return np.zeros_like(a)
    if qtype == Q.F16:
        return a * 2.0 ** -11 + 2.0 ** -25
    if qtype == Q.BF16:
        return a * 2.0 ** -8
    blocks = x.astype(np.float64).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    lo, hi = blocks.min(axis=-1, keepdims=True), blocks.max(axis=-1, keepdims=True)
    bound = {Q.Q8_0: (0.5 + 128 * 2.0 ** -11) * amax / 127,
             Q.Q4_0: (1 + 8 * 2.0 ** -11) * amax / 8,
             Q.Q5_0: (1 + 16 * 2.0 ** -11) * amax / 16,
             Q.Q4_1: (0.5 + 16 * 2.0 ** -11) * (hi - lo) / 15 + np.abs(lo) * 2.0 ** -11,
             Q.Q5_1: (0.5 + 32 * 2.0 ** -11) * (hi - lo) / 31 + np.abs(lo) * 2.0 ** -11}[qtype]
    return np.broadcast_to(bound * (1 + 2.0 ** -20), blocks.shape).reshape(x.shape)


def add_metadata(writer: gguf.GGUFWriter, layers: int, cfg: dict, file_type: int) -> None:
    """The key-value metadata convert_hf_to_gguf.py writes for a llama-family model (no
    tokenizer); `cfg` may name a `head_dim` other than hidden / heads."""
    writer.add_name("gguf-types")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(layers)
    writer.add_context_length(cfg["context"])
    writer.add_embedding_length(cfg["hidden"])
    writer.add_feed_forward_length(cfg["intermediate"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_eps"])
    writer.add_file_type(int(file_type))
    writer.add_vocab_size(cfg["vocab"])
    head_dim = cfg.get("head_dim", cfg["hidden"] // cfg["heads"])
    if "head_dim" in cfg:  # heads not hidden / heads wide (Qwen3): what the converter records
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)


def write_gguf(path: Path, tensors: list[tuple[str, np.ndarray, Q]], layers: int,
               cfg: dict = CONFIG, arch: str = "llama",
               file_type: int = gguf.LlamaFileType.ALL_F32) -> None:
    """A GGUF file of `tensors` ([(GGUF name, stored array, type)]: float32/float16 arrays as they
    are, uint8 arrays as blocks of the type) and the llama metadata for `cfg`."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, layers, cfg, file_type)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def float_tensors(file: str, layers: int, cfg: dict = CONFIG, qtype=Q.F32):
    """[(GGUF name, stored array, type)] of a whole model from `original_weights`, every matrix as
    `qtype` (gguf-py quantizable), attn_q/attn_k permuted: the test's valid base file."""
    out = []
    for name, shape in hf_shapes(layers, cfg).items():
        x = original_weights(seed_of(file, name), shape, norm=len(shape) == 1)
        heads = permute_heads(name, cfg)
        x = x if heads is None else permute(x, cfg["heads"], heads)
        t = Q.F32 if len(shape) == 1 else qtype
        out.append((name, encode(t, x), t))
    return out


def build(file: str, spec: dict) -> tuple[list, dict]:
    """The tensors of one fixture file ([(GGUF name, stored array, type)]) and, per GGUF name, the
    float32 weights (HF layout) a reader should give and the original floats' seed (None:
    K-quant)."""
    tensors, want = [], {}
    for name, shape in hf_shapes(spec["layers"]).items():
        qtype, heads = tensor_type(spec, name), permute_heads(name)
        seed = seed_of(file, name)
        if qtype in QUANTIZABLE:
            x = original_weights(seed, shape, norm=len(shape) == 1)
            stored = encode(qtype, x if heads is None else permute(x, CONFIG["heads"], heads))
            deq = gguf.quants.dequantize(encode(qtype, x), qtype)  # rows quantize independently
        else:
            stored = k_quant_blocks(qtype, shape[0], shape[1], seed)
            deq, seed = gguf.quants.dequantize(stored, qtype), None
            deq = deq if heads is None else unpermute(deq, heads)
        tensors.append((name, stored, qtype))
        want[name] = (np.ascontiguousarray(deq, dtype=np.float32), seed)
    return tensors, want


def transformers_weights(path: Path) -> dict[str, np.ndarray]:
    """Hugging Face name -> float32 weight, as transformers' GGUF reader loads `path`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def sha256(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, dtype=np.float32).tobytes()).hexdigest()


def sample_indices(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, N_SAMPLES).round().astype(np.int64))


def record(file: str, spec: dict, ref: dict, want: dict) -> dict:
    """expected.json's entry for one file, checking transformers gave what the blocks hold."""
    tensors = {}
    for name, (deq, seed) in want.items():
        qtype, key = tensor_type(spec, name), hf_name(name)
        got = ref[key]
        assert got.dtype == np.float32 and np.array_equal(got, deq), (file, name)
        entry = {"gguf_name": name, "type": qtype.name, "shape": list(got.shape),
                 "sha256": sha256(got),
                 "samples": [[int(i), float(got.flat[i])] for i in sample_indices(got.size)],
                 "original": None}
        if seed is not None:
            x = original_weights(seed, got.shape, norm=got.ndim == 1)
            err = np.abs(got.astype(np.float64) - x)
            assert np.all(err <= rounding_bound(qtype, x)), (file, name)
            entry["original"] = {"seed": seed, "norm": got.ndim == 1, "sha256": sha256(x),
                                 "max_abs_error": float(err.max())}
        tensors[key] = entry
    extra = set(ref) - set(tensors)
    assert not extra, f"transformers gave tensors the file does not hold: {sorted(extra)}"
    return {"layers": spec["layers"], "file_type": int(spec["file_type"]),
            "types": sorted({e["type"] for e in tensors.values()}), "tensors": tensors}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    expected = {"config": CONFIG, "n_samples": N_SAMPLES, "files": {}}
    for file, spec in FILES.items():
        tensors, want = build(file, spec)
        path = OUT / file
        write_gguf(path, tensors, spec["layers"], file_type=spec["file_type"])
        expected["files"][file] = record(file, spec, transformers_weights(path), want)
        expected["files"][file]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        print(f"{path}: {path.stat().st_size} bytes, types {expected['files'][file]['types']}")
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{OUT / 'expected.json'}: {(OUT / 'expected.json').stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
