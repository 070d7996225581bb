"""Building blocks every model family shares: weights by Hugging Face name, norms, RoPE, the gated MLP.

Weights keep Hugging Face's [out, in] orientation, so loading never transposes. A model is built
from a `WeightSource`: a callable `(name, shape, spec, kv_rep) -> jax.Array` that returns the named
Hugging Face tensor already placed with sharding `spec` (safetensors, orbax or random init). A name
with a `*` stands for a stack: tensor j of the stack is the name with `*` replaced by j (the experts
of a mixture-of-experts layer are one [E, ...] weight, sharded over E).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.layout import KVLayout, PagedLayout
from pallas_kernels.attention.ragged import RaggedTiles

WeightSource = Callable[..., jax.Array]


def stack_names(name: str, count: int) -> list[str]:
    """The Hugging Face names behind a stacked weight's `*` name."""
    return [name.replace("*", str(j)) for j in range(count)] if "*" in name else [name]


@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """Where the cache lives and how attention runs: the mesh, the KV placement, the kernel and the
    combine, and for a paged pool its block table [B, blocks] (a traced array, replicated) with the
    longest sequence it may hold (`max_seq_len`; a dense layout knows its own)."""

    mesh: Mesh
    layout: KVLayout | PagedLayout
    impl: str | None = None
    combine: str = "auto"
    block_table: jax.Array | None = None
    max_seq_len: int | None = None
    layer: jax.Array | None = None  # the layer within a scanned stack (its caches are stacked)
    # a ragged batch (pallas_kernels.attention.ragged): the tokens are one flat row [1, N] of many
    # sequences, block_table and lengths are per sequence [R], and the tiles say which token is whose
    ragged: RaggedTiles | None = None
    kv_quant: str | None = None  # "int8" / "fp8": the pools hold packed 8-bit rows (kv_quant.pack)

    @property
    def seq_len(self) -> int:
        """The longest sequence the cache holds (the RoPE tables are sized for it)."""
        return self.max_seq_len or self.layout.max_seq_len

    def placement(self) -> dict:
        """The keywords `attention.write_kv` and `attention.dcp_attention` take from the context."""
        return dict(mesh=self.mesh, layout=self.layout, block_table=self.block_table, layer=self.layer,
                    ragged=self.ragged, kv_quant=self.kv_quant)


LAYER = "{layer}"  # the placeholder for the layer index in the names of a scanned stack's weights


def stacked_source(get: WeightSource, indices, mesh: Mesh) -> WeightSource:
    """A WeightSource for layers `indices` scanned together: a name holding `{layer}` is read once per
    layer and the tensors are stacked on a new leading axis (not sharded; the rest keeps its spec).
    Abstract sources (ShapeDtypeStructs) stay abstract."""
    indices = tuple(indices)

    def stacked(name, shape, spec, kv_rep=1):
        parts = [get(name.format(layer=i), shape, spec, kv_rep=kv_rep) for i in indices]
        sharding = mesh_lib.named(mesh, mesh_lib.stacked_spec(spec))
        if isinstance(parts[0], jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((len(parts), *parts[0].shape), parts[0].dtype, sharding=sharding)
        return jax.jit(_stack, out_shardings=sharding)(*parts)  # jit's cache: one compile per shape and placement

    return stacked


def _stack(*xs):
    return jnp.stack(xs)


def param(get: WeightSource, name: str, shape, spec, kv_rep: int = 1) -> nnx.Param:
    """A weight from the source, tagged with its Hugging Face name (checkpoints are keyed by it)."""
    return nnx.Param(get(name, tuple(shape), spec, kv_rep=kv_rep), hf_name=name, kv_rep=kv_rep)


class RMSNorm(nnx.Module):
    def __init__(self, weight: nnx.Param, eps: float):
        self.weight = weight
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def norm(get: WeightSource, name: str, size: int, eps: float) -> RMSNorm:
    return RMSNorm(param(get, name, (size,), mesh_lib.spec(())), eps)


def linear(x, w, b=None):
    """x [..., in] @ w[out, in].T (+ b), in x's dtype (weights stored narrower, e.g. float8, are widened)."""
    y = jnp.einsum("...i,oi->...o", x, w[...].astype(x.dtype))
    return y if b is None else y + b[...]


def rope(x, positions, inv_freq, *, interleaved: bool = False, factor: float = 1.0):
    """Rotary embedding. x [B, T, H, D], positions [B, T].

    Half-split ("rotate_half") pairs (i, i + D/2) by default; `interleaved` pairs (2i, 2i + 1) as
    DeepSeek lays them out (the output is then in half-split order: q and k get the same order, so
    their dot products are unchanged). `factor` scales cos and sin (YaRN's attention factor).
    """
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :] * factor
    sin = jnp.sin(freqs)[:, :, None, :] * factor
    x32 = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class MLP(nnx.Module):
    """The gated SiLU MLP, its intermediate dim sharded over as much of ("tp","dcp") as divides it."""

    def __init__(self, prefix: str, get: WeightSource, mesh: Mesh, hidden: int, intermediate: int):
        i, e = intermediate, hidden
        axes = mesh_lib.fit_axes(mesh, i)
        self.gate_proj = param(get, f"{prefix}.gate_proj.weight", (i, e), mesh_lib.spec(axes, ()))
        self.up_proj = param(get, f"{prefix}.up_proj.weight", (i, e), mesh_lib.spec(axes, ()))
        self.down_proj = param(get, f"{prefix}.down_proj.weight", (e, i), mesh_lib.spec((), axes))

    def __call__(self, x):
        return linear(jax.nn.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)


def kv_source_rows(rows: np.ndarray, rep: int, head_dim: int) -> np.ndarray:
    """Rows of a stored KV weight behind rows `rows` of its `expand_kv_rows` copy."""
    return (rows // head_dim // rep) * head_dim + rows % head_dim


def expand_kv_rows(x, rep: int, head_dim: int):
    """Repeat each kv head's rows `rep` times along axis 0 (KV heads replicated over tp ranks).

    NumPy arrays stay NumPy (host-side loading); JAX arrays stay on device (restoring onto a mesh).
    """
    if rep == 1:
        return x
    xp = jnp if isinstance(x, jax.Array) else np
    heads = x.reshape((-1, head_dim) + x.shape[1:])
    return xp.repeat(heads, rep, axis=0).reshape((-1,) + x.shape[1:])
