"""Per-shard attention kernels: the reference against float64 NumPy, the Pallas kernel (interpret mode)
against the reference, and the Pallas kernel lowered for CUDA on this CPU-only machine."""

import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from pallas_kernels.attention import SlotPositions, attention, configs
from pallas_kernels.attention import reference as ref_kernel
from pallas_kernels.attention import kv_quant as kv_quant_lib
from pallas_kernels.attention import triton as triton_kernel
from tests.util import assert_lse_close, dense_attention, rel_err

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Set on a GPU machine with pytest, these tests run with the kernel compiled for the GPU instead of
# interpreted (scripts/gpu_check.sh's correctness gate, scripts/gpu_gate.py, checks the same paths
# without pytest); set without a GPU, they run the device's shapes in the interpreter.
ON_DEVICE = bool(os.environ.get("DCP_JAX_KERNEL_TESTS_ON_DEVICE"))
PALLAS = "pallas" if ON_DEVICE and jax.default_backend() == "gpu" else "pallas_interpret"


def dim(d: int) -> int:
    """A head dim for a test that runs PALLAS: as written in the interpreter (odd dims exercise the
    power-of-two pieces), rounded up to the compiled kernel's multiple of 16 for the device."""
    return -(-d // configs.MIN_BLOCK) * configs.MIN_BLOCK if ON_DEVICE else d


def make_inputs(b, t, h, kh, s, dk, dv, dtype=jnp.float32, seed=0, stride=1, runs=None):
    """Random inputs over a slice whose slots hold positions 0, stride, 2·stride, ... (like a dcp shard),
    or, with runs=(start, run, stride), runs of `run` positions as an interleaved shard holds them.

    Lengths are ragged; sequence 1 has nothing cached; queries are the last t positions of each sequence,
    so some rows (negative positions) see no slot at all.
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, dk))
    k = rng.standard_normal((b, kh, s, dk))
    v = rng.standard_normal((b, kh, s, dv))
    kv_pos = SlotPositions(*(runs or (0, 1, stride)))
    end = int(kv_pos.at(s - 1)) + 1
    lengths = rng.integers(1, end + 1, size=b).astype(np.int32)
    lengths[0] = end
    if b > 1:
        lengths[1] = 0
    q_pos = (np.maximum(lengths, 1)[:, None] - t + np.arange(t)[None, :]).astype(np.int32)
    return dict(q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype),
                q_pos=jnp.asarray(q_pos), kv_pos=kv_pos, kv_len=jnp.asarray(lengths))


def attend(call, **static):
    """`attention(**call, **static)` as one jitted program, as the engine runs it (called eagerly, every op
    of the wrapper and of the walk would compile as a program of its own: ~1,500 compiles in this file)."""
    return jax.jit(lambda c: attention(**c, **static))(call)


def check_against_oracle(o, lse, x, tol):
    scale = 1.0 / np.sqrt(x["q"].shape[-1])
    ref_o, ref_lse = dense_attention(x["q"].astype(jnp.float32), x["k"].astype(jnp.float32),
                                     x["v"].astype(jnp.float32), x["q_pos"], x["kv_len"], scale,
                                     kv_pos=x["kv_pos"].at(np.arange(x["k"].shape[2])))
    assert not np.isnan(np.asarray(o, np.float32)).any()
    assert rel_err(o, ref_o) <= tol, rel_err(o, ref_o)
    assert_lse_close(lse, ref_lse, tol)
    return ref_o


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,h,kh,dk,dv,stride", [
    (1, 8, 2, 16, 16, 1),   # decode, GQA 4
    (5, 4, 4, 16, 8, 3),    # prefill chunk, MHA, Dk != Dv, strided (interleaved) slot positions
    (2, 8, 1, 24, 16, 2),   # MLA-like: one shared kv head, wider key than value
])
def test_reference_matches_float64(dtype, t, h, kh, dk, dv, stride):
    x = make_inputs(3, t, h, kh, 12, dk, dv, dtype, stride=stride)
    o, lse = attend(x, impl="reference")
    assert o.dtype == dtype and lse.dtype == jnp.float32
    ref_o = check_against_oracle(o, lse, x, TOL[dtype])
    np.testing.assert_array_equal(np.asarray(o[1], np.float32), 0.0)  # nothing cached: zeros
    assert np.isneginf(np.asarray(lse[1])).all()
    assert np.abs(ref_o[0]).max() > 0


@pytest.mark.parametrize("t,h,kh,s,dk,dv,dtype,runs,opts", [
    (1, 8, 2, 40, 16, 16, jnp.float32, (0, 1, 2), dict(block_k=16)),   # decode; 3 blocks, ragged tail
    (16, 2, 2, 24, dim(8), dim(12), jnp.float32, (4, 4, 12), dict(block_k=16, num_splits=2)),  # prefill, Dk != Dv
    (1, 8, 2, 40, 16, 16, jnp.float32, (0, 1, 2), dict(block_k=16, num_splits=3)),  # splits of visible blocks
    (3, 8, 2, 50, 16, 16, jnp.float32, (0, 1, 1), dict(block_q=16, block_k=16, num_splits=2)),  # 2 query blocks
    (1, 4, 1, 32, dim(24), 16, jnp.bfloat16, (1, 1, 3), dict(block_k=16)),  # shared kv head (MLA-like)
])
def test_pallas_interpret_matches_reference(t, h, kh, s, dk, dv, dtype, runs, opts):
    x = make_inputs(2, t, h, kh, s, dk, dv, dtype, runs=runs)
    o_ref, lse_ref = attend(x, impl="reference")
    o, lse = attend(x, impl=PALLAS, **opts)
    tol = TOL[dtype]
    assert o.dtype == dtype
    assert rel_err(o, o_ref) <= tol
    assert_lse_close(lse, lse_ref, tol)
    check_against_oracle(o, lse, x, tol)


@pytest.mark.parametrize("impl,opts", [("reference", dict(block_k=8)), (PALLAS, dict(block_k=16))])
def test_values_shared_with_keys(impl, opts):
    # MLA's latent cache: k is [latent | rope], v = k[..., :v_dim], passed as v=None (no copy).
    dk = dim(24)
    x = make_inputs(2, 2, 8, 1, 40, dk, 16, runs=(2, 2, 8))
    x["v"] = x["k"][..., :16]
    o_ref, lse_ref = attend(x, impl="reference")
    shared = dict(x, v=None)
    o, lse = attend(shared, impl=impl, v_dim=16, **opts)
    assert o.shape == o_ref.shape
    assert rel_err(o, o_ref) <= 1e-5
    assert_lse_close(lse, lse_ref, 1e-5)
    check_against_oracle(o, lse, x, 1e-5)
    with pytest.raises(ValueError, match=f"v_dim must be in 1..{dk}"):
        attention(**shared, impl=impl)
    with pytest.raises(ValueError, match="v_dim is only for v=None"):
        attention(**x, v_dim=16)


@pytest.mark.parametrize("block_k,runs", [(4, (0, 1, 3)), (8, (8, 4, 16))])
def test_reference_blocked_walk(block_k, runs):
    # Several blocks, ragged lengths (the walk stops early for short sequences): same as float64.
    x = make_inputs(3, 2, 4, 2, 24, 8, 8, runs=runs)
    o, lse = attend(x, impl="reference", block_k=block_k)
    check_against_oracle(o, lse, x, 1e-5)


@pytest.mark.parametrize("block_k,block_k_masked", [(8, 8), (8, 3), (16, 5), (64, 7)])
@pytest.mark.parametrize("runs", [(0, 1, 1), (2, 2, 6)])
@pytest.mark.parametrize("t", [1, 6])
def test_reference_unmasked_and_masked_blocks(block_k, block_k_masked, runs, t):
    # One long sequence and a query block (t=1: decode, every slot seen by every query): the blocks
    # before the diagonal take the unmasked loop body, the rest the masked one in smaller blocks,
    # the last of them shifted back; block_k >= S is a single masked block.
    x = make_inputs(1, t, 4, 2, 40, 8, 8, runs=runs)
    o, lse = attend(x, impl="reference", block_k=block_k, block_k_masked=block_k_masked)
    check_against_oracle(o, lse, x, 1e-5)


def test_unknown_impl_and_bad_options():
    x = make_inputs(1, 1, 2, 2, 8, 8, 8)
    with pytest.raises(ValueError, match="unknown attention impl"):
        attention(**x, impl="cuda")
    options = r"\['block_k', 'block_k_masked', 'pages_per_step'\]"
    with pytest.raises(ValueError, match=rf"takes kernel options {options}, got \['num_splits'\]"):
        attention(**x, impl="reference", num_splits=2)


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((1, 1, 2, 8, 1))), "ranks"),
    (dict(k=jnp.zeros((2, 2, 8, 8)), v=jnp.zeros((2, 2, 8, 8))), "batch mismatch"),
    (dict(k=jnp.zeros((1, 2, 8, 4)), ), "key head dim mismatch"),
    (dict(q=jnp.zeros((1, 1, 3, 8))), "multiple of kv heads"),
    (dict(v=jnp.zeros((1, 2, 7, 8))), "disagree"),
    (dict(q_pos=jnp.zeros((1, 2), jnp.int32)), "q_pos must be"),
    (dict(kv_pos=jnp.arange(8)), "kv_pos must be a SlotPositions"),
    (dict(kv_len=jnp.zeros((2,), jnp.int32)), "kv_len must be"),
    (dict(kv_len=jnp.zeros((1,), jnp.float32)), "integer"),
])
def test_bad_shapes(change, match):
    x = make_inputs(1, 1, 2, 2, 8, 8, 8)
    x.update(change)
    with pytest.raises(ValueError, match=match):
        attention(**x)


# --- the query-tiled kernel: long prefill chunks over cached prefixes
# --------------------------------

@pytest.mark.parametrize("b,t,h,kh,prefix,runs,dtype,opts", [
    # a 4096-token chunk after a 512-token cached prefix, ragged batch (one sequence empty, one
    # shorter than the chunk: its first rows see nothing)
    (3, 4096, 2, 1, 512, None, jnp.float32, dict(block_q=128, block_k=128)),
    (2, 1000, 8, 2, 300, (2, 2, 8), jnp.float32, dict(block_q=64, block_k=32)),   # G=4, interleaved shard
    (2, 257, 4, 4, 100, (0, 1, 3), jnp.bfloat16, dict(block_q=32, block_k=16)),   # G=1 (MHA), strided
    (2, 96, 8, 1, 40, None, jnp.float32, dict(block_q=64, block_k=16)),           # G=8
    (2, 300, 4, 2, 64, (1, 1, 2), jnp.float32, {}),                               # G=2, the table's blocks
])
def test_tiled_prefill_matches_float64(b, t, h, kh, prefix, runs, dtype, opts):
    runs = runs or (0, 1, 1)
    s = math.ceil((prefix + t) / runs[2]) * runs[1]  # slots holding positions up to prefix + t
    x = make_inputs(b, t, h, kh, s, 16, 16, dtype, runs=runs)
    o, lse = attend(x, impl=PALLAS, **opts)
    assert o.dtype == dtype and lse.dtype == jnp.float32
    check_against_oracle(o, lse, x, TOL[dtype])
    assert np.isneginf(np.asarray(lse[1])).all()  # the empty sequence sees nothing, no NaN


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dk,dv,g", [(128, 128, 1), (128, 128, 4), (128, 128, 8), (256, 256, 4), (576, 512, 16)])
def test_block_shapes_do_not_depend_on_the_chunk(dtype, dk, dv, g):
    # Prefill configs (hence shared memory) are the same for every chunk length, and always fit.
    itemsize = jnp.dtype(dtype).itemsize
    picks = {configs.pick(t * g, dk, dv, itemsize, shared_v=dk == 576) for t in (256, 512, 1024, 2048, 4096)}
    assert len(picks) == 1, picks
    (phase, cfg), = picks
    assert phase == "prefill"
    assert configs.smem_bytes(cfg, dk, dv, itemsize, dk == 576) <= configs.SMEM_LIMIT
    for rows in (1, 4, 16, 64, 128):  # decode: each KV tile read at most twice, within shared memory
        phase, cfg = configs.pick(rows, dk, dv, itemsize, shared_v=dk == 576)
        assert configs.smem_bytes(cfg, dk, dv, itemsize, dk == 576) <= configs.SMEM_LIMIT
        assert phase == "prefill" or math.ceil(rows / cfg.block_q) <= configs.DECODE_READS


def test_head_pieces():
    assert configs.head_pieces(576) == ((0, 512), (512, 64))
    assert configs.head_pieces(80) == ((0, 64), (64, 16))
    assert configs.head_pieces(128) == ((0, 128),)


def waves_used(programs, kv_blocks, splits, slots):
    """(fraction of the wave slots the grid fills, time in units of one KV block)."""
    waves = math.ceil(programs * splits / slots)
    return programs * splits / (waves * slots), waves * math.ceil(kv_blocks / splits)


def test_splits_fill_whole_waves():
    # The GPU check's decode shape: batch 8, 32 q / 8 kv heads, d 128, bf16, 32K keys. The decode
    # entry holds 3 programs per SM (70 KiB of shared memory each), so a wave is 396 programs; 64
    # programs × 6 splits = 384 fill one wave (97%). The old rule (2 waves of SMs, one program each)
    # took 5 splits: 320 programs = 2.42 waves of 132, i.e. three waves' time for 2.42 waves' work.
    _, cfg = configs.pick(4, 128, 128, 2)
    ctas = configs.ctas_per_sm(cfg, 128, 128, 2)
    assert ctas == 3
    blocks = 32768 // cfg.block_k
    splits = configs.num_splits(programs=64, kv_blocks=blocks, sms=132, ctas=ctas)
    assert splits == 6
    fill, time = waves_used(64, blocks, splits, 132 * ctas)
    assert fill >= 0.95
    old_fill, old_time = waves_used(64, blocks, 5, 132)
    assert old_fill < 0.85 and time * ctas < old_time  # the same work in fewer block-times per SM slot
    # whole-wave choice against every other split count (the cost it minimises is waves × blocks per
    # split)
    for programs, kv_blocks, c in [(64, 512, 3), (8, 2048, 2), (24, 96, 1), (128, 4096, 2), (1, 64, 4)]:
        best = configs.num_splits(programs, kv_blocks, sms=132, ctas=c)
        most = min(kv_blocks // configs.MIN_BLOCKS_PER_SPLIT, configs.MAX_SPLITS)
        assert 1 <= best <= max(most, 1)
        assert all(waves_used(programs, kv_blocks, best, 132 * c)[1] <= waves_used(programs, kv_blocks, n, 132 * c)[1]
                   for n in range(1, most + 1))
    assert configs.num_splits(programs=4096, kv_blocks=256, sms=132, ctas=1) == 1  # a prefill grid is full
    assert configs.num_splits(programs=1, kv_blocks=3, sms=132) == 1                # splits of >= 8 blocks
    assert configs.num_splits(programs=1, kv_blocks=4096, sms=132, ctas=2) == configs.MAX_SPLITS


@pytest.mark.parametrize("dk,dv,shared_v", [(64, 64, False), (128, 128, False), (256, 256, False), (576, 512, True)])
def test_decode_entries_hold_several_programs_per_sm(dk, dv, shared_v):
    # bf16 decode: 2-3 (or more) programs per SM at every row count a decode call takes, shared
    # memory and the float32 accumulator's registers within bounds for every entry of the table.
    for rows in (1, 4, 8, 16, 32, 64):
        phase, cfg = configs.pick(rows, dk, dv, 2, shared_v)
        assert phase == "decode"
        # (MLA's full head block of 64 rows is one program per SM by design: its 32-token tiles)
        least = 1 if shared_v and rows == 64 else 2
        assert configs.ctas_per_sm(cfg, dk, dv, 2, shared_v) >= least, (rows, cfg)
    bucket = next(d for d in (128, 256, 1024) if max(dk, dv) <= d)
    for phase in ("decode", "prefill"):
        cfg = configs.TABLE[(phase, bucket)]
        # the float32 accumulator [block_q, Dv] over the program's threads: at most 128 of a
        # thread's 255 registers (the rest hold scores and addresses)
        assert cfg.block_q * dv / (cfg.num_warps * 32) <= 128, (phase, cfg)
        assert configs.smem_bytes(cfg, dk, dv, 2, shared_v) <= configs.SMEM_LIMIT, (phase, cfg)


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_mla_decode_reads_each_latent_tile_at_most_twice(heads):
    # DeepSeek decode: all query heads share one latent kv head, so the folded rows are the heads.
    # At 128 heads the call stays a decode call (two query blocks of 64 rows), not the prefill
    # entry's 4 blocks of 32; one block at 64 heads or fewer.
    phase, cfg = configs.pick(heads, 576, 512, 2, shared_v=True)
    assert phase == "decode"
    assert math.ceil(heads / cfg.block_q) == (1 if heads <= 64 else 2)
    assert configs.ctas_per_sm(cfg, 576, 512, 2, True) >= (2 if heads < 64 else 1)
    text = lower_for_cuda(2, 1, heads, 1, 4096, 576, 512, jnp.bfloat16, shared_v=True, page=64)
    assert large_copies(text, 2 * 4096 * 576 // 2) == []


def test_pallas_gpu_needs_head_dims_in_pieces_of_16():
    x = make_inputs(1, 1, 2, 2, 8, 24, 24)
    with pytest.raises(ValueError, match="multiples of 16"):
        triton_kernel.attention(**x, scale=0.1)


# --- paged KV: the same attention read through a block table
# ---------------------------------------

def to_pages(x, page, seed=0, spare=3):
    """A dense slice x [B, K, S, D] as a page pool [P, K, page, D] + block table [B, S / page]: pages
    shuffled, page 0 (the null page) and `spare` unused pages filled with values that would show if read."""
    b, kh, s, d = x.shape
    nb = s // page
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.arange(1, 1 + spare + b * nb))[: b * nb].reshape(b, nb)  # same for k and v
    pool = rng.standard_normal((1 + spare + b * nb, kh, page, d)) * 100
    xs = np.asarray(x, np.float32).reshape(b, kh, nb, page, d)
    for bi in range(b):
        for j in range(nb):
            pool[order[bi, j]] = xs[bi, :, j]
    return jnp.asarray(pool, x.dtype), jnp.asarray(order, jnp.int32)


def paged(x, page):
    """The attention call `x` (make_inputs') over page pools of its k and v, with their block table."""
    (k_pool, table), (v_pool, _) = to_pages(x["k"], page), to_pages(x["v"], page)
    return dict(x, k=k_pool, v=v_pool, block_table=table)


@pytest.mark.parametrize("impl,opts", [("reference", dict(block_k=16, block_k_masked=8)),
                                       ("reference", {}), (PALLAS, dict(block_k=16)), (PALLAS, {})])
@pytest.mark.parametrize("t,h,kh,dk,dv,page,runs,dtype", [
    (1, 8, 2, 16, 16, 16, (0, 1, 2), jnp.float32),      # decode on a dcp shard, GQA 4
    (37, 4, 2, 32, 16, 32, (2, 2, 8), jnp.float32),     # prefill chunk over an interleaved shard, Dk != Dv
    (1, 4, 4, 16, 16, 16, (0, 1, 1), jnp.bfloat16),     # MHA, bf16
])
def test_paged_matches_float64(impl, opts, t, h, kh, dk, dv, page, runs, dtype):
    x = make_inputs(3, t, h, kh, 4 * page, dk, dv, dtype, runs=runs)
    o, lse = attend(paged(x, page), impl=impl, **opts)
    check_against_oracle(o, lse, x, TOL[dtype])


@pytest.mark.parametrize("impl", ["reference", PALLAS])
def test_paged_values_shared_with_keys(impl):
    # MLA's latent pool: one kv head, values = the keys' first v_dim features.
    x = make_inputs(2, 2, 8, 1, 64, dim(24), 16, runs=(1, 1, 4))
    x["v"] = x["k"][..., :16]
    k_pool, table = to_pages(x["k"], 16)
    o, lse = attend(dict(x, k=k_pool, v=None, block_table=table), impl=impl, v_dim=16)
    check_against_oracle(o, lse, x, 1e-5)


def test_paged_bad_table():
    x = make_inputs(2, 1, 2, 2, 32, 16, 16)
    k_pool, table = to_pages(x["k"], 16)
    with pytest.raises(ValueError, match="block_table must be"):
        attention(**dict(x, k=k_pool, v=k_pool), block_table=table[:1])
    with pytest.raises(ValueError, match="page_size 24 needs a power-of-two divisor >= 16"):
        triton_kernel.attention(**dict(x, k=jnp.zeros((4, 2, 24, 16)), v=jnp.zeros((4, 2, 24, 16))),
                                scale=0.1, block_table=jnp.zeros((2, 2), jnp.int32))


@pytest.mark.parametrize("impl", ["reference", PALLAS])
@pytest.mark.parametrize("in_pages", [False, True])
def test_layer_of_stacked_caches_is_read_in_place(impl, in_pages):
    # Scanned layers keep their caches stacked [L, ...]: the kernels read layer i (traced) in place,
    # the same result as the cache of that layer alone.
    x = make_inputs(2, 3, 8, 2, 32, 16, 16, runs=(1, 1, 2))
    rng = np.random.default_rng(3)
    others = [jnp.asarray(rng.standard_normal(x["k"].shape), jnp.float32) for _ in range(2)]
    k, v, extra = x["k"], x["v"], {}
    if in_pages:
        (k, table), (v, _) = to_pages(k, 16), to_pages(v, 16)
        others = [to_pages(o, 16)[0] for o in others]
        extra = dict(block_table=table)
    k_stack = jnp.stack([others[0], k, others[1]])
    v_stack = jnp.stack([others[1], v, others[0]])
    o, lse = attend(dict(x, k=k_stack, v=v_stack, layer=jnp.int32(1), **extra), impl=impl)  # layer traced
    check_against_oracle(o, lse, x, 1e-5)


# --- what a step reads: only the last block masked, the walk over the filled part only
# ------------------

class BlockCounter:
    """Counts the KV blocks each program visits through a kernel's `block_probe` (interpret mode)."""

    def __init__(self, module, monkeypatch):
        self.seen = []  # (program or None, masked, start, slots)
        monkeypatch.setattr(module, "block_probe", self)

    def __call__(self, masked, *args):
        if len(args) == 2:  # reference: (slots, start)
            self.seen.append((None, bool(masked), int(args[1]), int(args[0])))
        else:  # kernel: (batch, kv head, q block, split, start)
            self.seen.append((tuple(int(a) for a in args[:4]), bool(masked), int(args[4]), None))

    def programs(self):
        out = {}
        for prog, masked, start, _ in self.seen:
            out.setdefault(prog, []).append((masked, start))
        return out


@pytest.mark.parametrize("in_pages", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_masks_only_the_last_block_and_walks_the_filled_part(monkeypatch, in_pages, splits):
    # Decode over a 512-slot slice filled to 200 (and 208: whole blocks) of it, block_k 16: each
    # program visits only blocks holding slots < the length (13 blocks, none of the 19 empty ones),
    # every block exactly once over the splits, and masks at most one: the one the length ends
    # inside.
    for length in (200, 208):
        x = make_inputs(1, 1, 4, 2, 512, 16, 16)
        x["kv_len"] = jnp.asarray([length], jnp.int32)
        x["q_pos"] = jnp.asarray([[length - 1]], jnp.int32)
        call = paged(x, 16) if in_pages else x
        counter = BlockCounter(triton_kernel, monkeypatch)
        o, _ = attend(call, impl="pallas_interpret", block_k=16, num_splits=splits)
        jax.block_until_ready(o)
        by_program = counter.programs()
        assert {p[:3] for p in by_program} == {(0, 0, 0), (0, 1, 0)}  # one query block per kv head
        for head in (0, 1):
            visits = [v for p, vs in by_program.items() if p[1] == head for v in vs]
            starts = sorted(start for _, start in visits)
            assert starts == list(range(0, length, 16)), (length, starts)  # the filled part, each block once
            masked = [start for m, start in visits if m]
            assert masked == ([] if length % 16 == 0 else [length // 16 * 16])


def test_kernel_masks_only_the_diagonal_of_a_prefill_chunk(monkeypatch):
    # A 48-token chunk after a 100-token prefix (one kv head, G = 2: 16-row query blocks of 8
    # tokens): each query block masks only the blocks its own 8 tokens end inside (at most 2 of 16
    # slots), walks nothing past its last token, and reads the prefix unmasked.
    x = make_inputs(1, 48, 2, 1, 512, 16, 16)
    x["kv_len"] = jnp.asarray([148], jnp.int32)
    x["q_pos"] = jnp.asarray(100 + np.arange(48)[None], jnp.int32)
    counter = BlockCounter(triton_kernel, monkeypatch)
    o, lse = attend(x, impl="pallas_interpret", block_q=16, block_k=16, num_splits=1)
    check_against_oracle(o, lse, x, 1e-5)
    by_program = counter.programs()
    assert len(by_program) == 6
    for (_, _, qb, _), visits in by_program.items():
        first_tok, last_tok = 100 + 8 * qb, 100 + 8 * qb + 7
        starts = sorted(s for _, s in visits)
        assert starts == list(range(0, last_tok + 1, 16))  # up to the block holding its last token
        masked = sorted(s for m, s in visits if m)
        assert masked == list(range(first_tok // 16 * 16, last_tok + 1, 16)) and len(masked) <= 2


@pytest.mark.parametrize("in_pages", [False, True])
def test_reference_masks_only_the_tail_and_walks_the_filled_part(monkeypatch, in_pages):
    # The CPU path's block walk: decode at 300 of 1024 slots, blocks of 64 unmasked and 16 masked: 4
    # unmasked blocks (256 slots) and 3 masked ones (48 slots); nothing past slot 303 of the 1024 is
    # read. (A paged decode row walks pages by default: pages_per_step=0 asks for the block walk.)
    x = make_inputs(1, 1, 4, 2, 1024, 8, 8)
    x["kv_len"] = jnp.asarray([300], jnp.int32)
    x["q_pos"] = jnp.asarray([[299]], jnp.int32)
    call = paged(x, 16) if in_pages else dict(x)
    counter = BlockCounter(ref_kernel, monkeypatch)
    o, lse = attend(call, impl="reference", block_k=64, block_k_masked=16, pages_per_step=0)
    check_against_oracle(o, lse, x, 1e-5)
    unmasked = sorted((s, n) for _, m, s, n in counter.seen if not m)
    masked = sorted((s, n) for _, m, s, n in counter.seen if m)
    assert unmasked == [(0, 64), (64, 64), (128, 64), (192, 64)]
    assert masked == [(256, 16), (272, 16), (288, 16)]


@pytest.mark.parametrize("in_pages", [False, True])
def test_reference_reads_nothing_for_queries_that_see_nothing(monkeypatch, in_pages):
    # A ragged step's unused tiles (position -1) and empty rows: the CPU path visits no KV block for
    # them (a step pads its tile groups with such tiles, so each would otherwise cost a block per
    # layer) and returns o = 0, lse = -inf; a query block where some rows see something walks only
    # what they see.
    x = make_inputs(2, 3, 4, 2, 256, 8, 8)
    x["kv_len"] = jnp.asarray([100, 0], jnp.int32)
    x["q_pos"] = jnp.asarray([[-1, -1, -1], [5, 6, 7]], jnp.int32)
    call = paged(x, 16) if in_pages else dict(x)
    counter = BlockCounter(ref_kernel, monkeypatch)
    o, lse = attend(call, impl="reference", block_k=64, block_k_masked=16)
    jax.block_until_ready(o)
    assert counter.seen == []
    assert not np.asarray(o).any() and np.isneginf(np.asarray(lse)).all()
    x["q_pos"] = jnp.asarray([[-1, 20, 40], [5, 6, 7]], jnp.int32)  # row 0 sees up to slot 40
    call["q_pos"] = x["q_pos"]
    counter.seen.clear()
    o, lse = attend(call, impl="reference", block_k=64, block_k_masked=16)
    check_against_oracle(o, lse, x, 1e-5)
    assert sorted((s, n) for _, _, s, n in counter.seen) == [(0, 16), (16, 16), (32, 16)]


def test_reference_walks_a_short_slice_page_by_page(monkeypatch):
    # A slice shorter than one unmasked block (a serving pool of short requests: 3 pages of 64) is
    # walked a page at a time by the block walk with the default block sizes, up to the last page
    # some query sees: one whole-slice block would read all 192 slots of every tile of a ragged step
    # whose prompts see a few dozen. (Tiles of up to 8 tokens walk pages by default:
    # pages_per_step=0 asks for blocks.)
    x = make_inputs(2, 4, 4, 2, 192, 8, 8)
    x["kv_len"] = jnp.asarray([20, 100], jnp.int32)
    x["q_pos"] = jnp.asarray([[16, 17, 18, 19], [96, 97, 98, 99]], jnp.int32)
    call = paged(x, 64)
    counter = BlockCounter(ref_kernel, monkeypatch)
    o, lse = attend(call, impl="reference", pages_per_step=0)
    check_against_oracle(o, lse, x, 1e-5)
    assert sorted((s, n) for _, _, s, n in counter.seen) == [(0, 64), (64, 64)]
    counter.seen.clear()
    call["kv_len"], call["q_pos"] = x["kv_len"].at[1].set(10), x["q_pos"].at[1].set(jnp.arange(6, 10))
    jax.block_until_ready(attend(call, impl="reference", pages_per_step=0))  # both within the first page: one block
    assert [(s, n) for _, _, s, n in counter.seen] == [(0, 64)]
    # a slice no block of at least half the masked size tiles (37 slots, blocks of 16): the last
    # block overlaps
    x = make_inputs(2, 3, 4, 2, 37, 8, 8)
    counter.seen.clear()
    o, lse = attend(x, impl="reference", block_k_masked=16)
    check_against_oracle(o, lse, x, 1e-5)
    assert {n for _, _, _, n in counter.seen} == {16}


@pytest.mark.parametrize("t,runs,quant", [(1, None, None), (3, (1, 2, 8), None), (1, None, "int8")])
def test_reference_walks_pages_of_decode_rows_each_up_to_its_own_length(monkeypatch, t, runs, quant):
    # Paged rows of at most 8 query tokens (decode, verify, a ragged step's decode tiles) walk
    # pages: each row reads its own pages up to the last slot it may see, not the furthest row's
    # span, 4 pages a step (so steps mix rows and the last step ends past the last page); on a dcp
    # shard's interleaved slots too. The result is the oracle's, and the block walk's
    # (pages_per_step=0) to float32 rounding.
    x = make_inputs(4, t, 4, 2, 320, 16, 16, runs=runs)
    end = int(x["kv_pos"].at(319)) + 1
    x["kv_len"] = jnp.asarray([end, 0, 37, 150], jnp.int32)
    x["q_pos"] = jnp.asarray(np.maximum(np.asarray(x["kv_len"]), 1)[:, None] - t + np.arange(t), jnp.int32)
    call = paged(x, 16)
    if quant:
        call = dict(call, k=kv_quant_lib.pack(call["k"], quant), v=kv_quant_lib.pack(call["v"], quant))
    counter = BlockCounter(ref_kernel, monkeypatch)
    o, lse = attend(call, impl="reference", pages_per_step=4, kv_quant=quant)
    if quant is None:
        check_against_oracle(o, lse, x, 1e-5)
    visible = np.asarray(x["kv_pos"].count_upto(np.asarray(x["q_pos"]).max(axis=1)))  # slots each row sees
    visible = np.minimum(visible, 320) * (np.asarray(x["kv_len"]) > 0)
    want = sorted((16 * j, 16) for n in visible for j in range(-(-int(n) // 16)))
    assert sorted((s, n) for _, _, s, n in counter.seen) == want
    assert len(want) < 4 * 20  # not every row over the longest one's 20 pages
    o_blocks, lse_blocks = attend(call, impl="reference", pages_per_step=0, kv_quant=quant)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_blocks), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_blocks), rtol=1e-5, atol=1e-5)


# --- lowering for CUDA without a GPU (the lowering convention in docs/ARCHITECTURE.md)
# -------------------------------------------------

def lower_for_cuda(b, t, h, kh, s, dk, dv, dtype, shared_v=False, page=0, layers=0, kv_quant=None, **opts):
    """The kernel exported for CUDA; with `page`, over a pool of s // page pages of `page` slots per
    sequence (b·s/page pages in all) through a block table; `kv_quant`: over 8-bit rows (values + scale)."""
    kv = (b, kh, s) if not page else (b * s // page, kh, page)
    kv = ((layers,) if layers else ()) + kv
    kv_dtype = kv_quant_lib.storage_dtype(kv_quant, dtype)
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in [
        ((b, t, h, dk), dtype), (kv + (kv_quant_lib.width(dk, kv_quant),), kv_dtype),
        (kv + (kv_quant_lib.width(dv, kv_quant),), kv_dtype), ((b, t), jnp.int32), ((), jnp.int32), ((b,), jnp.int32)]]
    args[4] = SlotPositions(args[4], 4, 32)  # interleave 4 over 8 shards; start traced
    if page:
        args.append(jax.ShapeDtypeStruct((b, s // page), jnp.int32))

    if layers:
        args.append(jax.ShapeDtypeStruct((), jnp.int32))

    def f(q, k, v, q_pos, kv_pos, kv_len, *rest):
        table = rest[0] if page else None
        layer = rest[-1] if layers else None
        return triton_kernel.attention(q, k, None if shared_v else v, q_pos, kv_pos, kv_len, scale=0.1,
                                       v_dim=dv if shared_v else None, block_table=table, layer=layer,
                                       kv_quant=kv_quant, **opts)
    gpu = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
    with jax.sharding.use_abstract_mesh(gpu):
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    return exported.mlir_module()


_TENSOR = re.compile(r"tensor<((?:\d+x)*)[a-z]+\d*>")


COPY_OPS = {f"stablehlo.{op}" for op in
            ("pad", "concatenate", "slice", "dynamic_slice", "transpose", "copy", "gather", "reverse")}


def large_copies(text: str, elements: int) -> list[str]:
    """Lines of the lowered module whose op moves data (pad, concatenate, slice, transpose, copy, ...)
    and reads or makes a tensor of >= `elements` elements."""
    found = []
    for line in text.splitlines():
        op = re.search(r"= ([a-z_]+\.[a-z_]+)", line)
        if not op or op.group(1) not in COPY_OPS:
            continue
        sizes = [math.prod(int(d) for d in m.split("x") if d) for m in _TENSOR.findall(line)]
        if sizes and max(sizes) >= elements:
            found.append(f"{op.group(1)}: {line.strip()[:160]}")
    return found


@pytest.mark.parametrize("name,shape,dtype,shared_v,page,layers", [
    ("decode-gqa", (4, 1, 32, 8, 4096, 128, 128), jnp.bfloat16, False, 0, 0),
    ("prefill-chunk", (1, 64, 32, 8, 2048, 128, 128), jnp.bfloat16, False, 0, 0),
    ("prefill-chunk-2048", (2, 2048, 32, 8, 32768, 128, 128), jnp.bfloat16, False, 0, 0),
    ("decode-mla-absorbed", (2, 1, 16, 1, 2048, 576, 512), jnp.bfloat16, True, 0, 0),
    ("prefill-mla-absorbed", (1, 256, 16, 1, 32768, 576, 512), jnp.bfloat16, True, 0, 0),
    ("decode-f32-odd", (3, 1, 6, 3, 1000, 80, 80), jnp.float32, False, 0, 0),
    ("paged-decode-gqa", (4, 1, 32, 8, 4096, 128, 128), jnp.bfloat16, False, 128, 0),
    ("paged-prefill-chunk", (2, 1024, 32, 8, 16384, 128, 128), jnp.bfloat16, False, 64, 0),
    ("paged-decode-mla", (2, 1, 16, 1, 4096, 576, 512), jnp.bfloat16, True, 64, 0),
    ("stacked-paged-decode", (4, 1, 32, 8, 4096, 128, 128), jnp.bfloat16, False, 128, 4),
    ("stacked-dense-prefill", (1, 256, 32, 8, 8192, 128, 128), jnp.bfloat16, False, 0, 3),
    # speculative verify steps: k + 1 = 5 query tokens per sequence over paged, stacked caches
    ("stacked-paged-verify-gqa", (8, 5, 32, 8, 16384, 128, 128), jnp.bfloat16, False, 64, 4),
    ("paged-verify-mla", (8, 5, 16, 1, 16384, 576, 512), jnp.bfloat16, True, 64, 0),
])
def test_pallas_lowers_for_cuda_without_copying_the_cache(name, shape, dtype, shared_v, page, layers):
    # (with `layers`, the caches are stacked over layers and "cache-sized" means one layer's share)
    b, t, h, kh, s, dk, dv = shape
    text = lower_for_cuda(*shape, dtype, shared_v=shared_v, page=page, layers=layers)
    assert "__gpu$xla.gpu.triton" in text
    assert "dcp_flash_attention" in text
    # The cache goes to the kernel as it is: no pad, slice, concatenate, transpose or copy of it (or
    # of anything half its size) anywhere in the module.
    assert large_copies(text, b * kh * s * dk // 2) == []
    kernel_call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
    assert "%arg1" in kernel_call and ("%arg2" in kernel_call) != shared_v


def test_no_copy_check_sees_a_padded_cache():
    # The assertion above can fail: a wrapper that pads the cache (what the kernel did before) is
    # caught.
    def padded(q, k, v, *rest, **kw):
        return triton_kernel.attention(q, jnp.pad(k, ((0, 0), (0, 0), (0, 24), (0, 0))),
                                       jnp.pad(v, ((0, 0), (0, 0), (0, 24), (0, 0))), *rest, **kw)
    f = functools.partial(padded, scale=0.1, interpret=True)
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in [(1, 1, 8, 64), (1, 2, 1000, 64),
                                                                     (1, 2, 1000, 64)]]
    args += [jax.ShapeDtypeStruct((1, 1), jnp.int32), SlotPositions(0, 1000, 1000),
             jax.ShapeDtypeStruct((1,), jnp.int32)]
    text = jax.jit(f).lower(*args).as_text()
    assert any(op.startswith("stablehlo.pad") for op in large_copies(text, 2 * 1000 * 64 // 2))


def test_every_pallas_call_names_its_backend():
    # JAX 0.11 and 0.12 route a pallas_call without compiler parameters to different GPU backends
    # (Triton, Mosaic GPU): every call in the package names its own, so none can change under us.
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for path in [*root.glob("pallas_kernels/**/*.py"), *root.glob("dcp_jax/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "func", None)
            name = getattr(name, "attr", getattr(name, "id", ""))
            if isinstance(node, ast.Call) and name == "pallas_call":
                names = {k.arg for k in node.keywords}
                found.append((path.name, node.lineno, "compiler_params" in names))
    assert found and all(ok for *_, ok in found), found


# --- MLA decode at DeepSeek's shapes (576-wide latent, 512 values, 64 and 128 heads) ----------------

def mla_case(heads, kind, length=83, page=32, seed=0):
    """One decode row and one 2-token verify row over a paged 576-wide latent (values: its first 512),
    bf16 or 8-bit (packed rows); the float64 oracle's (o, lse) from the latent as stored."""
    rng = np.random.default_rng(seed)
    b, t, nb = 2, 2, 4
    s = nb * page
    latent = rng.standard_normal((b, 1, s, 576)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((b, t, heads, 576)), jnp.bfloat16)
    pool, table = to_pages(jnp.asarray(latent), page, seed=seed)
    if kind is None:
        pool = pool.astype(jnp.bfloat16)
        stored = np.asarray(pool, np.float32)
    else:
        pool = kv_quant_lib.pack(pool, kind)
        stored = np.asarray(kv_quant_lib.unpack(pool, kind))
    dense = stored[np.asarray(table)].transpose(0, 2, 1, 3, 4).reshape(b, 1, s, 576)
    lengths = np.asarray([length, 5], np.int32)
    q_pos = np.asarray([[length - 1] * t, [3, 4]], np.int32)
    scale = 1 / np.sqrt(192.0)
    ref = dense_attention(np.asarray(q, np.float32), dense, dense[..., :512], q_pos, lengths, scale)
    call = dict(q=q, k=pool, v=None, q_pos=jnp.asarray(q_pos), kv_pos=SlotPositions.dense(s),
                kv_len=jnp.asarray(lengths), block_table=table)
    return call, ref, dict(scale=scale, v_dim=512, kv_quant=kind)


@pytest.mark.parametrize("heads,kind,splits", [(64, None, 1), (128, None, 3), (64, "fp8", 3),
                                               (128, "int8", 1)])
def test_mla_decode_matches_float64(heads, kind, splits):
    # The kernel at DeepSeek's latent in the interpreter: 64 heads are one head block, 128 two; an odd
    # length (83: the last 32-slot tile partial), one and several KV splits, bf16 and 8-bit pages.
    call, (ref_o, ref_lse), opts = mla_case(heads, kind)
    o, lse = attend(call, impl=PALLAS, num_splits=splits, **opts)
    assert rel_err(o, ref_o) <= 2e-2
    assert_lse_close(lse, ref_lse, 2e-2)


@pytest.mark.parametrize("heads", [64, 128])
def test_mla_decode_loads_each_latent_tile_once_per_head_block(monkeypatch, heads):
    # Every latent tile a program walks is loaded once, in its two pieces (512 + 64), and serves both
    # products: no separate value load. 128 heads are two head blocks: each tile is read twice in all.
    seen = []
    monkeypatch.setattr(triton_kernel, "load_probe", lambda which, *rest: seen.append(
        (which, *(int(x) for x in rest))))
    call, _, opts = mla_case(heads, "fp8", length=83)
    call = dict(call, q=call["q"][:1, :1], q_pos=call["q_pos"][:1, :1], kv_len=call["kv_len"][:1],
                block_table=call["block_table"][:1])  # one decode token: its heads are the rows
    jax.block_until_ready(attend(call, impl=PALLAS, num_splits=1, **opts))
    assert {w for w, *_ in seen} == {"k"}
    pieces = {}
    for _, b, kv, qb, split, start, off, w in seen:
        pieces.setdefault((qb, start), []).append((off, w))
    assert sorted({qb for qb, _ in pieces}) == list(range(heads // 64))
    assert sorted({start for _, start in pieces}) == [0, 32, 64]  # 83 slots: three tiles
    assert all(sorted(p) == [(0, 512), (512, 64)] for p in pieces.values()), pieces


def test_mla_decode_tile_and_split_arithmetic():
    # 128 heads over 32K keys, batch 8, bf16: two head blocks of 64 rows and 32-token tiles: 151,552
    # bytes of shared memory (the query tile, two stages of latent tiles, the probability tile), one
    # program per SM; the 16 programs are split so the grid fills the 132 SMs' wave.
    phase, cfg = configs.pick(128, 576, 512, 2, shared_v=True)
    assert phase == "decode" and (cfg.block_q, cfg.block_k, cfg.num_stages) == (64, 32, 2)
    assert configs.smem_bytes(cfg, 576, 512, 2, True) == 2 * (64 * 576 + 2 * 32 * 576 + 64 * 32)
    assert configs.ctas_per_sm(cfg, 576, 512, 2, True) == 1
    splits = configs.num_splits(programs=8 * 2, kv_blocks=32768 // cfg.block_k, sms=132, ctas=1)
    fill, _ = waves_used(16, 32768 // cfg.block_k, splits, 132)
    assert 16 * splits <= 132 and fill >= 0.95
    # the float32 accumulator [64, 512] over 8 warps: 128 registers a thread
    assert cfg.block_q * 512 / (cfg.num_warps * 32) == 128
