"""The GPU check's correctness gate: every kernel path the engine can take, compiled for the
device and compared with float64 NumPy, in plain Python (a bare GPU machine has no pytest).

Paths (`Case.path`), each with odd lengths and an empty row:
  dense    a slice on one device or a dcp shard's strided / interleaved slot positions: decode
           rows, a prefill chunk after a cached prefix, one and several KV splits, head dims 128, 80
  chunk    a prefill chunk over its own keys, causal (T = S): the call a fused prefill kernel serves
  paged    pages of 16 / 64 / 128 slots in a shuffled pool, the layer-stacked pool of scanned layers
  verify   k + 1 query tokens per row (speculative decoding's verify step)
  ragged   a serving step's flat batch through `ragged_attention`: decode rows alone, and decode
           rows with chunks after cached prefixes, a whole prompt, verify-sized rows and idle rows
  split    that batch as the serving step runs it on a GPU: each prefill tile's pages below its
           first token, its diagonal block from the step's own keys and values (`diagonal_impl`:
           cuDNN where it takes the shapes), merged by LSE
  self     causal attention of dense tiles over their own keys and values (`api.self_attention`,
           what cuDNN serves), tiles of every length down to 0
  int8/fp8 8-bit pages (GQA and MLA) against the dequantized pages
  mla      DeepSeek's 576-wide latent whose first 512 features are the values, 16 / 64 / 128 heads
in float32 and bfloat16.

Bounds: the output's largest error over the reference's largest magnitude, and the LSE's error
over max(1, |lse|), each at most 1e-5 in float32 (the kernel's float32 dots run at HIGHEST
precision, not TF32) and 2e-2 in bfloat16; a row that sees nothing gives o = 0 and lse = -inf; no
NaN anywhere.

`KERNELS` names the implementations the gate compiles (names in pallas_kernels.attention's
registry) and the paths each serves: adding a backend is one line; an optional one the registry
lacks is listed as absent. `INTERPRET_KERNELS` is the same gate in Pallas' interpreter on a CPU.
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import SlotPositions, api, ragged
from pallas_kernels.attention import kv_quant as kvq

PATHS = ("dense", "chunk", "paged", "verify", "ragged", "split", "self", "int8", "fp8", "mla")
BOUNDS = {"float32": 1e-5, "bfloat16": 2e-2}
RAGGED_TILE = 32  # the engine's ragged_tile (dcp_jax.serving.config)


@dataclasses.dataclass(frozen=True)
class Kernel:
    impl: str  # the name `api.attention(..., impl=)` knows it by
    paths: tuple[str, ...]
    required: bool = True  # absent from the registry: the gate fails (else: listed as absent)
    options: bool = True  # takes the Pallas kernel's options (num_splits): cases that set them run


KERNELS = (
    Kernel("pallas", PATHS),
    Kernel("cudnn", ("self",), required=False, options=False),
)
INTERPRET_KERNELS = (Kernel("pallas_interpret", PATHS),)


def registered(impl: str) -> bool:
    """Whether pallas_kernels.attention's registry has the implementation (for any op)."""
    return impl in api.REGISTRY


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of a kernel path. `lengths`: kv_len per row (0: an empty row); `slots`: slots per
    row in the slice; `positions`: the slice's SlotPositions (start, run, stride), None for
    0..S-1; `q_lens` (ragged): the query tokens each row runs this step (0: an idle row)."""

    name: str
    path: str
    dtype: str
    heads: int
    kv_heads: int
    dk: int
    dv: int
    slots: int
    lengths: tuple[int, ...]
    t: int = 1  # query tokens per row (not ragged)
    page: int = 0  # 0: a dense slice
    shared_v: bool = False  # the values are the keys' first dv features (MLA)
    quant: str | None = None
    layered: bool = False
    positions: tuple[int, int, int] | None = None
    q_lens: tuple[int, ...] = ()
    options: tuple[tuple[str, int], ...] = ()


def cases(tiny: bool = False) -> list[Case]:
    """The gate's cases, most important first: the calls serving makes on every step lead. `tiny`:
    CPU sizes for Pallas' interpreter (the same paths; smaller slices, heads and head dims)."""
    s = 64 if tiny else 1024
    h, kh, d, d_odd = (4, 2, 32, 24) if tiny else (32, 8, 128, 80)
    p16, p64, p128 = (8, 16, 32) if tiny else (16, 64, 128)
    chunk, prompt, verify = (9, 7, 5) if tiny else (77, 37, 5)
    tile = 8 if tiny else RAGGED_TILE
    lens = (s, 0, s // 2 + 1, s - 25)
    shard, shard_lens = (1, 1, 2), (2 * s, 0, s + 1, 2 * s - 51)  # every second position from 1
    mixed = (1, 1, 30, 9, prompt, 0, 1, verify) if tiny else (1, 1, 300, 45, prompt, 0, 1, verify)
    mixed_len = ((s, 33, 50, 40, prompt, 0, s - 3, 20) if tiny
                 else (s, 517, 700, 601, prompt, 0, s - 25, 260))
    decode_len, decode_q = (s, s // 2 + 5, s - 25, 1, 63, 0, s // 3, s - 1), (1,) * 5 + (0, 1, 1)
    f32, bf16 = "float32", "bfloat16"
    gqa = dict(heads=h, kv_heads=kh, dk=d, dv=d, slots=s)
    paged, one, eight = dict(gqa, page=p64), (("num_splits", 1),), (("num_splits", 8),)

    def mla(heads, page=p64):
        return dict(heads=heads, kv_heads=1, dk=576, dv=512, shared_v=True, slots=s, page=page)

    return [
        Case("paged decode page 64", "paged", bf16, **paged, lengths=lens),
        Case("ragged mixed page 64", "ragged", bf16, **paged, lengths=mixed_len, q_lens=mixed),
        Case("ragged decode-only page 64", "ragged", bf16, **paged, lengths=decode_len,
             q_lens=decode_q),
        Case("verify 5 page 64", "verify", bf16, **paged, lengths=lens, t=verify),
        Case("int8 paged decode page 64", "int8", bf16, **paged, lengths=lens, quant="int8"),
        Case("fp8 paged decode page 64", "fp8", bf16, **paged, lengths=lens, quant="fp8"),
        Case("mla 128 heads decode page 64", "mla", bf16, **mla(128), lengths=lens),
        Case("dense decode", "dense", bf16, **gqa, lengths=lens),
        Case("dense decode 1 split", "dense", f32, **gqa, lengths=lens, options=one),
        Case("dense decode 8 splits", "dense", bf16, **gqa, lengths=lens, options=eight),
        Case(f"dense chunk {chunk} after a prefix", "dense", bf16, **gqa, lengths=lens, t=chunk),
        Case("dense dcp shard verify 3", "dense", f32, **gqa, lengths=shard_lens, t=3,
             positions=shard),
        Case("dense interleaved head dim 80", "dense", bf16, **dict(gqa, dk=d_odd, dv=d_odd),
             lengths=(2 * s, 0, s + 7, 2 * s - 9), positions=(p16, p16, 2 * p16)),
        Case(f"chunk causal {s // 4}", "chunk", f32, **dict(gqa, slots=s // 4), t=s // 4,
             lengths=(s // 4,) * 2),
        Case(f"chunk causal {s // 2}", "chunk", bf16, **dict(gqa, slots=s // 2), t=s // 2,
             lengths=(s // 2,) * 2),
        Case("paged decode page 16", "paged", bf16, **dict(paged, page=p16), lengths=lens),
        Case("paged decode page 128", "paged", bf16, **dict(paged, page=p128), lengths=lens),
        Case("paged decode 1 split", "paged", f32, **paged, lengths=lens, options=one),
        Case("paged decode 8 splits", "paged", f32, **paged, lengths=lens, options=eight),
        Case("paged chunk after a prefix", "paged", bf16, **paged, lengths=lens, t=chunk + 23),
        Case("paged decode stacked layers", "paged", bf16, **paged, lengths=lens, layered=True),
        Case("paged dcp shard decode", "paged", bf16, **paged, lengths=shard_lens,
             positions=shard),
        Case("verify 3 page 16", "verify", f32, **dict(paged, page=p16), lengths=lens, t=3),
        Case("ragged mixed page 16 dcp shard", "ragged", f32, **dict(paged, page=p16),
             positions=shard, lengths=tuple(min(2 * x, 2 * s) for x in mixed_len), q_lens=mixed),
        Case("ragged mixed mla int8", "int8", bf16, **mla(16), lengths=mixed_len, q_lens=mixed,
             quant="int8"),
        Case("int8 verify 5 page 16", "int8", f32, **dict(paged, page=p16), lengths=lens,
             t=verify, quant="int8"),
        Case("int8 mla 64 heads decode", "int8", bf16, **mla(64), lengths=lens, quant="int8"),
        Case("fp8 mla 128 heads decode", "fp8", bf16, **mla(128), lengths=lens, quant="fp8"),
        Case("mla 16 heads decode", "mla", bf16, **mla(16), lengths=lens),
        Case("mla 64 heads decode", "mla", bf16, **mla(64), lengths=lens),
        Case("mla 16 heads chunk", "mla", bf16, **mla(16), lengths=lens, t=chunk // 2),
        Case("mla 16 heads decode float32 page 16", "mla", f32, **mla(16, p16), lengths=lens),
        Case("split mixed page 64", "split", bf16, **paged, lengths=mixed_len, q_lens=mixed),
        Case("split mixed float32 page 16", "split", f32, **dict(paged, page=p16),
             lengths=mixed_len, q_lens=mixed),
        Case("split mixed mla", "split", bf16, **mla(16), lengths=mixed_len, q_lens=mixed),
        Case("self tiles", "self", bf16, **gqa, t=2 * tile, lengths=(2 * tile, tile + 5, 0, 1)),
        Case("self tiles float32", "self", f32, **gqa, t=tile, lengths=(tile, 7, 0)),
    ]


# --- inputs and the float64 oracle --------------------------------------------------------------

def compile_apart(fn, *args, **jit_kw):
    """(the compiled program, seconds its compile took): compile and run are timed apart."""
    t = time.perf_counter()
    exe = jax.jit(fn, **jit_kw).lower(*args).compile()
    return exe, time.perf_counter() - t


def values(rng, shape, dtype: str, quant: str | None = None):
    """(what the kernel reads, the float64 values it stands for): an array of `dtype`, or 8-bit rows
    (`kv_quant.pack`) standing for their dequantized values."""
    x = rng.standard_normal(shape).astype(np.float32)
    if quant is not None:
        stored = kvq.pack(jnp.asarray(x), quant)
        return stored, np.asarray(kvq.unpack(stored, quant), np.float64)
    stored = jnp.asarray(x, dtype)
    return stored, np.asarray(stored.astype(jnp.float32), np.float64)


def to_pages(x, page: int, order):
    """[B, K, S, D] as a pool [P, K, page, D]: sequence b's page j goes to pool page
    order[b * S/page + j] (a shuffled pool, as an allocator leaves it); the two spare pages hold
    values that would show if read (100s; 8-bit pools: the largest byte)."""
    b, kh, s, d = x.shape
    pages = jnp.swapaxes(x.reshape(b, kh, s // page, page, d), 1, 2)
    pages = pages.reshape(b * s // page, kh, page, d)
    fill = 100 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).max
    return jnp.full((len(order) + 2, kh, page, d), fill, x.dtype).at[order].set(pages)


def oracle(q, k, v, q_pos, kv_len, slot_pos, scale):
    """Float64 attention. q [B,T,H,Dk], k [B,K,S,Dk], v [B,K,S,Dv]; slot_pos [S]: the positions the
    slots hold. A slot is seen iff slot_pos <= q_pos and slot_pos < kv_len. Returns (o [B,T,H,Dv],
    lse [B,T,H]); a row that sees nothing gets o = 0, lse = -inf. Query head i reads kv head
    i // (H / K); the scores are batched matmuls (BLAS), per kv head over its T·G query rows."""
    b, t, h, dk = q.shape
    kh, g = k.shape[1], h // k.shape[1]
    rows = q.reshape(b, t, kh, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, dk)
    scores = (rows @ k.transpose(0, 1, 3, 2) * scale).reshape(b, kh, t, g, -1)
    seen = ((slot_pos[None, None] <= q_pos[:, :, None])
            & (slot_pos[None, None] < kv_len[:, None, None]))  # [B, T, S]
    scores = np.where(seen[:, None, :, None], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    has = np.isfinite(m)
    p = np.exp(scores - np.where(has, m, 0.0))
    total = np.where(has, p.sum(axis=-1, keepdims=True), 1.0)
    o = (p.reshape(b, kh, t * g, -1) @ v).reshape(b, kh, t, g, -1) / total
    lse = np.where(has, m + np.log(total), -np.inf)[..., 0]  # [B, K, T, G]
    o = o.transpose(0, 2, 1, 3, 4).reshape(b, t, h, -1)
    return o, lse.transpose(0, 2, 1, 3).reshape(b, t, h)


def compare(o, lse, ref_o, ref_lse) -> dict:
    """o_err, lse_err (the module docstring's) and `problem` when the output cannot be compared."""
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    if np.isnan(o).any() or np.isnan(lse).any():
        return dict(o_err=float("inf"), lse_err=float("inf"), problem="NaN in the output")
    if not np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)):
        n = int(np.sum(np.isneginf(lse) != np.isneginf(ref_lse)))
        return dict(o_err=float("inf"), lse_err=float("inf"),
                    problem=f"{n} rows disagree on seeing nothing (lse = -inf)")
    o_err = float(np.max(np.abs(o - ref_o)) / max(float(np.max(np.abs(ref_o))), 1e-30))
    fin = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(lse[fin] - ref_lse[fin]) / np.maximum(1.0, np.abs(ref_lse[fin])))
                    if fin.any() else 0.0)
    return dict(o_err=o_err, lse_err=lse_err, problem=None)


def _kv(case: Case, rng, rows: int):
    """The case's keys and values as the kernel reads them (paged when case.page) and in float64."""
    kv = (case.dtype, case.quant)
    k, ref_k = values(rng, (rows, case.kv_heads, case.slots, case.dk), *kv)
    v, ref_v = (None, ref_k[..., :case.dv]) if case.shared_v else values(
        rng, (rows, case.kv_heads, case.slots, case.dv), *kv)
    call = dict(k=k, v=v)
    if case.page:
        nb = case.slots // case.page
        order = rng.permutation(rows * nb + 2)[:rows * nb]
        call = {n: None if x is None else to_pages(x, case.page, order) for n, x in call.items()}
        call["block_table"] = jnp.asarray(order.reshape(rows, nb), jnp.int32)
    if case.layered:  # layer 1 of a stacked pool; layer 0 holds the same pages in another order
        for n in ("k", "v"):
            if call[n] is not None:
                call[n] = jnp.stack([call[n][::-1], call[n]])
        call["layer"] = jnp.int32(1)
    return call, ref_k, ref_v


def _positions(case: Case):
    pos = SlotPositions(*case.positions) if case.positions else SlotPositions.dense(case.slots)
    return pos, np.asarray(pos.at(np.arange(case.slots)))


def _kwargs(case: Case, impl: str) -> dict:
    return dict(impl=impl, v_dim=case.dv if case.shared_v else None, kv_quant=case.quant,
                **dict(case.options))


def batched_call(case: Case, impl: str):
    """(fn, args, reference, None) of a case of `api.attention`: B rows of t queries each, the
    last t positions of each row's length; reference() -> the float64 (o, lse)."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    call, ref_k, ref_v = _kv(case, rng, len(case.lengths))
    lengths = np.asarray(case.lengths, np.int32)
    q_pos = (np.maximum(lengths, 1)[:, None] - case.t + np.arange(case.t)).astype(np.int32)
    q, ref_q = values(rng, (len(lengths), case.t, case.heads, case.dk), case.dtype)
    call.update(q=q, q_pos=jnp.asarray(q_pos), kv_len=jnp.asarray(lengths))
    pos, slot_pos = _positions(case)
    kw = _kwargs(case, impl)

    def fn(c):
        return api.attention(c["q"], c["k"], c["v"], c["q_pos"], pos, c["kv_len"],
                             block_table=c.get("block_table"), layer=c.get("layer"), **kw)

    def reference():
        return oracle(ref_q, ref_k, ref_v, q_pos, lengths, slot_pos, 1.0 / np.sqrt(case.dk))

    return fn, (call,), reference, None


def ragged_call(case: Case, impl: str):
    """(fn, args, reference, the real tokens) of a case of `api.ragged_attention`: the rows' q_lens
    tokens end to end (each row's last ones), padded as a step's bucket is, cut into tiles by
    `ragged.plan` as the engine cuts them; reference() -> the float64 (o, lse) of every token."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    rows = len(case.lengths)
    call, ref_k, ref_v = _kv(case, rng, rows)
    lens, lengths = np.asarray(case.q_lens, np.int32), np.asarray(case.lengths, np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    n = -(-(int(lens.sum()) + 1) // 16) * 16
    q, ref_q = values(rng, (n, case.heads, case.dk), case.dtype)
    q_pos, real = np.zeros(n, np.int32), np.zeros(n, bool)
    for s0, m, length in zip(starts, lens, lengths):
        q_pos[s0:s0 + m], real[s0:s0 + m] = length - m + np.arange(m), True
    tiles = ragged.plan(starts, lens, np.arange(rows), n, ragged.group_shapes(n, rows, RAGGED_TILE),
                        positions=lengths - lens)
    call.update(q=q, q_pos=jnp.asarray(q_pos), kv_len=jnp.asarray(lengths))
    pos, slot_pos = _positions(case)
    kw = _kwargs(case, impl)
    if case.path == "split":  # the step's own keys and values, as it writes them to the pages
        call["fresh"] = _fresh(case, ref_k, ref_v, q_pos, starts, lens, n)

    def fn(c, tiles):
        return api.ragged_attention(c["q"], c["k"], c["v"], c["q_pos"], pos, c["kv_len"],
                                    c["block_table"], tiles, layer=c.get("layer"),
                                    fresh=c.get("fresh"), **kw)

    def reference():
        ref_o = np.zeros((n, case.heads, case.dv))
        ref_lse = np.full((n, case.heads), -np.inf)
        for r, (s0, m) in enumerate(zip(starts, lens)):
            if m:
                o, lse = oracle(ref_q[None, s0:s0 + m], ref_k[r:r + 1], ref_v[r:r + 1],
                                q_pos[None, s0:s0 + m], lengths[r:r + 1], slot_pos,
                                1.0 / np.sqrt(case.dk))
                ref_o[s0:s0 + m], ref_lse[s0:s0 + m] = o[0], lse[0]
        return ref_o, ref_lse

    return fn, (call, tiles), reference, real


def _fresh(case: Case, ref_k, ref_v, q_pos, starts, lens, n):
    """Each flat token's key and value from its row's (dense: slot = position) float64 ones, in the
    case's dtype; zero for padding."""
    k = np.zeros((n, case.kv_heads, case.dk))
    v = np.zeros((n, case.kv_heads, case.dv))
    for r, (s0, m) in enumerate(zip(starts, lens)):
        k[s0:s0 + m] = ref_k[r][:, q_pos[s0:s0 + m]].swapaxes(0, 1)
        v[s0:s0 + m] = ref_v[r][:, q_pos[s0:s0 + m]].swapaxes(0, 1)
    return jnp.asarray(k, case.dtype), None if case.shared_v else jnp.asarray(v, case.dtype)


def self_call(case: Case, impl: str):
    """(fn, args, reference, the tiles' real rows) of a case of `api.self_attention`: len(lengths)
    tiles of t tokens, tile w's first lengths[w] real; reference() -> the float64 (o, lse)."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    w, t = len(case.lengths), case.t
    q, ref_q = values(rng, (w, t, case.heads, case.dk), case.dtype)
    k, ref_k = values(rng, (w, t, case.kv_heads, case.dk), case.dtype)
    v, ref_v = values(rng, (w, t, case.kv_heads, case.dv), case.dtype)
    lengths = np.asarray(case.lengths, np.int32)
    real = np.arange(t)[None, :] < lengths[:, None]

    def fn(c):
        return api.self_attention(c["q"], c["k"], c["v"], c["lengths"], impl=impl)

    def reference():
        q_pos = np.broadcast_to(np.arange(t), (w, t))
        return oracle(ref_q, ref_k.transpose(0, 2, 1, 3), ref_v.transpose(0, 2, 1, 3), q_pos,
                      lengths, np.arange(t), 1.0 / np.sqrt(case.dk))

    return fn, (dict(q=q, k=k, v=v, lengths=jnp.asarray(lengths)),), reference, real


def check_case(case: Case, impl: str) -> dict:
    """Compile the case for the device (timed), run it once (timed) and compare with float64."""
    make = self_call if case.path == "self" else ragged_call if case.q_lens else batched_call
    fn, args, reference, real = make(case, impl)
    exe, compile_s = compile_apart(fn, *args)
    t = time.perf_counter()
    o, lse = jax.block_until_ready(exe(*args))
    run_s = time.perf_counter() - t
    o, lse = np.asarray(o.astype(jnp.float32)), np.asarray(lse)
    ref_o, ref_lse = reference()
    if real is not None:
        o, lse, ref_o, ref_lse = o[real], lse[real], ref_o[real], ref_lse[real]
    err = compare(o, lse, ref_o, ref_lse)
    bound = BOUNDS[case.dtype]
    passed = err["problem"] is None and max(err["o_err"], err["lse_err"]) <= bound
    problem = err["problem"] or (None if passed else (
        f"o error {err['o_err']:.2e}, lse error {err['lse_err']:.2e} > {bound:g}"))
    return dict(path=case.path, dtype=case.dtype, compile_s=compile_s, run_s=run_s,
                o_err=err["o_err"], lse_err=err["lse_err"], bound=bound, passed=passed,
                problem=problem)


def gate(row, rec: dict, kernels=KERNELS, tiny: bool = False, names=None) -> None:
    """Every case of every kernel, each through `row(name, fn, kind)` (the check's row runner: it
    runs fn unless the row's measured cost does not fit, and returns the row's record), summed up
    in `rec` as it goes: planned, passed, failures (each named with its error and bound), not_run,
    and `verdict`, true once every planned case ran and passed. `names`: only the cases so named."""
    chosen = [c for c in cases(tiny) if names is None or c.name in names]
    plan = []
    rec.update(kernels={}, failures=[], not_run=[], passed=0, verdict=False)
    for kernel in kernels:
        if not registered(kernel.impl):
            rec["kernels"][kernel.impl] = "absent from pallas_kernels' registry"
            if kernel.required:
                rec["failures"].append(f"{kernel.impl}: absent from pallas_kernels' registry")
            continue
        mine = [c for c in chosen
                if c.path in kernel.paths and (kernel.options or not c.options)]
        rec["kernels"][kernel.impl] = len(mine)
        plan += [(kernel.impl, c) for c in mine]
    rec["planned"] = len(plan)
    for impl, case in plan:
        name = f"{impl}: {case.name}"
        r = row(name, lambda impl=impl, case=case: check_case(case, impl), f"gate {case.path}")
        if r.get("passed"):
            rec["passed"] += 1
        elif r.get("status") == "skipped":
            rec["not_run"].append(name)
        else:
            rec["failures"].append(f"{name}: {r.get('problem') or r.get('error')}")
        rec["verdict"] = rec["passed"] == rec["planned"] > 0 and not rec["failures"]
