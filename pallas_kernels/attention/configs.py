"""Block sizes, pipelining and KV splits of the Pallas GPU kernel: one small table the wrapper picks from.

A call is a *decode* call when its folded query rows (tokens × query heads per kv head) fit at most
`DECODE_READS` query blocks of the decode configuration, so each KV tile is read at most that often
(DeepSeek's 128 absorbed heads: two blocks of 64 rows), else a *prefill* call. The table gives, per
phase and widest head dim, the query block, the KV block, Triton's warps and pipelining stages. Rules:

- Shared memory depends on block sizes only, never on the chunk or the cache length: `smem_bytes`
  estimates a program's footprint (its query tile, `num_stages` buffered K/V tiles, the probability
  tile) and `pick` shrinks stages, then the KV block, then the query block until it fits one block's
  limit. Decode entries are small enough for 2-3 programs (CTAs) per SM: a memory-bound call hides
  latency with several resident programs, not with one program's deep pipeline.
- Occupancy: `ctas_per_sm` counts the programs one SM holds at once, from shared memory (the SM's,
  less the 1 KiB the runtime reserves per block) and warps (64 per SM). The float32 accumulator must
  also stay in registers: every entry keeps it (query rows × Dv over the program's threads) within
  128 of a thread's 255 registers, the rest holding scores and addresses (tests/test_kernels.py
  checks the table), so 128-row-wide MLA tiles use 8 warps.
- KV splits come from the waves the grid takes: a grid of `programs × splits` fills
  `SMs × ctas_per_sm` slots per wave, and a call's time goes as (waves) × (KV blocks per split);
  `num_splits` picks the split count that minimises that product (the fewest splits on a tie), each
  split at least `MIN_BLOCKS_PER_SPLIT` KV blocks long (counted over the whole slice; the kernel then
  shares out the visible ones), at most `MAX_SPLITS`. A prefill call already has many query blocks
  and gets one split (no cross-split merge).

The entries are starting points chosen by that arithmetic, not by a sweep: `scripts/sweep_kernel.py`
runs the paged kernel at the engine's page sizes over head dims 64/128/256 and MLA 576/512 on a GPU
and prints the rows to put here, and has not run yet. The first GPU run (docs/PERFORMANCE.md, one
H100) timed these entries: the decode kernel at 8 x 8K keys (d 128, bf16) reads at 86% of a device
copy, 0.108 ms against cuDNN's 0.105; MLA's 128-head decode at 8K at 12% of copy.
"""

from __future__ import annotations

import dataclasses
import math

import jax

# H100/H200 (sm_90): 227 KiB of shared memory per block, 228 KiB per SM (1 KiB of it reserved per
# resident block), 64 warps and 65,536 32-bit registers per SM, 132 SMs. Used when no GPU is attached
# (the CUDA lowering test, interpret mode); on a GPU the attached device's SM count is read.
SMEM_LIMIT = 232448
SMEM_PER_SM = 233472
SMEM_RESERVED_PER_CTA = 1024
WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32
DEFAULT_NUM_SMS = 132
DECODE_READS = 2  # a decode call reads each KV tile at most this often (its query blocks)
MAX_SPLITS = 32
MIN_BLOCK = 16  # tensor-core dots need every dimension >= 16
MIN_BLOCKS_PER_SPLIT = 8  # a split shorter than this costs more in its partial output than it saves


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_q: int  # folded query rows per program (decode: the rows rounded up to a power of two, up to this)
    block_k: int  # KV slots per inner step
    num_warps: int
    num_stages: int


# (phase, widest head dim up to) -> config. Decode's block_q is the cap: the call uses the smallest
# power of two >= its rows (>= 16) up to it. Occupancy at bf16 (`ctas_per_sm`): decode 128 and 256
# hold 3 programs per SM at 16 rows and 2 at 64; prefill entries hold 1 (their grids are many query
# blocks deep). MLA's decode (576-wide latent, its first 512 the values) is FlashMLA's shape in
# Triton: a head block of 64 rows is the matrix unit's M, each latent tile is loaded once (in pieces
# of 512 and 64) and used for both products, and the tile is 32 tokens. The float32 accumulator
# [64, 512] is rescaled once per tile (64·512 FMAs on the CUDA cores against 2·64·32·1088
# tensor-core FLOPs): at the old 16-token tile the rescale cost about as much as the matrix work,
# and the P·V product's K dimension was the minimum 16. That is 151 KB of shared memory at two
# stages: one program per SM, and the KV splits (`num_splits`, ctas=1) fill every SM. FlashMLA's
# 64-token tile needs 229 KB at two stages, leaving Triton 3 KB for its own scratch;
# `scripts/sweep_kernel.py` tries it on a GPU.
TABLE = {
    ("decode", 128): KernelConfig(block_q=64, block_k=64, num_warps=4, num_stages=2),
    ("decode", 256): KernelConfig(block_q=64, block_k=32, num_warps=4, num_stages=2),
    ("decode", 1024): KernelConfig(block_q=64, block_k=32, num_warps=8, num_stages=2),  # MLA 576
    ("prefill", 128): KernelConfig(block_q=64, block_k=64, num_warps=4, num_stages=3),
    ("prefill", 256): KernelConfig(block_q=64, block_k=32, num_warps=4, num_stages=2),
    ("prefill", 1024): KernelConfig(block_q=32, block_k=16, num_warps=4, num_stages=2),
}


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def head_pieces(d: int) -> tuple[tuple[int, int], ...]:
    """A head dim as (offset, width) pieces whose widths are powers of two, widest first.

    576 -> ((0, 512), (512, 64)); 80 -> ((0, 64), (64, 16)); 128 -> ((0, 128),). Triton loads and dots
    take power-of-two shapes: the kernel loads and multiplies piece by piece, so no head dim is ever
    padded (a padded cache would be a cache-sized copy per layer per step).
    """
    pieces, off = [], 0
    for bit in reversed(range(d.bit_length())):
        if d & (1 << bit):
            pieces.append((off, 1 << bit))
            off += 1 << bit
    return tuple(pieces)


def page_block(block_k: int, page_size: int, minimum: int = MIN_BLOCK) -> int:
    """The largest power of two <= block_k that divides the page (a KV block never straddles pages)."""
    bk = block_k
    while bk > 1 and page_size % bk:
        bk //= 2
    if bk < minimum:
        raise ValueError(f"page_size {page_size} needs a power-of-two divisor >= {minimum} for the kernel's KV "
                         f"block; use a page size that is a multiple of {minimum}")
    return bk


def smem_bytes(cfg: KernelConfig, dk: int, dv: int, itemsize: int, shared_v: bool) -> int:
    """Shared memory one program needs: its query tile, `num_stages` buffered K (and V) tiles, and the
    probability tile fed to the second dot."""
    kv = cfg.block_k * (dk + (0 if shared_v else dv))
    return itemsize * (cfg.block_q * dk + cfg.num_stages * kv + cfg.block_q * cfg.block_k)


def num_sms() -> int:
    """SMs of the attached GPU (the grid is sized to fill them), else an H200's."""
    try:
        if jax.default_backend() == "gpu":
            return int(getattr(jax.devices()[0], "core_count", DEFAULT_NUM_SMS) or DEFAULT_NUM_SMS)
    except RuntimeError:
        pass
    return DEFAULT_NUM_SMS


def ctas_per_sm(cfg: KernelConfig, dk: int, dv: int, itemsize: int, shared_v: bool = False) -> int:
    """Programs (CTAs) of this configuration one SM holds at once: bounded by shared memory (each
    resident block also takes the runtime's reserved 1 KiB) and by warps."""
    by_smem = SMEM_PER_SM // (smem_bytes(cfg, dk, dv, itemsize, shared_v) + SMEM_RESERVED_PER_CTA)
    return max(1, min(by_smem, WARPS_PER_SM // cfg.num_warps, MAX_CTAS_PER_SM))


def entry(phase: str, widest: int) -> KernelConfig:
    """The table's entry of a phase for the smallest head-dim bucket >= `widest` (the largest bucket
    beyond them all)."""
    dims = sorted(d for ph, d in TABLE if ph == phase)
    return TABLE[(phase, next((d for d in dims if widest <= d), dims[-1]))]


def pick(rows: int, dk: int, dv: int, itemsize: int, shared_v: bool = False,
         smem_limit: int = SMEM_LIMIT) -> tuple[str, KernelConfig]:
    """(phase, config) for `rows` folded query rows and head dims dk/dv, shrunk to fit shared memory."""
    widest = max(dk, dv)
    base_decode = entry("decode", widest)
    phase = "decode" if rows <= DECODE_READS * base_decode.block_q else "prefill"
    cfg = entry(phase, widest)
    if phase == "decode":
        cfg = dataclasses.replace(cfg, block_q=min(pow2(rows, MIN_BLOCK), base_decode.block_q))
    while smem_bytes(cfg, dk, dv, itemsize, shared_v) > smem_limit:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > MIN_BLOCK:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        elif cfg.block_q > MIN_BLOCK:
            cfg = dataclasses.replace(cfg, block_q=cfg.block_q // 2)
        else:
            break
    return phase, cfg


def num_splits(programs: int, kv_blocks: int, sms: int | None = None, ctas: int = 1) -> int:
    """KV splits per (batch, kv head, query block) program: the count that minimises
    waves × blocks per split, where a wave is `sms × ctas` resident programs (`ctas_per_sm`); one
    when the programs alone fill a wave.

    E.g. 64 programs over 512 KV blocks on 132 SMs: at 3 programs per SM, 6 splits make 384 programs,
    one wave of 396 slots (97% full), 86 blocks each; at 1 per SM, 2 splits fill one wave of 132.
    """
    slots = (sms or num_sms()) * max(ctas, 1)
    if programs >= slots:  # a wave is full without splitting (prefill): no partial outputs to merge
        return 1
    most = max(1, min(kv_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))

    def cost(n):
        return math.ceil(programs * n / slots) * math.ceil(kv_blocks / n)

    return min(range(1, most + 1), key=lambda n: (cost(n), n))
