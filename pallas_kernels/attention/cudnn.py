"""cuDNN's flash attention for the diagonal blocks of prefill tiles (GPUs only).

A prefill tile's queries over its own tokens are plain causal attention over a dense block, the
case cuDNN's fused kernel is built for (571 TFLOP/s causal at T = S = 8192 on an H200, against 54
for XLA's own). The tile's attention to its cached prefix stays with the paged kernel, and the two
are merged by LSE (`merge_partials`, the same exact merge as the DCP combine).

jax.nn.dot_product_attention's `return_residual` casts the log-sum-exp to the output's dtype, and a
bfloat16 LSE (3 significant digits at magnitudes near 10) would weigh the merge's parts a few
percent wrong, so the call goes to the function under it, whose softmax statistics stay float32
(natural log, [B, N, T]); it has the same signature on JAX 0.11.2 and 0.12.0.1. cuDNN cannot trace
without a GPU: `takes` says no on any other backend, and the page walk then keeps the tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 128


def takes(q, k, v) -> bool:
    """Whether cuDNN's fused attention serves these tiles: a GPU backend, bfloat16 / float16,
    separate values (not MLA's shared latent), one head dim for keys and values, a multiple of 8 up
    to 128, and query heads a multiple of the kv heads."""
    if v is None or jax.default_backend() != "gpu":
        return False
    d = q.shape[-1]
    same = k.dtype == q.dtype and v.dtype == q.dtype and k.shape[-1] == d and v.shape[-1] == d
    return (q.dtype in DTYPES and same and d % 8 == 0 and d <= MAX_HEAD_DIM
            and q.shape[2] % k.shape[2] == 0)


def self_attention(q, k, v, lengths, *, scale: float, v_dim=None):
    """q [W, T, H, D], k / v [W, T, K, D], lengths [W] -> (o [W, T, H, D] in q.dtype, lse [W, T, H]
    float32): causal with padding (query and key j < lengths[w]). Rows past a tile's length are
    never read back by the caller; a tile of length 0 is all such rows."""
    del v_dim  # (cuDNN is only routed tiles with separate values)
    from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415 - GPU only

    lengths = lengths.astype(jnp.int32)
    o, stats = fa.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, scale=scale,
                                        mask_type=fa.MaskType.PADDING_CAUSAL, return_residual=True)
    lse = jnp.transpose(stats, (0, 2, 1)).astype(jnp.float32)  # [W, H, T] -> [W, T, H]
    valid = jnp.arange(q.shape[1])[None, :] < lengths[:, None]
    return o, jnp.where(valid[..., None], lse, -jnp.inf)
