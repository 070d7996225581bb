"""Pick the attention implementation: the Pallas kernel on GPU, the jnp reference elsewhere."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.attention import kv_quant as kvq
from pallas_kernels.attention import ragged, reference, triton
from pallas_kernels.attention.common import check_inputs, default_scale

IMPLEMENTATIONS = ("reference", "pallas", "pallas_interpret")
_OPTIONS = {
    "reference": {"block_k", "block_k_masked", "pages_per_step"},
    "pallas": {"block_q", "block_k", "num_splits", "num_warps", "num_stages"},
}


def default_impl() -> str:
    """"pallas" when the default backend is a GPU, else "reference"."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def attention(q, k, v, q_pos, kv_pos, kv_len, *, scale: float | None = None, impl: str | None = None,
              v_dim: int | None = None, block_table=None, layer=None, kv_quant: str | None = None,
              **kernel_options):
    """Attention of a query block over one KV slice, with its log-sum-exp.

    Args:
      q: [B, T, H, Dk] queries.  k: [B, K, S, Dk] keys.  v: [B, K, S, Dv] values (Dv may differ from Dk),
        or None when the values are the keys' first `v_dim` features (MLA: the cached latent is the key
        and its first kv_lora_rank features the value; nothing is copied).
      q_pos: [B, T] global positions of the queries.
      kv_pos: `SlotPositions`, the global positions held by the slots of this slice.
      kv_len: [B] valid length of each sequence; a slot is seen by a query iff
        `kv_pos <= q_pos and kv_pos < kv_len` (causal by position).
      scale: softmax scale, default 1/sqrt(Dk).
      impl: "reference", "pallas" or "pallas_interpret" (the kernel in Pallas' interpreter);
        default: `default_impl()`.
      block_table: [B, NB] int (paged cache): k [P, K, page, Dk] and v [P, K, page, Dv] are pools of
        pages, and sequence b's slot j (positions from kv_pos, as for a dense slice) lives in page
        block_table[b, j // page] at j % page.
      layer: a scalar (may be traced): k and v lead with a layer axis (the stacked caches of scanned
        layers) and that layer is read in place, never sliced out.
      kv_quant: "int8" / "fp8": k and v hold packed 8-bit rows (`kv_quant`), dequantized inside each
        KV block by either implementation.
    Returns:
      (o [B, T, H, Dv] in q.dtype, lse [B, T, H] float32, natural log). A row that sees no slot gets
      o = 0 and lse = -inf.
    """
    kvq.check(kv_quant)
    lead = 0 if layer is None else 1  # check one layer's shapes, as attention sees them
    k1 = kvq.logical(jax.ShapeDtypeStruct(k.shape[lead:], k.dtype), kv_quant)
    v1 = None if v is None else kvq.logical(jax.ShapeDtypeStruct(v.shape[lead:], v.dtype), kv_quant)
    check_inputs(q, k1, v1, q_pos, kv_pos, kv_len, v_dim, block_table)
    impl = impl or default_impl()
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLEMENTATIONS}")
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    allowed = _OPTIONS["reference" if impl == "reference" else "pallas"]
    if set(kernel_options) - allowed:
        raise ValueError(
            f"{impl} takes kernel options {sorted(allowed)}, got {sorted(set(kernel_options) - allowed)}")
    if impl == "reference":
        fn = functools.partial(reference.attention, **kernel_options)
    else:
        fn = functools.partial(triton.attention, interpret=impl == "pallas_interpret", **kernel_options)
    if kv_quant is not None:
        fn = functools.partial(fn, kv_quant=kv_quant)
    return fn(q, k, v, q_pos, kv_pos, kv_len, scale=scale, v_dim=v_dim, block_table=block_table, layer=layer)


def ragged_attention(q, k, v, q_pos, kv_pos, kv_len, block_table, tiles: ragged.RaggedTiles, *,
                     scale: float | None = None, impl: str | None = None, v_dim: int | None = None, layer=None,
                     kv_quant: str | None = None, **kernel_options):
    """Attention of a ragged batch (`pallas_kernels.attention.ragged`): the query tokens of many sequences
    laid end to end, each attending its own sequence's pages.

    q [N, H, Dk] flat; q_pos [N] each token's position; kv_len [R] and block_table [R, NB] per sequence
    (row); tiles: which tokens form each tile and the row it reads. k, v, kv_pos, scale, impl, v_dim,
    layer and the kernel options as `attention` (paged). Returns (o [N, H, Dv] in q.dtype, lse [N, H]
    float32). Each tile runs as one block of `attention`, so every implementation serves the ragged batch.
    """
    def attend(qg, pos, lengths, table):
        return attention(qg, k, v, pos, kv_pos, lengths, scale=scale, impl=impl, v_dim=v_dim, block_table=table,
                         layer=layer, kv_quant=kv_quant, **kernel_options)

    return ragged.attention(attend, q, q_pos, kv_len, block_table, tiles)
