"""Attention of a query block over one KV slice, returning the output and its log-sum-exp.

`api.attention` picks the implementation; `reference` is the pure-jnp oracle and CPU path; `triton` is
the Pallas GPU kernel (flash-decoding).
"""

from pallas_kernels.attention.api import IMPLEMENTATIONS, attention, default_impl, ragged_attention
from pallas_kernels.attention.common import SlotPositions, check_inputs, merge_partials, merge_weights

__all__ = [
    "IMPLEMENTATIONS",
    "SlotPositions",
    "attention",
    "check_inputs",
    "default_impl",
    "merge_partials",
    "merge_weights",
    "ragged_attention",
]
