"""Argument helpers of the disaggregation flags of `python -m dcp_jax.serve` (no JAX import here)."""

from __future__ import annotations

import argparse


def positive_float(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value
    return parse


def check_role_args(args) -> str | None:
    """The one-line usage error of an inconsistent role, or None."""
    if args.role == "decode" and not args.prefill_at:
        return "--role decode needs --prefill-at HOST:PORT (the prefill instance's --host and --port)"
    if args.prefill_at and args.role != "decode":
        return "--prefill-at is for --role decode: give --role decode, or drop --prefill-at"
    if args.prefill_at:
        host, _, port = args.prefill_at.rpartition(":")
        if not host or not port.isdigit():
            return f"--prefill-at takes HOST:PORT, got {args.prefill_at!r}"
    if args.role == "single" and args.interleave != 1:
        return "--interleave applies to --role prefill and --role decode (a single instance uses 1)"
    return None
