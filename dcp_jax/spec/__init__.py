"""Speculative decoding: proposers (n-gram lookup, a draft model) and the acceptance rule of the verify step."""

from dcp_jax.spec.proposers import NgramProposer, SpeculativeConfig, layer_skip_draft, propose_ngram

__all__ = ["NgramProposer", "SpeculativeConfig", "layer_skip_draft", "propose_ngram"]
