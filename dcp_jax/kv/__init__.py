"""The KV pool's host side: pages and their reference counts (the placement math is `dcp_jax.layout`)."""

from dcp_jax.kv.allocator import PageAllocator

__all__ = ["PageAllocator"]
