"""Prefill/decode disaggregation: a prefill instance hands each prompt's KV to a DCP decode instance
through `jax.experimental.transfer` (docs/DISAGG.md)."""

from dcp_jax.disagg.llm import DisaggregatedLLM
from dcp_jax.disagg.transfer import TransferError

__all__ = ["DisaggregatedLLM", "TransferError"]
