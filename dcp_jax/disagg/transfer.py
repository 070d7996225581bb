"""Moving one request's prompt KV from a prefill instance's pool into a decode instance's pool.

    decode side:   asks for the prefill with its placement (`placement`: context ranks, interleave,
                   page size, how its kv heads split over tp)
    prefill side:  one gather program cuts the request's KV into pieces [T, L, heads, D], one per
                   (source rank, destination rank, destination head shard's heads) on the source device
                   holding them: the tokens that source rank holds and that destination rank owns, in
                   the order the destination writes them (`ReshardPlan.piece_positions`), padded with
                   zeros to every slot of the source's blocks (sizes depend on the number of blocks only),
                   sent in power-of-two chunks (`handoff.chunks`); a kv head replicated over source tp
                   ranks is taken once, a head several destination shards keep is offered once; offered
                   under a uuid                                                 [TransferServer.await_pull]
    decode side:   pulls each piece onto the device of its destination rank that keeps its heads
                   (copies it to that rank's other devices keeping the same head, where tp > kv heads),
                   within a deadline                                                               [pull]
                   then each device's own programs write its pieces' tokens into its pages of the
                   request, one chunk of every pool array each (its pool shard donated; padding
                   dropped); the pool is reassembled from the shards without a copy [jit per device]

So no decode device ever holds more of a prompt than its own tokens of its own heads, plus the zero
padding of the source's last block (under one source page per source rank); the bytes pulled are the
prompt's KV plus that padding, each head once. A decode instance on several processes (`spanning`)
gets one offer per process: each pulls and writes only what its own devices keep.

The transport is `jax.experimental.transfer`. What it does and does not do (JAX 0.12, probed on CPU):
a pull must ask for exactly the source's shard structure (the same shard shapes, in order; a
differently split or replicated pull fails, and once aborted the source process). So the source offers
single-device pieces and the destination picks the device each lands on; the source cuts them for the
destination's placement (ranks, interleave, page size, tp), the destination scatters them into its own
pages. The pieces of different destination ranks differ in size (the tokens each pair of ranks shares:
e.g. round-robin over 2 ranks on both sides sends nothing from rank 0 to rank 1), so one program over
the destination mesh could take them only padded to the largest, which would pull and hold more than
each rank's share: the write programs are per device instead, one per (device, head range, chunk
size), O(log max length) per device, all compiled when the pair forms (`Receiver.warm`). The
library's `timeout` arguments bounded nothing in our probes: a pull of a uuid nobody offers, or from
a process that died before the pull, waits forever; a source dying mid-pull fails the pull at once.
So every wait here runs under our own deadline (polling `is_ready`; an
abandoned pull blocks no thread), and an offer nobody pulls is drained by the prefill side pulling it
from itself (one pull consumes an offer).

Placement math comes from `dcp_jax.layout` (`reshard_plan`, `kv_head_ranges`); partition specs from
`dcp_jax.mesh`.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import transfer as jax_transfer
from jax.sharding import SingleDeviceSharding

from dcp_jax import mesh as mesh_lib
from dcp_jax.disagg.handoff import PieceSpec, chunks, describe, head_ranges, piece_head_ranges, src_layout
from dcp_jax.layout import PagedLayout, kv_head_sources, reshard_plan
from dcp_jax.serving.config import padded_size, step_sizes


class TransferError(RuntimeError):
    """A request's KV did not arrive (the prefill instance died, stalled or refused): fail that request."""


class Stager:
    """The prefill side: gathers a request's KV out of `engine`'s pool into single-device pieces, one per
    (source rank, destination rank, destination head shard's heads), cut for the destination's placement.
    One compiled gather per (block count, destination placement), block counts padded up to `gather_sizes`
    (powers of two and 1.5 times them: O(log) programs, each reading at most a third more blocks)."""

    def __init__(self, runner):
        self.engine = runner.programs  # a ModelRunner's programs: its pools' shapes, layout, mesh, cache
        self.runner = runner
        self.gather_sizes = step_sizes(self.engine.max_blocks_per_seq, smallest=1, fine_from=4)

    @property
    def compiled(self) -> dict:
        """The gathers compiled (in the runner's program cache), by (blocks, destination placement)."""
        return self.engine.cache.kind("transfer_gather")

    def gather_program(self, blocks: int, dst: PagedLayout):
        """(pools, block-table row [blocks], length) -> per destination rank r that owns any staged slot,
        per pool array, the tokens [N_src·B_r, L, K, D] (token-major, as the destination writes them):
        source rank s's B_r rows are its tokens of piece (s, r) in `piece_positions` order, then zero rows
        up to B_r (the largest such piece); sharded like the pool (each rank gathers from its own pages),
        positions >= length zeroed. Returns (the compiled program, those ranks r in output order)."""
        return self.engine.cache.get(("transfer_gather", blocks, dst), lambda: self.build(blocks, dst))

    def build(self, blocks: int, dst: PagedLayout):
        eng = self.engine
        lay, model = eng.layout, eng.model
        spec = mesh_lib.kv_pool_spec(model.head_axes, model.context_axes, stacked=True)
        out_spec = mesh_lib.kv_tokens_spec(model.head_axes, model.context_axes)
        ctx_axes = model.context_axes
        leaves, tree = jax.tree.flatten(eng.pool_spec().target)
        plan = reshard_plan(lay, dst, blocks * lay.tokens_per_block)
        positions, end = plan.piece_positions(), plan.staged_tokens
        tables = []  # (dst rank, [N_src, B] positions, padded with `end`: never < length)
        for r in range(dst.num_shards):
            width = max(len(positions[s][r]) for s in range(lay.num_shards))
            if width:
                table = np.full((lay.num_shards, width), end, np.int32)
                for s in range(lay.num_shards):
                    table[s, :len(positions[s][r])] = positions[s][r]
                tables.append((r, table))

        def body(*args):
            pools, row, length = args[:-2], args[-2], args[-1]
            rank = lax.axis_index(ctx_axes) if ctx_axes else 0
            out = []
            for _, table in tables:
                pos = jnp.asarray(table)[rank]  # this source rank's tokens of its piece for that rank
                page = lay.page_of(row, pos)  # (every slot of the staged blocks: within the row)
                keep = (pos < length)[:, None, None, None]
                for p in pools:
                    vals = p[:, page, :, lay.page_slot_of(pos)]  # [B, L, K, D]
                    out.append(jnp.where(keep, vals, jnp.zeros((), p.dtype)))
            return tuple(out)

        def gather(pools, row, length):
            flat = jax.tree.leaves(pools)
            return jax.shard_map(body, mesh=eng.mesh, in_specs=(*(spec,) * len(flat), mesh_lib.lengths_spec(),
                                                                mesh_lib.lengths_spec()),
                                 out_specs=(out_spec,) * (len(flat) * len(tables)))(*flat, row, length)

        i32 = jax.ShapeDtypeStruct((blocks,), jnp.int32, sharding=eng.replicated)
        n = jax.ShapeDtypeStruct((), jnp.int32, sharding=eng.replicated)
        compiled = jax.jit(gather).lower(tree.unflatten(leaves), i32, n).compile()
        return compiled, [r for r, _ in tables]

    def stage(self, table_row, length: int, dest: dict) -> tuple[list[jax.Array], list[PieceSpec]]:
        """The pieces holding the first `length` tokens of the sequence whose block-table row is
        `table_row`, cut for the decode side `dest` describes (`placement`): per pool array, destination
        rank r, source rank s and destination head shard, one single-device array on the source device
        holding those heads, of the tokens s holds and r owns (a kv head replicated over tp ranks is taken
        once; a head several destination shards keep is offered once). Ready before this returns (the
        pool may be donated to the next step after)."""
        eng = self.engine
        model = eng.model
        dst = src_layout(dest)
        wanted = sorted(set(head_ranges(dest)))  # distinct: replicated destination heads share one piece
        blocks = int(eng.layout.blocks_for(length))
        padded = padded_size(self.gather_sizes, blocks)
        row = np.asarray(table_row[:padded], np.int32)  # blocks past the sequence's: read, then zeroed (>= length)
        program, dst_ranks = self.gather_program(padded, dst)
        # piece (s, r) of the padded gather starts with this length's piece (positions ascend): send that
        sizes = reshard_plan(eng.layout, dst, blocks * eng.layout.tokens_per_block).piece_sizes()
        staged = program(self.runner.pools, row, np.int32(length))
        heads_of = kv_head_sources(model.kv_heads, model.kv_replication)
        flat = jax.tree.leaves(eng.pool_spec().target)
        groups = [(s, k) for s, stack in enumerate(eng.pool_spec().target) for k in range(len(stack))]
        arrays, specs = [], []
        for i, r in enumerate(dst_ranks):
            for g, (s, k) in enumerate(groups):
                arr = staged[i * len(flat) + g]
                width = arr.shape[0] // eng.layout.num_shards
                seen = set()
                for shard in sorted(arr.addressable_shards, key=lambda sh: (sh.index[2].start or 0,
                                                                            sh.index[0].start or 0)):
                    rank = (shard.index[0].start or 0) // width
                    h0 = shard.index[2].start or 0
                    mine = heads_of[h0:h0 + shard.data.shape[2]]  # the model heads of its stored heads
                    n = int(sizes[rank, r])
                    for lo, hi in wanted:
                        lo, hi = max(lo, int(mine[0])), min(hi, int(mine[-1]) + 1)
                        if lo >= hi or n == 0 or (rank, lo) in seen:  # a replica of a piece already taken
                            continue
                        seen.add((rank, lo))
                        j = int(np.argmax(mine == lo))  # its first stored copy of head lo
                        for offset, size in chunks(n):  # power-of-two chunks: O(log n) write programs
                            data = shard.data
                            if (offset, size, hi - lo) != (0, data.shape[0], data.shape[2]):
                                data = data[offset:offset + size, :, j:j + hi - lo]
                            arrays.append(data)
                            specs.append(PieceSpec(s, k, rank, r, lo, offset, tuple(data.shape), str(data.dtype)))
        jax.block_until_ready(arrays)
        return arrays, specs


class Receiver:
    """The decode side: writes pulled pieces into `engine`'s pool, each device only its own tokens.

    Every piece is pulled onto the device of its destination rank that keeps its heads (`pull_devices`);
    a head several of this side's head shards keep (kv heads replicated over tp) is copied to the
    others of that rank. Then each device runs its own write program (its pool shard donated) on the
    pieces it holds; the pool is reassembled from the shards without a copy. A device never holds more
    of the prompt than its own tokens of its own heads (plus the padding of the source's last block).
    Pieces differ in size from rank to rank (the tokens each pair of ranks shares), which a single
    program over the mesh could only take padded to the largest, so the programs are per device; a
    piece travels in power-of-two chunks (`chunks`), and one program writes one chunk of every pool
    array: one per (device, head range, chunk size), all compiled by `warm` when the pair forms, so
    no prompt length compiles anything while requests decode."""

    def __init__(self, runner, source: dict):
        self.runner, self.source = runner, source  # a ModelRunner: it writes its own pools
        self.engine = runner.programs  # its pools' shapes, layout, mesh and program cache
        self.src = src_layout(source)
        self.dispatches = 0  # write programs run (one per device and chunk of its pieces)
        model = runner.model
        pages = runner.config.num_pages
        heads_of = kv_head_sources(model.kv_heads, model.kv_replication)
        shape = jax.tree.leaves(runner.pool_spec().target)[0].shape
        where = runner.programs.pool_sharding.devices_indices_map(shape)
        self.devices = []  # (device, context rank, the model heads of its stored heads), in mesh order
        for dev in runner.mesh.devices.flat:
            idx = where[dev]
            h = range(model.kv_heads)[idx[2]]
            self.devices.append((dev, (idx[1].start or 0) // pages, heads_of[h.start:h.stop]))
        # several processes (a decode instance on jax.distributed): this one pulls and writes only what
        # its own devices keep
        self.process = jax.process_index()
        self.local = runner.mesh.local_devices

    @property
    def compiled(self) -> dict:
        """The write programs compiled (in the runner's program cache), by (device id, meta)."""
        return self.engine.cache.kind("transfer_write")

    def keepers(self, rank: int, lo: int, hi: int) -> list:
        """The devices of context rank `rank` holding all of the model's kv heads [lo, hi)."""
        return [d for d, r, mine in self.devices if r == rank and all(h in mine for h in range(lo, hi))]

    def targets(self, spec: PieceSpec) -> list:
        """This process's devices that keep `spec`'s tokens and heads: those of its destination rank
        holding its heads (several when this side stores a head on more than one tp rank)."""
        heads = range(spec.head0, spec.head0 + spec.shape[2])
        out = [d for d in self.keepers(spec.dst_rank, heads.start, heads.stop) if d in self.local]
        if not out:
            raise TransferError(f"the prefill instance offered a piece for rank {spec.dst_rank}, kv heads "
                                f"{heads.start}..{heads.stop - 1}, which no device of this process keeps")
        return out

    def pull_devices(self, specs: list[PieceSpec]) -> list:
        """Where each piece lands when pulled: the first device of this process that keeps it."""
        return [self.targets(s)[0] for s in specs]

    def processes(self) -> list:
        """Per (destination rank, kv heads [lo, hi) of a piece the source cuts for this side), the
        processes whose devices keep it: the decode placement's `processes` (`handoff.process_groups`)."""
        ranges = piece_head_ranges(self.source, describe(self.engine, "decode", ""))
        return [[rank, lo, hi, sorted({d.process_index for d in self.keepers(rank, lo, hi)})]
                for rank in range(self.engine.layout.num_shards) for lo, hi in ranges]

    def chunk_meta(self, head0: int, heads: int, size: int) -> tuple[tuple, tuple]:
        """A write program's key past the device: (pool array, head0, piece shape) of one chunk of
        `size` tokens of kv heads [head0, head0 + heads) of every pool array, and the index lengths."""
        leaves = jax.tree.leaves(self.engine.pool_spec().target)
        meta = tuple((g, head0, (size, leaf.shape[0], heads, leaf.shape[-1])) for g, leaf in enumerate(leaves))
        return meta, (size,) * len(leaves)

    def warm(self, max_length: int) -> int:
        """Compile every write program a prompt of up to `max_length` tokens can need: per device, per
        head range of the pieces it keeps, per chunk size up to its largest piece. Returns how many were
        compiled (none when done already)."""
        before = len(self.compiled)
        blocks = self.src.blocks_for(max_length)
        sizes = reshard_plan(self.src, self.engine.layout, blocks * self.src.tokens_per_block).piece_sizes()
        ranges = piece_head_ranges(self.source, describe(self.engine, "decode", ""))
        for dev, rank, mine in self.devices:
            if dev not in self.local:
                continue
            most = int(sizes[:, rank].max())
            for lo, hi in ranges:
                if not all(h in mine for h in range(lo, hi)):
                    continue
                for bit in range(most.bit_length()):
                    self.write_program(dev, *self.chunk_meta(lo, hi - lo, 1 << bit))
        return len(self.compiled) - before

    def write_program(self, device, meta: tuple, index_len: tuple):
        """(this device's pool shards, its pieces, page [T] and slot [T] per piece) -> pool shards: piece
        i = meta[i] (pool array, head0, shape) written into every stored head of this device that holds
        one of its heads, token j at (page[j], slot[j]) of this device's pages; pages out of range dropped."""
        return self.engine.cache.get(("transfer_write", device.id, meta),
                                     lambda: self.build(device, meta, index_len))

    def build(self, device, meta: tuple, index_len: tuple):
        eng = self.engine
        leaves = jax.tree.leaves(eng.pool_spec().target)
        sharding = SingleDeviceSharding(device)
        mine = next(m for d, _, m in self.devices if d == device)

        def put(pool, x, pg, j, sl):
            """pool[:, pg[t], j:j+h, sl[t]] = x[t] for x [T, L, h, D], straight from the piece (token-major
            as XLA scatters: no transposed or per-head copy of it); tokens whose page is out of range
            are dropped."""
            idx = jnp.stack([pg, jnp.full_like(pg, j), sl], axis=1)  # [T, 3]: page, first head, slot
            dims = lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3), inserted_window_dims=(1, 3),
                                               scatter_dims_to_operand_dims=(1, 2, 3))
            return lax.scatter(pool, idx, x.astype(pool.dtype), dims, indices_are_sorted=False,
                               unique_indices=False, mode=lax.GatherScatterMode.FILL_OR_DROP)

        def write(pools, pieces, page, slot):
            pools = list(pools)
            for (g, head0, shape), x, pg, sl in zip(meta, pieces, page, slot):
                h = shape[2]
                js = [j for j, m in enumerate(mine.tolist()) if head0 <= m < head0 + h]
                if len(js) == h and mine[js[0]:js[0] + h].tolist() == list(range(head0, head0 + h)):
                    pools[g] = put(pools[g], x, pg, js[0], sl)  # the piece's heads, stored once, in order
                else:
                    for j in js:  # a head this device stores several times
                        m = int(mine[j]) - head0
                        pools[g] = put(pools[g], x[:, :, m:m + 1], pg, j, sl)  # (rare: a copy of one head)
            return tuple(pools)

        pool_args = tuple(jax.ShapeDtypeStruct(eng.pool_sharding.shard_shape(leaf.shape), leaf.dtype,
                                               sharding=sharding) for leaf in leaves)
        kv_dtype = leaves[0].dtype  # (8-bit pages: the pieces are the stored rows, scales included)
        piece_args = tuple(jax.ShapeDtypeStruct(shape, kv_dtype, sharding=sharding) for _, _, shape in meta)
        idx = tuple(jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding) for n in index_len)
        jitted = jax.jit(write, donate_argnums=(0,))
        return jitted.lower(pool_args, piece_args, idx, idx).compile()

    def write(self, pieces: list[jax.Array], specs: list[PieceSpec], length: int, table_row) -> dict[int, int]:
        """Write the pulled pieces' first `length` tokens into the request's pages (block-table row).
        Returns the bytes of KV the receive path placed on each device (device id -> bytes, summed over
        the pulled pieces and their copies actually held there)."""
        eng = self.engine
        lay, pages = eng.layout, eng.config.num_pages
        positions = reshard_plan(self.src, lay, length).piece_positions()
        table_row = np.asarray(table_row)
        groups = [(s, k) for s, stack in enumerate(eng.pool_spec().target) for k in range(len(stack))]
        held: dict = {d: [] for d in self.local}  # device -> [(spec, array, page, slot)]
        for piece, spec in zip(pieces, specs):
            pos = positions[spec.rank][spec.dst_rank] if spec.rank < len(positions) else np.zeros(0, np.int64)
            if spec.offset + spec.shape[0] > len(pos) or spec.shape[0] & (spec.shape[0] - 1):
                raise TransferError(f"a piece of {spec.shape[0]} tokens from offset {spec.offset} of rank {spec.rank}'s "
                                    f"to rank {spec.dst_rank}, where the placements give {len(pos)}")
            pos = pos[spec.offset:spec.offset + spec.shape[0]]
            keep = pos < length
            page = lay.page_of(table_row, pos, keep, missing=pages)
            slot = lay.page_slot_of(pos)
            for dev in self.targets(spec):  # several when this side replicates the piece's head
                here = piece if piece.devices() == {dev} else jax.device_put(piece, SingleDeviceSharding(dev))
                held[dev].append((spec, here, page.astype(np.int32), slot.astype(np.int32)))
        placed = {d.id: sum(sh.data.nbytes for _, a, _, _ in held[d] for sh in a.addressable_shards if sh.device == d)
                  for d in held}

        def write(dev, shards):  # this device's pool shards (donated to each program) -> the new ones
            chunked: dict = {}  # one chunk of every pool array: (source rank, head0, offset) -> {array: item}
            for item in held[dev]:
                s = item[0]
                chunked.setdefault((s.rank, s.head0, s.offset), {})[groups.index((s.stack, s.kind))] = item
            for (_, head0, _), by_group in chunked.items():
                if sorted(by_group) != list(range(len(groups))):
                    raise TransferError(f"the prefill instance sent a chunk of {len(by_group)} of the "
                                        f"{len(groups)} pool arrays")
                items = [by_group[g] for g in range(len(groups))]
                meta, index_len = self.chunk_meta(head0, items[0][0].shape[2], items[0][0].shape[0])
                if [s.shape for s, _, _, _ in items] != [shape for _, _, shape in meta]:
                    raise TransferError(f"the prefill instance sent pieces of shapes {[s.shape for s, _, _, _ in items]} "
                                        f"where this pool takes {[shape for _, _, shape in meta]}")
                program = self.write_program(dev, meta, index_len)
                shards = program(shards, tuple(a for _, a, _, _ in items), tuple(p for _, _, p, _ in items),
                                 tuple(s for _, _, _, s in items))
                self.dispatches += 1
            return shards

        self.runner.write_pool_shards(write)
        return placed


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

    def __init__(self, device, host: str = "127.0.0.1", offer_timeout_s: float = 60.0, advertise: str | None = None):
        addr = f"{host}:0"  # (any free port)
        self.server = jax_transfer.start_transfer_server(device.client, addr, [addr])
        self.advertise = advertise  # the host name peers reach this server by (default: the bound address)
        self.device = device
        self.offer_timeout_s = offer_timeout_s
        self.pending: dict[int, tuple[float, list[jax.ShapeDtypeStruct]]] = {}  # uuid -> (deadline, avals)
        self.lock = threading.Lock()
        self.connections: dict = {}
        self.dropped = 0

    @property
    def address(self) -> str:
        """Where peers pull from: the bound address, its host replaced by `advertise` when given (a
        server bound to 0.0.0.0 is reached by the host's own name)."""
        bound = self.server.address()
        return bound if self.advertise is None else f"{self.advertise}:{bound.rpartition(':')[2]}"

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
        """Pull `uuid`'s pieces from the instance at `address`, piece i onto devices[i]; returns them
        landed, or raises TransferError after at most `timeout_s` seconds."""
        avals = [jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=SingleDeviceSharding(d))
                 for s, d in zip(specs, devices, strict=True)]

        what = f"pulling the KV from the prefill instance's transfer server {address}"
        try:
            pulled = self.connect(address).pull(uuid, avals)
        except Exception as e:  # noqa: BLE001 - the library's error, as one line
            raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from None
        return wait_ready(pulled, timeout_s, what)
