"""dcp_jax: Decode Context Parallelism in JAX — KV cache sharded along the sequence over a mesh axis."""

from dcp_jax.attention import dcp_attention
from dcp_jax.disagg import DisaggregatedLLM
from dcp_jax.engine import LLM, Engine, Generation, SamplingParams
from dcp_jax.errors import UserError
from dcp_jax.layout import KVLayout, PagedLayout, kv_cache_bytes
from dcp_jax.mesh import AXES, DCP, TP, ensure_cpu_devices, make_mesh
from dcp_jax.spec import SpeculativeConfig

__all__ = [
    "AXES",
    "LLM",
    "DisaggregatedLLM",
    "Engine",
    "Generation",
    "SamplingParams",
    "SpeculativeConfig",
    "UserError",
    "DCP",
    "TP",
    "KVLayout",
    "PagedLayout",
    "dcp_attention",
    "ensure_cpu_devices",
    "kv_cache_bytes",
    "make_mesh",
]
