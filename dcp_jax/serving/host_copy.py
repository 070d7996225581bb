"""Copies between the device pools and the host tier (`dcp_jax.kv.host`), rank by rank.

Each copy is one compiled program over the mesh (`jax.shard_map`) in which every device gathers (or
writes) the pages of a batch of blocks in its OWN shards of every pool, target and draft: a block
table entry names the same page index on every context rank, so nothing crosses devices and the
programs hold no collective (a test reads their HLO). The host keeps, per block and pool array, the
pieces of this process's devices (`addressable_shards`), keyed by the shard's place in the pool (its
context rank and kv-head slice); copying back assembles the batch's array from those pieces with
`jax.make_array_from_callback`, so each device receives its own share and no other.

Batches of n blocks are padded to a power of two with the null page (its KV is never read unmasked),
so the programs compiled are one gather and one write per power of two up to the largest batch.
Offloads are dispatched before the step that reuses the pages (device order makes the gather read
the old KV). The gather's output lives in pinned host memory where the devices have it (XLA memory
kinds: the copy out is part of the program, overlapping what follows), else on the device with its
copy to the host started at once (`copy_to_host_async`); the host arrays are taken into the blocks
after the iteration's step (`finish`), or earlier when a copy back needs them.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from dcp_jax.kv.host import HostBlock
from dcp_jax.kv.manager import NULL_PAGE
from pallas_kernels.attention.configs import pow2


def _place(index: tuple, n: int) -> tuple:
    """A shard's place in a pool: (context rank, kv-head slice) from its index into an [L, N·n, K, ...]
    batch array (its slice of the page axis is [rank·n, (rank + 1)·n))."""
    return ((index[1].start or 0) // n, index[2].start or 0, index[2].stop)


class HostCopier:
    """The offload and restore programs of one runner's pools (`StepPrograms`: their abstract values,
    mesh and program cache), and what they moved. The runner owns the pools: each copy takes them, and
    a restore returns the new ones."""

    def __init__(self, programs):
        self.programs = programs
        self.pending: list[tuple[list[HostBlock], list]] = []  # offloads whose host arrays are not taken yet
        self.counts = dict(host_bytes_to_host=0, host_bytes_to_device=0, host_copy_s=0.0)

    def batch_specs(self, n: int):
        """Abstract pools and the abstract batch of n pages of each pool array ([L, ranks·n, K, page, D],
        the pool's own sharding)."""
        caches = self.programs.pool_spec()
        pages = self.programs.config.num_pages
        return caches, jax.tree.map(lambda s: jax.ShapeDtypeStruct(
            (s.shape[0], s.shape[1] // pages * n, *s.shape[2:]), s.dtype, sharding=s.sharding), caches)

    def program(self, kind: str, n: int):
        """The compiled gather ("offload": (pools, pages [n]) -> batch) or write ("restore": (pools,
        pages [n], batch) -> pools, donated) of n pages in every pool array, rank by rank."""
        return self.programs.cache.get(("host_" + kind, n), lambda: self.build(kind, n))

    def build(self, kind: str, n: int):
        progs = self.programs
        caches, batch = self.batch_specs(n)
        specs = jax.tree.map(lambda s: s.sharding.spec, caches)
        pages = jax.ShapeDtypeStruct((n,), np.int32, sharding=progs.replicated)
        replicated = jax.sharding.PartitionSpec()
        if kind == "offload":
            body = jax.shard_map(lambda pools, idx: jax.tree.map(lambda x: x[:, idx], pools),
                                 mesh=progs.mesh, in_specs=(specs, replicated), out_specs=specs)
            # the gathered pages land in host memory (pinned_host, where the devices have it): XLA
            # copies them out as part of the program, without a second dispatch
            out = jax.tree.map(lambda s: self.host_sharding(s.sharding), batch)
            return jax.jit(body, out_shardings=out).lower(caches, pages).compile()
        body = jax.shard_map(
            lambda pools, idx, vals: jax.tree.map(lambda x, v: x.at[:, idx].set(v), pools, vals),
            mesh=progs.mesh, in_specs=(specs, replicated, specs), out_specs=specs)
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=progs.shardings)
        return jitted.lower(caches, pages, batch).compile()

    @staticmethod
    def host_sharding(sharding):
        """`sharding` in pinned host memory where its devices have such memory, else as it is."""
        device = next(iter(sharding.device_set))
        kinds = {m.kind for m in device.addressable_memories()}
        return sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else sharding

    def compile_all(self, most: int) -> None:
        """Compile both copies for every batch size up to `most` blocks (a sequence's)."""
        n = 1
        while True:
            self.program("offload", n)
            self.program("restore", n)
            if n >= most:
                break
            n *= 2

    def drop(self) -> None:
        """After a failure: forget the offloads not taken yet (their blocks stay unfilled)."""
        self.pending.clear()

    @staticmethod
    def padded(pages) -> np.ndarray:
        """Page indices padded with the null page to a power of two."""
        out = np.full(pow2(len(pages)), NULL_PAGE, np.int32)
        out[:len(pages)] = pages
        return out

    def offload(self, caches, blocks: list[HostBlock], pages) -> None:
        """Dispatch the gather of `pages` (the blocks' device pages, in order) from `caches` and start
        its copies to the host; the blocks' payloads are filled by `finish`."""
        if not blocks:
            return
        idx = self.padded(pages)
        program = self.program("offload", len(idx))
        t = time.perf_counter()
        out = program(caches, idx)
        leaves = jax.tree.leaves(out)
        for leaf in leaves:
            for sh in leaf.addressable_shards:
                if sh.replica_id == 0:
                    sh.data.copy_to_host_async()
        self.pending.append((list(blocks), leaves))
        self.counts["host_copy_s"] += time.perf_counter() - t

    def finish(self) -> None:
        """Take the host arrays of every dispatched offload into its blocks' payloads: per pool array, a
        dict from each shard's place to its [L, 1, K_local, page, D] piece (this process's shards only)."""
        t = time.perf_counter()
        for blocks, leaves in self.pending:
            n = pow2(len(blocks))
            payloads = [[{} for _ in leaves] for _ in blocks]
            for i, leaf in enumerate(leaves):
                for sh in leaf.addressable_shards:
                    if sh.replica_id:
                        continue
                    data = np.asarray(sh.data)
                    place = _place(sh.index, n)
                    for j, payload in enumerate(payloads):
                        payload[i][place] = data[:, j:j + 1].copy()
                        self.counts["host_bytes_to_host"] += payload[i][place].nbytes
            for block, payload in zip(blocks, payloads):
                block.payload = payload
        self.pending.clear()
        self.counts["host_copy_s"] += time.perf_counter() - t

    def restore(self, caches, blocks: list[HostBlock], pages):
        """Write the blocks' host payloads into `pages` of every pool array of `caches` (donated; each
        device its own share); returns the new pools."""
        if not blocks:
            return caches
        self.finish()  # a block evicted and hit in the same iteration: its payload first
        idx = self.padded(pages)
        n = len(idx)
        program = self.program("restore", n)
        t = time.perf_counter()
        _, batch = self.batch_specs(n)

        def assemble(i, spec):
            def piece(index):
                place = _place(index, n)
                parts = [b.payload[i][place] for b in blocks]
                parts += [np.zeros_like(parts[0])] * (n - len(blocks))
                return np.concatenate(parts, axis=1)
            arr = jax.make_array_from_callback(spec.shape, spec.sharding, piece)
            self.counts["host_bytes_to_device"] += sum(
                sh.data.nbytes * len(blocks) // n for sh in arr.addressable_shards if sh.replica_id == 0)
            return arr

        specs, tree = jax.tree.flatten(batch)
        values = jax.tree.unflatten(tree, [assemble(i, s) for i, s in enumerate(specs)])
        caches = program(caches, idx, values)
        self.counts["host_copy_s"] += time.perf_counter() - t
        return caches


def host_bytes(blocks) -> int:
    """Bytes the host tier's filled blocks hold in this process."""
    return sum(piece.nbytes for b in blocks if b.payload is not None for pool in b.payload for piece in pool.values())
