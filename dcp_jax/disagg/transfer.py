"""Moving one request's prompt KV from a prefill instance's pool into a decode instance's pool.

    prefill side:  gather the request's pages into a staging array [L, N_src·blocks, K, page_src, D]
                   (rows past the prompt zeroed), split it into its per-device shards, keep one copy of
                   each (replicated kv heads once), and offer them under a uuid   [TransferServer.await_pull]
    decode side:   pull the pieces onto its own devices, check them in within a deadline        [pull]
                   then one program writes token t of source (rank, block, slot) into destination
                   (rank, page, slot) of the request's pages, heads re-split     [jit, pool donated]

The transport is `jax.experimental.transfer`. What it does and does not do (JAX 0.12, probed on CPU):
a pull must ask for exactly the source's shard structure (the same shard shapes, in order; a
differently split or replicated pull fails, and once aborted the source process). So the source offers
single-device pieces (one per distinct shard) and the destination picks the device each lands on; the
re-layout (ranks, interleave, page size, tp) is the destination's own program over its own mesh. Its
`timeout` arguments bounded nothing in our probes: a pull of a uuid nobody offers, or from a process
that died before the pull, waits forever; a source dying mid-pull fails the pull at once. So every
wait here runs under our own deadline (polling `is_ready`; an abandoned pull blocks no thread), and an
offer nobody pulls is drained by the prefill side pulling it from itself (one pull consumes an offer).

Placement math comes from `dcp_jax.layout.reshard_plan`; partition specs from `dcp_jax.mesh`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import transfer as jax_transfer
from jax.sharding import SingleDeviceSharding

from dcp_jax import mesh as mesh_lib
from dcp_jax.errors import UserError
from dcp_jax.layout import PagedLayout, kv_head_sources, reshard_plan


class TransferError(RuntimeError):
    """A request's KV did not arrive (the prefill instance died, stalled or refused): fail that request."""


# --- identity and the pairing handshake ------------------------------------------------------------


def config_hash(cfg) -> str:
    """A short hash of a model's architecture and sizes (`ModelConfig` without the raw HF dict)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "hf_config"}
    return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


def describe(engine, role: str, address: str) -> dict:
    """What one side tells the other when they pair (JSON-able): identity, cache geometry, placement."""
    model = engine.model
    cfg = model.config
    lay = engine.layout
    return dict(role=role, config_hash=config_hash(cfg), architecture=cfg.architecture,
                dtype=str(np.dtype(engine.dtype)), kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                mla=cfg.mla is not None, num_layers=cfg.num_layers, stored_kv_heads=model.kv_heads,
                kv_replication=model.kv_replication, tp=engine.mesh.shape[mesh_lib.TP],
                dcp=engine.mesh.shape[mesh_lib.DCP], num_shards=lay.num_shards, interleave=lay.interleave,
                page_size=lay.page_size, max_model_len=engine.config.max_model_len,
                transfer_address=address)


def check_pairing(prefill: dict, decode: dict) -> None:
    """Refuse a pair that could not exchange KV, with one line naming both sides' values."""
    if prefill.get("role") != "prefill":
        raise UserError(f"the instance to pair with is a {prefill.get('role') or 'non-disaggregated'} instance, "
                        "not a prefill one: start it with --role prefill")
    for key, what in (("config_hash", "model (config hash)"), ("dtype", "KV dtype"), ("kv_heads", "KV heads"),
                      ("head_dim", "KV head dim"), ("num_layers", "layers")):
        if prefill[key] != decode[key]:
            raise UserError(f"cannot pair: the prefill instance has {what} {prefill[key]} but this decode instance "
                            f"has {decode[key]}; start both with the same model and --dtype")
    if prefill["max_model_len"] < decode["max_model_len"] - 1:
        raise UserError(f"cannot pair: the prefill instance takes prompts up to {prefill['max_model_len'] - 1} "
                        f"tokens but this decode instance admits up to {decode['max_model_len'] - 1}; give both the "
                        "same --max-model-len")


def src_layout(info: dict) -> PagedLayout:
    return PagedLayout(info["num_shards"], info["interleave"], info["page_size"])


# --- the pieces of one request's staged KV ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PieceSpec:
    """One single-device piece of a staged KV array: layer stack `stack`, array `kind` (0 = k, 1 = v;
    MLA: 0 = latent), source context rank `rank`, the model's kv heads [head0, head0 + shape[2])."""

    stack: int
    kind: int
    rank: int
    head0: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "PieceSpec":
        return cls(int(d["stack"]), int(d["kind"]), int(d["rank"]), int(d["head0"]), tuple(d["shape"]),
                   str(d["dtype"]))


@dataclasses.dataclass
class Offer:
    """What the prefill side answers for one request: its first sampled token and where its KV waits."""

    request_id: str
    uuid: int
    length: int  # prompt tokens whose KV is offered
    first_token: int
    first_logprob: float
    pieces: list[PieceSpec]
    prefill_s: float = 0.0

    def to_json(self) -> dict:
        return dict(request_id=self.request_id, uuid=self.uuid, length=self.length, first_token=self.first_token,
                    first_logprob=self.first_logprob, pieces=[p.to_json() for p in self.pieces],
                    prefill_s=self.prefill_s)

    @classmethod
    def from_json(cls, d: dict) -> "Offer":
        return cls(str(d["request_id"]), int(d["uuid"]), int(d["length"]), int(d["first_token"]),
                   float(d["first_logprob"]), [PieceSpec.from_json(p) for p in d["pieces"]],
                   float(d.get("prefill_s", 0.0)))


class Stager:
    """The prefill side: gathers a request's pages out of `engine`'s pool into single-device pieces.

    One compiled gather per number of blocks (at most max_blocks_per_seq of them)."""

    def __init__(self, engine):
        self.engine = engine
        self.compiled: dict = {}

    def gather_program(self, blocks: int):
        """(pools, block-table row [blocks], length) -> staged arrays [L, N·blocks, K, page, D] per pool
        array, sharded like the pool (each rank its own blocks), slots at positions >= length zeroed."""
        if blocks not in self.compiled:
            eng = self.engine
            lay, model = eng.layout, eng.model
            spec = mesh_lib.kv_pool_spec(model.head_axes, model.context_axes, stacked=True)
            ctx_axes = model.context_axes
            leaves, tree = jax.tree.flatten(eng.pool_spec())

            def body(*args):
                pools, row, length = args[:-2], args[-2], args[-1]
                rank = lax.axis_index(ctx_axes) if ctx_axes else 0
                pos = lay.position_of(rank, jnp.arange(blocks)[:, None], jnp.arange(lay.page_size)[None, :])
                keep = (pos < length)[None, :, None, :, None]
                return tuple(jnp.where(keep, p[:, row], jnp.zeros((), p.dtype)) for p in pools)

            def gather(pools, row, length):
                flat = jax.tree.leaves(pools)
                out = jax.shard_map(body, mesh=eng.mesh, in_specs=(*(spec,) * len(flat), mesh_lib.lengths_spec(),
                                                                   mesh_lib.lengths_spec()),
                                    out_specs=(spec,) * len(flat))(*flat, row, length)
                return tree.unflatten(list(out))

            i32 = jax.ShapeDtypeStruct((blocks,), jnp.int32, sharding=eng.replicated)
            n = jax.ShapeDtypeStruct((), jnp.int32, sharding=eng.replicated)
            self.compiled[blocks] = jax.jit(gather).lower(tree.unflatten(leaves), i32, n).compile()
        return self.compiled[blocks]

    def stage(self, table_row, length: int) -> tuple[list[jax.Array], list[PieceSpec]]:
        """The pieces holding the first `length` tokens of the sequence whose block-table row is
        `table_row`: one single-device array per distinct shard (a kv head replicated over tp ranks is
        taken once), ready before this returns (the pool may be donated to the next step after)."""
        eng = self.engine
        blocks = int(eng.layout.blocks_for(length))
        row = np.asarray(table_row[:blocks], np.int32)
        staged = self.gather_program(blocks)(eng.pools, row, np.int32(length))
        rep = eng.model.kv_replication
        arrays, specs = [], []
        for s, stack in enumerate(staged):
            for k, arr in enumerate(stack):
                seen = set()
                for shard in sorted(arr.addressable_shards, key=lambda sh: (sh.index[2].start or 0,
                                                                            sh.index[1].start or 0)):
                    rank = (shard.index[1].start or 0) // blocks
                    h0 = shard.index[2].start or 0
                    if h0 % rep or (rank, h0) in seen:  # a replica of a head already taken
                        continue
                    seen.add((rank, h0))
                    heads = shard.data.shape[2] if rep == 1 else 1
                    data = shard.data if heads == shard.data.shape[2] else shard.data[:, :, :heads]
                    arrays.append(data)
                    specs.append(PieceSpec(s, k, rank, h0 // rep, tuple(data.shape), str(data.dtype)))
        jax.block_until_ready(arrays)
        return arrays, specs


class Receiver:
    """The decode side: writes pulled pieces into `engine`'s pool through the reshard plan.

    One compiled program per staged shape (number of source blocks)."""

    def __init__(self, engine, source: dict):
        self.engine, self.source = engine, source
        self.src = src_layout(source)
        self.compiled: dict = {}

    def scatter_program(self, specs: tuple[PieceSpec, ...], tokens: int):
        """(pools, pieces (replicated), src_row, src_slot, dst_page, dst_slot [tokens]) -> pools: each
        token's KV (the model's heads, re-split to this side's stored heads) written into its page slot;
        entries with dst_page out of range are dropped."""
        key = (specs, tokens)
        if key not in self.compiled:
            eng = self.engine
            model = eng.model
            spec = mesh_lib.kv_pool_spec(model.head_axes, model.context_axes, stacked=True)
            ctx_axes, head_axes = model.context_axes, model.head_axes
            heads_of = jnp.asarray(kv_head_sources(model.kv_heads, model.kv_replication), jnp.int32)
            pages = eng.config.num_pages
            leaves, tree = jax.tree.flatten(eng.pool_spec())
            order = [(s.stack, s.kind) for s in specs]
            groups = sorted(set(order))  # one per pool array, in tree order
            n_flat = len(leaves)
            assert len(groups) == n_flat, (groups, n_flat)

            def staged_of(pieces):
                """Reassemble each pool array's staged [L, N_src·blocks, kv_heads, page_src, D]."""
                out = []
                for g in groups:
                    mine = [(s, p) for s, p in zip(specs, pieces) if (s.stack, s.kind) == g]
                    by_head = {}
                    for s, p in mine:
                        by_head.setdefault(s.head0, []).append((s.rank, p))
                    cols = [jnp.concatenate([p for _, p in sorted(v, key=lambda x: x[0])], axis=1)
                            for _, v in sorted(by_head.items())]
                    out.append(jnp.concatenate(cols, axis=2))
                return out

            def body(*args):
                pools, pieces = args[:n_flat], args[n_flat:-4]
                src_row, src_slot, dst_page, dst_slot = args[-4:]
                rank = lax.axis_index(ctx_axes) if ctx_axes else 0
                local_heads = pools[0].shape[2]
                t = lax.axis_index(head_axes) if head_axes else 0
                head_map = lax.dynamic_slice_in_dim(heads_of, t * local_heads, local_heads)
                mine = dst_page // pages == rank
                page = jnp.where(mine, dst_page - rank * pages, pages)  # not this rank's: dropped
                out = []
                for pool, staged in zip(pools, staged_of(pieces)):
                    vals = staged[:, src_row, :, src_slot]  # [T, L, kv_heads, D]
                    vals = jnp.take(vals, head_map, axis=2)  # [T, L, K_local, D]
                    out.append(pool.at[:, page, :, dst_slot].set(vals.astype(pool.dtype), mode="drop"))
                return tuple(out)

            def scatter(pools, pieces, src_row, src_slot, dst_page, dst_slot):
                flat = jax.tree.leaves(pools)
                rep = mesh_lib.spec()
                out = jax.shard_map(body, mesh=eng.mesh,
                                    in_specs=(*(spec,) * n_flat, *(rep,) * len(pieces), *(rep,) * 4),
                                    out_specs=(spec,) * n_flat)(*flat, *pieces, src_row, src_slot, dst_page, dst_slot)
                return tree.unflatten(list(out))

            replicated = eng.replicated
            piece_specs = tuple(jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=replicated) for s in specs)
            idx = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=replicated)
            jitted = jax.jit(scatter, donate_argnums=(0,), out_shardings=eng.pool_sharding)
            self.compiled[key] = jitted.lower(tree.unflatten(leaves), piece_specs, idx, idx, idx, idx).compile()
        return self.compiled[key]

    def write(self, pieces: list[jax.Array], specs: list[PieceSpec], length: int, table_row) -> None:
        """Write the pulled pieces' first `length` tokens into the request's pages (block-table row)."""
        eng = self.engine
        plan = reshard_plan(self.src, eng.layout, length)
        cap = self.src.num_shards * plan.src_blocks * self.src.page_size  # the staged slots: a fixed shape
        pad = cap - length
        dst_page, dst_slot = plan.dst_pool_index(table_row, eng.config.num_pages)
        drop = eng.layout.num_shards * eng.config.num_pages
        idx = [np.concatenate([a, np.full(pad, fill)]).astype(np.int32) for a, fill in (
            (plan.src_row, 0), (plan.src_page_slot, 0), (dst_page, drop), (dst_slot, 0))]
        replicated = [jax.device_put(p, eng.replicated) for p in pieces]
        eng.pools = self.scatter_program(tuple(specs), cap)(eng.allocate(), tuple(replicated), *idx)


# --- the transport ------------------------------------------------------------------------------------


def wait_ready(arrays: list[jax.Array], timeout_s: float, what: str) -> list[jax.Array]:
    """`arrays` (a pull's results) once all are ready, or TransferError when one fails or they are not
    all ready within `timeout_s`. Polls `is_ready` rather than blocking a thread: a pull the library
    never completes is simply abandoned (a thread blocked in it would abort the process at exit)."""
    end = time.monotonic() + timeout_s
    pause = 0.0005
    while not all(a.is_ready() for a in arrays):
        if time.monotonic() > end:
            raise TransferError(f"{what} did not finish within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    try:
        return jax.block_until_ready(arrays)  # ready: returns at once, or raises the transfer's error
    except Exception as e:  # noqa: BLE001 - e.g. the source died mid-pull: "Connection closed"
        raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from None


class TransferPort:
    """One instance's `jax.experimental.transfer` server: offers (prefill side) and pulls (decode side).

    Offers nobody confirms within `offer_timeout_s` (the decode side went away or gave up) are drained:
    this side pulls them from itself, which is the one way the library lets go of an offer."""

    def __init__(self, device, host: str = "127.0.0.1", offer_timeout_s: float = 60.0):
        addr = f"{host}:0"
        self.server = jax_transfer.start_transfer_server(device.client, addr, [addr])
        self.device = device
        self.offer_timeout_s = offer_timeout_s
        self.pending: dict[int, tuple[float, list[jax.ShapeDtypeStruct]]] = {}  # uuid -> (deadline, avals)
        self.lock = threading.Lock()
        self.connections: dict = {}
        self.dropped = 0

    @property
    def address(self) -> str:
        return self.server.address()

    def offer(self, uuid: int, arrays: list[jax.Array]) -> None:
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
        with self.lock:
            self.pending[uuid] = (time.monotonic() + self.offer_timeout_s, avals)
        self.server.await_pull(uuid, arrays)

    def confirm(self, uuid: int) -> bool:
        """The peer pulled `uuid`: forget it. False if it was not pending (already dropped)."""
        with self.lock:
            return self.pending.pop(uuid, None) is not None

    def drop(self, uuid: int, timeout_s: float = 10.0) -> bool:
        """Let go of an offer nobody will pull, by pulling it here; False if it was not pending."""
        with self.lock:
            entry = self.pending.pop(uuid, None)
        if entry is None:
            return False
        try:
            wait_ready(self.connect(self.address).pull(uuid, entry[1]), timeout_s, "draining an offer")
        except TransferError:
            pass  # the peer pulled it after all (one pull consumes an offer): nothing is held
        self.dropped += 1
        return True

    def reap(self) -> int:
        """Drop every offer past its deadline; returns how many."""
        now = time.monotonic()
        with self.lock:
            late = [u for u, (deadline, _) in self.pending.items() if deadline < now]
        return sum(self.drop(u) for u in late)

    def num_pending(self) -> int:
        with self.lock:
            return len(self.pending)

    def connect(self, address: str):
        if address not in self.connections:
            self.connections[address] = self.server.connect(address)
        return self.connections[address]

    def pull(self, address: str, uuid: int, specs: list[PieceSpec], devices, timeout_s: float) -> list[jax.Array]:
        """Pull `uuid`'s pieces from the instance at `address`, piece i onto devices[i % len(devices)];
        returns them landed, or raises TransferError after at most `timeout_s` seconds."""
        avals = [jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=SingleDeviceSharding(devices[i % len(devices)]))
                 for i, s in enumerate(specs)]

        what = f"pulling the KV from the prefill instance's transfer server {address}"
        try:
            pulled = self.connect(address).pull(uuid, avals)
        except Exception as e:  # noqa: BLE001 - the library's error, as one line
            raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from None
        return wait_ready(pulled, timeout_s, what)


def new_uuid() -> int:
    """A random 63-bit transfer id."""
    return int.from_bytes(np.random.default_rng().bytes(8), "little") >> 1

