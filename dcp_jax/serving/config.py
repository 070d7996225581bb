"""Serving configuration: one `ServingConfig` per engine, and the scheduler's view derived from it.

Plain Python (no devices). `ServingConfig` holds the sizes that fix the compiled programs (pages,
page size, slots, context, prefill chunk, decode steps) and the scheduling knobs; `SchedulerConfig` is
what the host scheduler needs of it plus what comes from the model (EOS ids, vocabulary, placement,
speculation), built by `ServingConfig.scheduler_config`. `parse_bytes` reads memory sizes ("512MiB").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dcp_jax.errors import UserError
from dcp_jax.layout import PagedLayout


# Prompt tokens per prefill chunk when none is given. CPU: measured (scripts/bench_decode.py). GPU: the
# query-tiled kernel keeps shared memory independent of the chunk, so larger chunks only amortise the
# weight reads. 2048 is not chosen by a measurement yet: the first GPU run (docs/PERFORMANCE.md, one
# H100) prefilled with it (TTFT 1.97 s at batch 4 x 32K) but recorded no sweep of the chunk;
# scripts/gpu_check.sh sweeps 512-4096 and prints the fastest.
DEFAULT_PREFILL_CHUNK = {"cpu": 256, "gpu": 2048}
# The token budget of an iteration in which no request decodes (nobody waits on its step), when
# neither budget nor chunk is given: a lone long prompt prefills in larger chunks (CPU: 1.7-1.9x
# faster at 16K; docs/PERFORMANCE.md, "Long prompts"), while an iteration with decoding requests
# keeps the decode budget above (their time per token does not change). GPU: the decode budget.
DEFAULT_IDLE_BATCHED_TOKENS = {"cpu": 1024}
DEFAULT_PAGE_SIZE = 64  # slots per page; a block-table entry covers page_size · dcp tokens


KV_CACHE_DTYPES = ("auto", "int8", "fp8")

def default_prefill_chunk(platform: str) -> int:
    return DEFAULT_PREFILL_CHUNK.get(platform, DEFAULT_PREFILL_CHUNK["cpu"])


def default_idle_batched_tokens(platform: str) -> int | None:
    """The idle token budget of `platform` (None: the decode budget)."""
    return DEFAULT_IDLE_BATCHED_TOKENS.get(platform)


def check_positive_ints(obj, names, least: dict | None = None) -> None:
    """UserError naming the first field of `obj` in `names` that is not an integer >= 1 (or its `least`)."""
    for name in names:
        v, low = getattr(obj, name), (least or {}).get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise UserError(f"{name} must be an integer >= {low}, got {v!r}"
                            + (" (page 0 is the reserved null page)" if name == "num_pages" else ""))


def step_sizes(budget: int, smallest: int = 16, fine_from: int = 128) -> tuple[int, ...]:
    """The token counts a ragged step is padded to, up to `budget`: powers of two from `smallest`, from
    `fine_from` on also 1.5 times them (a large step is padded by at most a third), then the budget
    itself. A step of n tokens runs the smallest size >= n; each size is one compiled program."""
    out, p = [], smallest
    while p < budget:
        out += [p] + ([p * 3 // 2] if p >= fine_from else [])
        p *= 2
    return tuple(q for q in out if q < budget) + (budget,)


def padded_size(sizes, n: int) -> int:
    """The smallest of `sizes` (ascending, as `step_sizes` makes them) that holds `n`."""
    return next(size for size in sizes if size >= n)


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Shapes that fix the compiled programs: pages per context rank (the null page included), page
    size, slots, the model context, the prefill chunk and the decode steps per program call; and the
    token budget of one iteration (`max_num_batched_tokens`: its decode tokens and prefill chunks
    together; default `prefill_chunk` + `max_num_seqs`, so an iteration in which every slot decodes
    still prefills a chunk); `idle_batched_tokens`: the budget of an iteration in which no request
    decodes (None: the same; never less). `ragged_tile`: the query tokens of one tile of a prefill
    chunk in the ragged step (pallas_kernels/attention/ragged.py)."""

    num_pages: int
    page_size: int
    max_num_seqs: int
    max_model_len: int
    prefill_chunk: int
    decode_steps: int = 8
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = False
    ragged_tile: int = 32
    idle_batched_tokens: int | None = None
    host_blocks: int = 0  # blocks the host-memory tier under the prefix cache holds (0: none)
    # the KV pages' format: "auto" (the model's dtype) or "int8" / "fp8" (8-bit values with a float32
    # scale per token and kv head: pallas_kernels/attention/kv_quant.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        check_positive_ints(self, ("num_pages", "page_size", "max_num_seqs", "max_model_len", "prefill_chunk",
                                   "decode_steps", "ragged_tile"), least=dict(num_pages=2, max_model_len=2))
        for name in ("max_num_batched_tokens", "idle_batched_tokens"):
            if getattr(self, name) is not None:
                check_positive_ints(self, (name,))
        if not isinstance(self.enable_prefix_caching, bool):
            raise UserError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not (isinstance(self.host_blocks, int) and self.host_blocks >= 0):
            raise UserError(f"host_blocks must be an integer >= 0, got {self.host_blocks!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.host_blocks and not self.enable_prefix_caching:
            raise UserError("a host-memory KV tier keeps evicted prefix blocks: it needs prefix caching on")

    @property
    def kv_quant(self) -> str | None:
        """The 8-bit KV format, or None for the model's dtype."""
        return None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def token_budget(self) -> int:
        """The most tokens one iteration runs (decode tokens and prefill chunks)."""
        return self.max_num_batched_tokens or self.prefill_chunk + self.max_num_seqs

    @property
    def idle_budget(self) -> int:
        """The most tokens an iteration in which no request decodes runs (>= `token_budget`)."""
        return max(self.token_budget, self.idle_batched_tokens or 0)

    @property
    def step_sizes(self) -> tuple[int, ...]:
        """The token counts a ragged step is padded to (`step_sizes` of both budgets)."""
        return tuple(sorted(set(step_sizes(self.token_budget)) | set(step_sizes(self.idle_budget))))

    def scheduler_config(self, layout: PagedLayout, *, eos_token_ids=(), vocab_size: int | None = None,
                         num_speculative_tokens: int = 0, verify_steps: int = 1,
                         spec_auto_off: bool = False) -> "SchedulerConfig":
        """The scheduler's view of this configuration on `layout`, with the model's stop ids and vocabulary."""
        return SchedulerConfig(layout=layout, num_pages=self.num_pages, max_model_len=self.max_model_len,
                               max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.token_budget,
                               idle_batched_tokens=self.idle_budget,
                               decode_steps=self.decode_steps, eos_token_ids=tuple(eos_token_ids),
                               vocab_size=vocab_size, enable_prefix_caching=self.enable_prefix_caching,
                               num_speculative_tokens=num_speculative_tokens,
                               host_blocks=self.host_blocks, verify_steps=verify_steps,
                               spec_auto_off=spec_auto_off)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Sizes that fix the device programs' shapes, and the scheduling knobs (the scheduler's view).

    num_pages counts the whole pool, the reserved null page included (so num_pages - 1 are usable).
    max_num_batched_tokens bounds the tokens of one iteration: the prefill chunks, and (without
    speculation) the one token of each decoding request that runs beside them in the same ragged
    step; idle_batched_tokens (None: the same) those of an iteration in which no request decodes.
    An iteration with nothing to prefill runs the [max_num_seqs, decode_steps] decode loop instead (a
    speculative verify step runs apart and is not charged).
    """

    layout: PagedLayout
    num_pages: int
    max_model_len: int
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    idle_batched_tokens: int | None = None
    decode_steps: int = 8
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None
    enable_prefix_caching: bool = False
    # speculative decoding: a speculative decode iteration runs up to verify_steps verify steps in
    # one program call, each emitting up to num_speculative_tokens + 1 tokens per request; pages are
    # reserved for all of them, and each request's budget (plan.decode_budget) is capped by its own
    # tokens left. spec_auto_off: a plain iteration (decode_steps steps) instead where speculation
    # measured slower (dcp_jax.spec.policy)
    num_speculative_tokens: int = 0
    verify_steps: int = 1
    spec_auto_off: bool = False
    host_blocks: int = 0  # the host tier's capacity in blocks (dcp_jax.kv.host; 0: none)

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if not (isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 0):
            raise UserError(f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")
        check_positive_ints(self, ("num_pages", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                   "decode_steps", "verify_steps"), least=dict(num_pages=2))

    def tokens_per_decode(self, verify_steps: int = 0) -> int:
        """The most tokens one decode iteration of `verify_steps` verify steps (0: plain decoding)
        may give a request (pages are reserved for them)."""
        if verify_steps and self.num_speculative_tokens:
            return verify_steps * (self.num_speculative_tokens + 1)
        return self.decode_steps

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table columns: enough blocks for max_model_len tokens."""
        return self.layout.blocks_for(self.max_model_len)


def parse_bytes(text) -> int:
    """'512MiB', '2GB', '1.5GiB' or a plain number of bytes -> int (at least one byte)."""
    problem = f"memory size {text!r} is not a positive size: write e.g. 512MiB, 2GB or 1073741824"
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        if text < 1:
            raise UserError(problem)
        return int(text)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or not (math.isfinite(value) and value * units[unit] >= 1):
        raise UserError(problem)
    return int(value * units[unit])
