"""The ("tp", "dcp") device mesh and every partition spec the project uses.

This module is the one place that names mesh axes. Everything else imports `TP`, `DCP` and the
spec helpers below.

Axis types: the mesh is made with `AxisType.Auto` on purpose. Models carry sharding annotations on
their weights and let XLA's sharding propagation insert the reductions of the matmuls;
attention is the single `shard_map` island and states its own in/out specs. Explicit sharding-in-types
would force every model einsum to spell out its output sharding for no gain here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TP = "tp"
DCP = "dcp"
AXES = (TP, DCP)

AxisNames = tuple[str, ...]


def simulate_cpu_devices(n: int) -> bool:
    """Ask for `n` simulated CPU devices if JAX has not started and may use its CPU backend; returns
    whether the request was made. Only the CPU backend is affected: harmless where an accelerator exists.

    Simulate no more devices than the mesh uses: XLA's CPU client runs max(cores, devices) threads, so
    8 simulated devices on 2 cores halve the speed of a 1-device mesh (16K decode step: 94-101 ms
    against 47-53 ms; scripts/bench_decode.py measures each mesh with exactly its devices).
    """
    from jax._src import xla_bridge  # private: the only way to ask "already initialised?"

    if xla_bridge.backends_are_initialized() or is_distributed():  # multi-process: init_distributed set it
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "") or jax.config.jax_platforms or ""
    if "cpu" not in platforms.split(",") and platforms != "":
        return False
    if jax.config.jax_num_cpu_devices < n:
        jax.config.update("jax_num_cpu_devices", n)
    return True


def ensure_cpu_devices(n: int) -> None:
    """Make sure at least `n` devices can be had, simulating CPU devices when there is no accelerator.

    Must run before JAX initialises its backends to have an effect; afterwards it only checks. Raises
    ValueError naming both ways out when there are too few devices.
    """
    simulate_cpu_devices(n)
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(
            f"the mesh needs {n} devices but only {len(devices)} {devices[0].platform} device(s) exist: use a "
            f"mesh of at most {len(devices)} devices, or simulate {n} CPU devices (JAX_PLATFORMS=cpu, or "
            f"dcp_jax.ensure_cpu_devices({n}) before JAX starts)"
        )


DIST_TIMEOUT_S = 60  # default seconds to wait for peers at start, and to tolerate a silent peer later


def is_distributed() -> bool:
    """Whether this process has joined jax.distributed."""
    return getattr(jax.distributed, "is_initialized", lambda: False)()


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, mesh_devices: int = 0, timeout_s: int = DIST_TIMEOUT_S) -> None:
    """Join JAX's multi-process runtime (`jax.distributed`): the mesh then spans every process's devices.

    With no coordinator, JAX detects the cluster itself (SLURM, Open MPI, TPU/GPU cluster environments).
    On CPU, processes talk through gloo and each simulates its share of the mesh's `mesh_devices`
    (⌈mesh_devices / num_processes⌉). `timeout_s` bounds the wait for peers at start-up, and how long a
    silent peer is tolerated later. A process that has joined already stays as it is.
    """
    import inspect
    import math

    if is_distributed():
        return
    if mesh_devices:
        jax.config.update("jax_num_cpu_devices", math.ceil(mesh_devices / (num_processes or 1)))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    wanted = dict(initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s,
                  shutdown_timeout_seconds=timeout_s)
    accepted = inspect.signature(jax.distributed.initialize).parameters
    kwargs = {k: v for k, v in wanted.items() if k in accepted}
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, **kwargs)


DEFAULT_LOCAL_MESH = (2, 4)  # what local_mesh_shape(max_tp=2) gives on a CPU-only machine


def local_mesh_shape(max_tp: int, devices: Sequence[jax.Device] | None = None) -> tuple[int, int]:
    """(tp, dcp) over this machine: 8 simulated CPU devices on a CPU-only machine (to show DCP), else
    every local accelerator; tp is the largest divisor of the device count up to `max_tp` (e.g. the
    kv-head count)."""
    if devices is None:
        simulate_cpu_devices(8)
        devices = jax.local_devices()
    n = min(8, len(devices)) if devices[0].platform == "cpu" else len(devices)
    tp = max(d for d in range(1, min(n, max_tp) + 1) if n % d == 0)
    return tp, n // tp


def local_mesh_note(tp: int, dcp: int, platform: str) -> str | None:
    """What the default run says when it picks a mesh other than the documented one (fewer devices)."""
    if (tp, dcp) == DEFAULT_LOCAL_MESH and platform == "cpu":
        return None
    return (f"note: no mesh given: tp={tp} x dcp={dcp} over this machine's {tp * dcp} {platform} device(s) "
            f"(JAX_PLATFORMS=cpu simulates tp={DEFAULT_LOCAL_MESH[0]} x dcp={DEFAULT_LOCAL_MESH[1]} on 8 CPU "
            "devices to show DCP); choose a mesh with --mesh tp=N,dcp=M")


def make_mesh(tp: int, dcp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of `tp × dcp` devices with axes ("tp", "dcp"); dcp is the minor (fastest) axis."""
    for name, value in (("tp", tp), ("dcp", dcp)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    n = tp * dcp
    if devices is None:
        try:
            ensure_cpu_devices(n)
        except ValueError as e:
            raise ValueError(f"mesh tp={tp} x dcp={dcp}: {e}") from None
        devices = jax.devices()
    devices = list(devices)
    if len(devices) < n:
        raise ValueError(
            f"mesh tp={tp} x dcp={dcp} needs {n} devices, only {len(devices)} given; "
            "lower tp/dcp or provide more devices"
        )
    grid = np.asarray(devices[:n], dtype=object).reshape(tp, dcp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def axis_size(mesh: Mesh, axes: AxisNames) -> int:
    """Number of shards along a group of mesh axes (1 for the empty group)."""
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def _group(axes: AxisNames):
    """A PartitionSpec entry for a group of axes: None, one name, or a tuple."""
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def fit_axes(mesh: Mesh, dim: int, axes: AxisNames = AXES) -> AxisNames:
    """The longest prefix of `axes` whose shard count divides `dim` (so a weight dim is never padded)."""
    axes = tuple(axes)
    while axes and dim % axis_size(mesh, axes):
        axes = axes[:-1]
    return axes


def spec(*dims) -> P:
    """A PartitionSpec from per-dimension axis groups (tuples of names, () for replicated)."""
    return P(*(_group(d) if isinstance(d, tuple) else d for d in dims))


# --- partition specs ------------------------------------------------------------------------------
# Shapes use B (batch), T (query tokens), S (sequence slots), H (heads), K (kv heads), D (head dim).


def q_proj_axes(q_gather: bool = False) -> AxisNames:
    """Axes splitting q_proj's output rows (the query heads).

    Default ("tp",): every dcp rank computes q for its tp group's heads, so q is replicated over "dcp" with
    no communication. With `q_gather`, ("tp", "dcp"): each rank computes 1/dcp of those heads and XLA
    all-gathers q over "dcp" where the attention island asks for heads over "tp" alone (`q_spec`).
    """
    return AXES if q_gather else (TP,)


def q_spec(head_axes: AxisNames = (TP,)) -> P:
    """Queries / per-head activations [B, T, H, D]: heads over `head_axes`."""
    return P(None, None, _group(head_axes), None)


def residual_spec() -> P:
    """The residual stream [B, T, E]: replicated, so a layer's only collectives are the attention combine
    and the all-reduces after o_proj and down_proj (a split hidden dim would add norm and q/k/v
    all-reduces and an all-gather before the MLP in every layer)."""
    return P()


def token_split_spec() -> P:
    """A prefill chunk's activations [B, T, E] with tokens over "dcp": the q/k/v projections, whose
    weights are split over "tp" only, then do 1/dcp of the tokens on each dcp rank."""
    return P(None, DCP, None)


def stacked_spec(spec: P) -> P:
    """`spec` with a new leading, unsharded axis: the stack of scanned layers' weights or caches."""
    return P(None, *spec)


def kv_cache_spec(head_axes: AxisNames = (TP,), context_axes: AxisNames = (DCP,), stacked: bool = False) -> P:
    """KV cache [B, K, S, D]: kv heads over `head_axes`, sequence slots over `context_axes`. `stacked`:
    the caches of scanned layers, [L, B, K, S, D] (layers not sharded)."""
    spec = P(None, _group(head_axes), _group(context_axes), None)
    return stacked_spec(spec) if stacked else spec


def kv_pool_spec(head_axes: AxisNames = (TP,), context_axes: AxisNames = (DCP,), stacked: bool = False) -> P:
    """Paged KV pool [N·pages, K, page, D]: each context rank holds its own `pages` pages (the first
    axis over `context_axes`), kv heads over `head_axes`. One block-table entry names the same page
    index on every context rank: each holds its share of that block there. `stacked`: the pools of
    scanned layers, [L, N·pages, K, page, D]."""
    spec = P(_group(context_axes), _group(head_axes), None, None)
    return stacked_spec(spec) if stacked else spec


def kv_tokens_spec(head_axes: AxisNames = (TP,), context_axes: AxisNames = (DCP,)) -> P:
    """KV tokens gathered out of a paged pool, token-major [N·T, L, K, D] (each context rank's T tokens,
    layers, kv heads, head dim): each context rank holds the tokens it gathered from its own pages, kv
    heads over `head_axes` (as the pool it came from)."""
    return P(_group(context_axes), None, _group(head_axes), None)


def lengths_spec() -> P:
    """Per-sequence vectors [B] (lengths), [B, T] (positions) and the block table [B, blocks]: replicated."""
    return P()


def attn_out_spec(head_axes: AxisNames, context_axes: AxisNames, scattered: bool) -> P:
    """Combined attention output [B, T, H, Dv].

    After `psum_scatter` over the context axes each device keeps its share of its head group, so the
    heads are split over head_axes + context_axes (head-major); after a `psum` they are replicated over
    the context axes.
    """
    axes = tuple(head_axes) + (tuple(context_axes) if scattered else ())
    return P(None, None, _group(axes), None)


def attn_lse_spec(head_axes: AxisNames, context_axes: AxisNames) -> P:
    """Merged LSE [B, T, H] after an all_to_all combine: heads over head_axes + context_axes, like the output."""
    return P(None, None, _group(tuple(head_axes) + tuple(context_axes)))


def stacked_lse_spec(head_axes: AxisNames, context_axes: AxisNames) -> P:
    """Merged LSE stacked over context ranks [N, B, T, H]: one copy per rank, heads over `head_axes`."""
    return P(_group(context_axes), None, None, _group(head_axes))


def named(mesh: Mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)


def zeros(specs):
    """Zeroed arrays for a pytree of ShapeDtypeStructs that carry their shardings, each allocated sharded
    (never whole on one device). One module-level function jitted with the shapes static, so jit's own
    cache compiles it once per distinct set of shapes, dtypes and shardings (a fresh lambda per call
    would compile every time: loading the same model again would recompile)."""
    leaves, tree = jax.tree.flatten(specs)
    shapes = tuple((x.shape, jnp.dtype(x.dtype)) for x in leaves)
    return tree.unflatten(jax.jit(_zeros, static_argnums=0, out_shardings=[x.sharding for x in leaves])(shapes))


def _zeros(shapes):
    return [jnp.zeros(shape, dtype) for shape, dtype in shapes]


def host(x) -> np.ndarray:
    """A replicated result as NumPy; in a multi-process run each process reads its local copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def kv_bytes(cache, replication: int = 1) -> dict:
    """KV bytes one device really holds (its shards), and the whole cache's bytes counted once (KV heads
    replicated `replication` times over tp ranks are not counted again)."""
    per_device = {}
    stored = 0
    for arr in jax.tree.leaves(cache):
        stored += arr.nbytes
        for shard in arr.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return dict(kv_bytes_per_device=max(per_device.values()), kv_bytes_total=stored // replication,
                kv_replication=replication)
