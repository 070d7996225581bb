"""The embedded model's text (no JAX here: scripts whose own interpreter has none read it too).

Python's documentation topics (`pydoc_data`, shipped with Python), joined in key order; the last 5% is
held out from training (scripts/train_tiny.py).
"""

from __future__ import annotations

TRAIN_FRACTION = 0.95


def corpus() -> bytes:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def split(data: bytes | None = None) -> tuple[bytes, bytes]:
    """(train, held out) bytes of `data` (default: the corpus)."""
    data = corpus() if data is None else data
    cut = int(len(data) * TRAIN_FRACTION)
    return data[:cut], data[cut:]
