"""dcp_jax: Decode Context Parallelism in JAX — KV cache sharded along the sequence over a mesh axis.

The package's face is lazy: `import dcp_jax` loads nothing heavy, and each name below is imported
from its module on first use (so `import dcp_jax.serving.scheduler`, plain Python, loads no model).
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "AXES": "dcp_jax.mesh",
    "DCP": "dcp_jax.mesh",
    "TP": "dcp_jax.mesh",
    "ensure_cpu_devices": "dcp_jax.mesh",
    "make_mesh": "dcp_jax.mesh",
    "UserError": "dcp_jax.errors",
    "KVLayout": "dcp_jax.layout",
    "PagedLayout": "dcp_jax.layout",
    "kv_cache_bytes": "dcp_jax.layout",
    "SamplingParams": "dcp_jax.sampling_params",
    "Generation": "dcp_jax.outputs",
    "dcp_attention": "dcp_jax.attention",
    "SpeculativeConfig": "dcp_jax.spec.proposers",
    "Engine": "dcp_jax.dense",
    "LLM": "dcp_jax.llm",
    "DisaggregatedLLM": "dcp_jax.disagg.llm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
