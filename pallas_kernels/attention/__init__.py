"""Attention of a query block over one KV slice, returning the output and its log-sum-exp.

`api` holds the registry of implementations and picks from it: `reference` is the pure-jnp oracle
and CPU path; `triton` the Pallas GPU kernel (flash-decoding); `cudnn` cuDNN's fused attention for
prefill tiles' diagonal blocks.
"""

from pallas_kernels.attention.api import (
    REGISTRY,
    Implementation,
    attention,
    default_impl,
    diagonal_impl,
    implementations,
    ragged_attention,
    ragged_self_attention,
    register,
    self_attention,
)
from pallas_kernels.attention.common import (
    SlotPositions,
    check_inputs,
    merge_partials,
    merge_weights,
)

__all__ = [
    "REGISTRY",
    "Implementation",
    "SlotPositions",
    "attention",
    "check_inputs",
    "default_impl",
    "diagonal_impl",
    "implementations",
    "merge_partials",
    "merge_weights",
    "ragged_attention",
    "ragged_self_attention",
    "register",
    "self_attention",
]
