"""Generation: chunked prefill into the sharded cache, then the whole decode as one donated while_loop.

    prefill:  for each chunk of C tokens (ragged batch, padding masked):  cache <- write + attend   [jit]
    first:    sample the first token from each sequence's last prompt position                      [jit]
    decode:   while step < N and not all done: forward 1 token, sample, record                      [one jit]

The cache, the output buffers, lengths, done-flags and the RNG key are donated to the decode program,
so XLA aliases them to its outputs and updates the cache in place step after step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.errors import UserError
from dcp_jax.layout import KVLayout, PagedLayout
from dcp_jax import model as model_lib
from dcp_jax.model import AttentionContext, CausalLM, init_cache


# Prompt tokens per prefill chunk when none is given. CPU: measured (scripts/bench_decode.py). GPU: the
# query-tiled kernel keeps shared memory independent of the chunk, so larger chunks only amortise the
# weight reads; 2048 is not yet measured: scripts/gpu_check.sh sweeps 512-4096 and prints the fastest.
DEFAULT_PREFILL_CHUNK = {"cpu": 256, "gpu": 2048}
DEFAULT_PAGE_SIZE = 64  # slots per page; a block-table entry covers page_size · dcp tokens
MAX_SERVERS = 8  # pool configurations (compiled programs) an LLM keeps across generate calls


def default_prefill_chunk(platform: str) -> int:
    return DEFAULT_PREFILL_CHUNK.get(platform, DEFAULT_PREFILL_CHUNK["cpu"])


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise UserError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")


def filter_logits(x, top_k, top_p):
    """x [R, V] (logits already divided by the temperature) with every entry outside each row's top-k
    (top_k [R] int, 0 = off) and outside its top-p nucleus (top_p [R], 1 = off: the smallest set of the
    most likely tokens whose mass reaches top_p) set to -inf. The one top-k/top-p rule of both engines."""
    v = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)  # one sort: masking below the k-th value keeps the order
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
    x = jnp.where((top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
    desc = jnp.where((top_k[:, None] > 0) & (desc < kth), -jnp.inf, desc)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    cutoff = jnp.min(jnp.where(before < top_p[:, None], desc, jnp.inf), axis=-1)
    return jnp.where(x < cutoff[:, None], -jnp.inf, x)


def sample(logits, key, params: SamplingParams):
    """logits [B, V] float32 -> (tokens [B] int32, log-probability of each token under the model [B])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    if params.temperature == 0:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        b = logits.shape[0]
        x = filter_logits(logits / params.temperature, jnp.full((b,), params.top_k, jnp.int32),
                          jnp.full((b,), params.top_p, jnp.float32))
        tokens = jax.random.categorical(key, x, axis=-1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


@dataclasses.dataclass
class Generation:
    """Result of `LLM.generate` / `Engine.generate`: plain Python values."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stats: dict
    text: list[str] | None = None
    finish_reasons: list[str] | None = None
    errors: list[str | None] | None = None


def _per_instance(method):
    """Memoise a method by its arguments in the instance itself (functools.lru_cache on a method would
    keep every engine alive in a class-level cache)."""

    @functools.wraps(method)
    def cached(self, *args):
        memo = self.__dict__.setdefault("_memo", {})
        key = (method.__name__, *args)
        if key not in memo:
            memo[key] = method(self, *args)
        return memo[key]

    return cached


class Engine:
    """The dense static-batch engine: one padded batch, a `[B, K, S, D]` cache sharded along the sequence,
    chunked prefill and one donated decode loop. `LLM` serves through `dcp_jax.serving`; this engine is the
    static baseline of scripts/bench_serving.py and what the memory and communication benchmarks compile."""

    def __init__(self, model: CausalLM, mesh: Mesh, *, interleave: int | str = 1, impl: str | None = None,
                 combine: str = "auto"):
        self.model, self.mesh, self.interleave, self.impl, self.combine = model, mesh, interleave, impl, combine
        self.graphdef, self.params = nnx.split(model)
        self.dtype = model.embed_tokens.get_value().dtype
        self.eos = tuple(model.config.eos_token_ids)
        self._executables = {}

    def compile(self, fn, *args):
        """AOT-compile the jitted `fn` for these argument shapes once (so timings exclude compilation)."""
        key = (fn, jax.tree.structure(args),
               tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(args)))
        if key not in self._executables:
            self._executables[key] = fn.lower(*args).compile()
        return self._executables[key]

    # --- compiled programs, cached by their static configuration -----------------------------------
    def layout(self, max_seq_len: int) -> KVLayout:
        return KVLayout.create(max_seq_len, mesh_lib.axis_size(self.mesh, self.model.context_axes), self.interleave)

    @_per_instance
    def prefill_fn(self, layout: KVLayout):
        """The jitted prefill chunk (params, cache, last_logits, tokens, positions, valid, kv_len, last_idx,
        take) -> (cache, last_logits); one token through it is the decode step's program."""
        ctx = AttentionContext(self.mesh, layout, self.impl, self.combine)

        def chunk(params, cache, last_logits, tokens, positions, valid, kv_len, last_idx, take):
            model = nnx.merge(self.graphdef, params)
            logits, cache = model(tokens, positions, valid, kv_len, cache, ctx, logits_at=last_idx)
            return cache, jnp.where(take[:, None], logits, last_logits)

        replicated = mesh_lib.named(self.mesh, mesh_lib.spec())
        cache_out = model_lib.cache_sharding(self.model, self.mesh)
        return jax.jit(chunk, donate_argnames=("cache", "last_logits"),
                       out_shardings=(cache_out, replicated))

    @_per_instance
    def _keys_fn(self):
        replicated = mesh_lib.named(self.mesh, mesh_lib.spec())
        return jax.jit(lambda seed: jax.random.split(jax.random.key(seed)), out_shardings=replicated)

    @_per_instance
    def _first_fn(self, sampling: SamplingParams):
        replicated = mesh_lib.named(self.mesh, mesh_lib.spec())
        return jax.jit(lambda logits, key: sample(logits, key, sampling), out_shardings=(replicated, replicated))

    @_per_instance
    def _decode_fn(self, layout: KVLayout, sampling: SamplingParams, stop_on_eos: bool):
        ctx = AttentionContext(self.mesh, layout, self.impl, self.combine)
        eos = jnp.asarray(self.eos if stop_on_eos and self.eos else (-1,), jnp.int32)

        def decode(params, cache, tokens, logprobs, lengths, done, key, step, stop_step):
            """tokens/logprobs [B, N] hold the first token in column 0; lengths [B] tokens in cache.
            Runs steps [step, stop_step) (fewer when every sequence is done) and returns the state to
            resume from, so a streaming caller can run the loop in segments with nothing re-allocated."""
            model = nnx.merge(self.graphdef, params)

            def cond(s):
                step, _, _, _, _, done, _ = s
                return (step < stop_step) & ~jnp.all(done)

            def body(s):
                step, cache, tokens, logprobs, lengths, done, key = s
                cur = jax.lax.dynamic_index_in_dim(tokens, step - 1, axis=1)  # [B, 1]
                live = ~done
                logits, cache = model(cur, lengths[:, None], live[:, None], lengths + live, cache, ctx)
                key, sub = jax.random.split(key)
                tok, lp = sample(logits[:, 0], sub, sampling)
                tok = jnp.where(live, tok, -1)
                tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, step, axis=1)
                logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, lp, step, axis=1)
                lengths = lengths + live
                done = done | jnp.isin(tok, eos)
                return step + 1, cache, tokens, logprobs, lengths, done, key

            state = (step, cache, tokens, logprobs, lengths, done, key)
            step, cache, tokens, logprobs, lengths, done, key = jax.lax.while_loop(cond, body, state)
            return cache, tokens, logprobs, lengths, done, key, step

        replicated = mesh_lib.named(self.mesh, mesh_lib.spec())
        cache_out = model_lib.cache_sharding(self.model, self.mesh)
        return jax.jit(decode, donate_argnames=("cache", "tokens", "logprobs", "lengths", "done", "key"),
                       out_shardings=(cache_out, *(replicated,) * 6))

    def abstract_state(self, batch: int, layout: KVLayout):
        """Abstract cache (with its sharding) and last-logits buffer: nothing allocated."""
        sharding = model_lib.cache_sharding(self.model, self.mesh)
        cache = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
            jax.eval_shape(lambda: init_cache(self.model, batch, layout, self.mesh, self.dtype)))
        replicated = mesh_lib.named(self.mesh, mesh_lib.spec())
        logits = jax.ShapeDtypeStruct((batch, self.model.config.vocab_size), jnp.float32, sharding=replicated)
        return cache, logits

    def _key_spec(self):
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=mesh_lib.named(self.mesh, mesh_lib.spec()))

    def decode_program(self, batch: int, layout: KVLayout, max_new_tokens: int,
                       sampling: SamplingParams = SamplingParams(), stop_on_eos: bool = True):
        """The compiled decode loop for these sizes (XLA's memory and HLO figures hang off it).

        Arguments: (params, cache, tokens [B, N] int32, logprobs [B, N] f32, lengths [B] int32,
        done [B] bool, key, step int32, stop_step int32) -> (cache, tokens, logprobs, lengths, done, key,
        step): runs steps [step, stop_step) and returns the state to resume from.
        """
        cache, _ = self.abstract_state(batch, layout)
        b, n = batch, max_new_tokens
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        return self.compile(
            self._decode_fn(layout, sampling, stop_on_eos), self.params, cache,
            jax.ShapeDtypeStruct((b, n), jnp.int32), jax.ShapeDtypeStruct((b, n), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.bool_),
            self._key_spec(), scalar, scalar)

    # --- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 32,
        max_seq_len: int | None = None,
        prefill_chunk: int | None = None,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
        ignore_eos: bool = False,
        on_chunk=None,
        on_token=None,
        stream_interval: int = 8,
    ) -> Generation:
        """Generate for a ragged batch of token-id prompts.

        `on_chunk(done, total)` reports prefill progress; `on_token(step, tokens [B])` receives each
        step's new tokens (-1 for finished sequences), every `stream_interval` decode steps.
        """
        prompts = [list(map(int, p)) for p in prompts]
        cfg = self.model.config
        if not prompts:
            raise UserError("no prompt given")
        if any(len(p) == 0 for p in prompts):
            raise UserError("empty prompt: every sequence needs at least one token")
        bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not (isinstance(seed, int) and 0 <= seed < 2**32):
            raise UserError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        if not (isinstance(stream_interval, int) and stream_interval >= 1):
            raise UserError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(self.mesh.devices.flat[0].platform)
        if not (isinstance(prefill_chunk, int) and prefill_chunk >= 1):
            raise UserError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        longest = max(map(len, prompts))
        max_seq_len = max_seq_len or longest + max_new_tokens
        if longest + max_new_tokens > max_seq_len:
            raise UserError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds max_seq_len {max_seq_len}; "
                "raise --max-seq-len or shorten the prompt")
        if cfg.sliding_window and max_seq_len > cfg.sliding_window:
            raise UserError(
                f"the model uses a {cfg.sliding_window}-token sliding window, which dcp_jax does not "
                f"implement; keep --max-seq-len <= {cfg.sliding_window}")
        layout = self.layout(max_seq_len)
        b, n = len(prompts), max_new_tokens
        chunk = min(prefill_chunk, longest)

        lens = np.array([len(p) for p in prompts], np.int32)
        padded = np.zeros((b, math.ceil(longest / chunk) * chunk), np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        num_chunks = padded.shape[1] // chunk
        stop = not ignore_eos and bool(self.eos)

        def chunk_args(c, cache, last_logits):
            pos = np.arange(c * chunk, (c + 1) * chunk, dtype=np.int32)[None].repeat(b, 0)
            return (self.params, cache, last_logits, padded[:, c * chunk:(c + 1) * chunk], pos,
                    pos < lens[:, None], np.minimum(lens, (c + 1) * chunk), (lens - 1) % chunk,
                    (lens - 1) // chunk == c)

        # Compile first (abstract arguments: nothing is allocated), so the timings below are runs only.
        tc = time.perf_counter()
        cache_spec, logits_spec = self.abstract_state(b, layout)
        prefill = self.compile(self.prefill_fn(layout), *chunk_args(0, cache_spec, logits_spec))
        first_fn = self.compile(self._first_fn(sampling), logits_spec, self._key_spec())
        decode = self.decode_program(b, layout, n, sampling, stop)
        # the RNG key lives replicated on the mesh (every process of a multi-process run holds it)
        make_keys = self.compile(self._keys_fn(), np.uint32(seed))
        compile_s = time.perf_counter() - tc
        replicated = logits_spec.sharding
        tokens = np.full((b, n), -1, np.int32)
        logprobs = np.zeros((b, n), np.float32)

        t0 = time.perf_counter()
        cache = init_cache(self.model, b, layout, self.mesh, self.dtype)
        last_logits = jax.device_put(np.zeros((b, cfg.vocab_size), np.float32), replicated)
        for c in range(num_chunks):
            cache, last_logits = prefill(*chunk_args(c, cache, last_logits))
            if on_chunk:
                on_chunk(c + 1, num_chunks)
        key, sub = make_keys(np.uint32(seed))
        first, first_lp = first_fn(last_logits, sub)
        first = host(first)
        ttft = time.perf_counter() - t0

        tokens[:, 0] = first
        logprobs[:, 0] = host(first_lp)
        if on_token is not None:
            on_token(0, first)
        done = np.isin(first, self.eos) if stop else np.zeros(b, bool)
        kv = kv_bytes(cache, self.model.kv_replication)
        t1 = time.perf_counter()
        # Without streaming the whole decode is one call. Streaming runs the same program in segments
        # of `stream_interval` steps and hands each segment's tokens to the host between them: no host
        # callback inside the loop (those need a CPU device, absent under JAX_PLATFORMS=cuda), and the
        # donated state goes from one segment to the next without a copy.
        interval = n if on_token is None else stream_interval
        step, emitted, lengths = 1, 1, lens
        while True:
            stop_step = min(step + interval, n)
            cache, tokens, logprobs, lengths, done, key, reached = decode(
                self.params, cache, tokens, logprobs, lengths, done, key, np.int32(step), np.int32(stop_step))
            step = int(host(reached))
            if on_token is not None:
                new = np.array(host(tokens)[:, emitted:step])  # a copy: the buffer is donated next
                for j in range(new.shape[1]):
                    on_token(emitted + j, new[:, j])
                emitted = step
            if step < stop_step or step >= n:  # every sequence done, or all steps run
                break
        tokens, logprobs = host(tokens), host(logprobs)
        decode_s = time.perf_counter() - t1
        del cache

        out_tokens, out_lp = [], []
        for row, lp in zip(tokens, logprobs):
            keep = int(np.argmax(row < 0)) if (row < 0).any() else n
            if stop:
                hits = np.flatnonzero(np.isin(row[:keep], self.eos))
                keep = int(hits[0]) + 1 if hits.size else keep
            out_tokens.append(row[:keep].tolist())
            out_lp.append([float(x) for x in lp[:keep]])
        decoded = sum(len(t) - 1 for t in out_tokens)
        stats = dict(
            tp=self.mesh.shape[mesh_lib.TP], dcp=self.mesh.shape[mesh_lib.DCP], interleave=layout.interleave,
            batch=b, max_seq_len=layout.max_seq_len, prompt_tokens=int(lens.sum()),
            generated_tokens=sum(map(len, out_tokens)), compile_s=compile_s, ttft_s=ttft, decode_s=decode_s,
            decode_tokens_per_s=decoded / decode_s if decode_s > 0 else 0.0, **kv,
        )
        return Generation(out_tokens, out_lp, stats)


def check_draft(model: CausalLM, draft: CausalLM) -> None:
    """Refuse a draft model whose tokens the target cannot read (another vocabulary)."""
    if draft.config.vocab_size != model.config.vocab_size:
        raise UserError(f"the draft model's vocabulary ({draft.config.vocab_size} ids) differs from the "
                        f"target's ({model.config.vocab_size}): give a draft model with the same tokenizer")


def host(x) -> np.ndarray:
    """A replicated result as NumPy; in a multi-process run each process reads its local copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def kv_bytes(cache, replication: int = 1) -> dict:
    """KV bytes one device really holds (its shards), and the whole cache's bytes counted once (KV heads
    replicated `replication` times over tp ranks are not counted again)."""
    per_device = {}
    stored = 0
    for arr in jax.tree.leaves(cache):
        stored += arr.nbytes
        for shard in arr.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return dict(kv_bytes_per_device=max(per_device.values()), kv_bytes_total=stored // replication,
                kv_replication=replication)


class LLM:
    """The notebook API: a model and its tokenizer on a mesh, served by continuous batching over a paged,
    sequence-sharded KV pool (`dcp_jax.serving`).

    >>> llm = LLM.load("path/to/hf_checkpoint_or_orbax_dir", tp=2, dcp=4)
    >>> out = llm.generate(["Hello"], max_new_tokens=16)
    >>> out.text, out.tokens, out.stats["kv_bytes_per_device"], out.stats["kv_capacity_tokens"]

    `page_size`: slots per page (one block-table entry covers page_size · dcp tokens); `max_num_seqs`:
    requests decoding at once; `kv_cache_memory`: KV bytes per device (int or "512MiB") that size the
    pool, or `gpu_memory_utilization`: that fraction of each GPU's memory less what is in use; with
    neither, the pool fits the requests of each `generate` call at once. `speculative`: a
    `dcp_jax.spec.SpeculativeConfig` (n-gram lookup or a draft model) or None.
    """

    def __init__(self, model: CausalLM, mesh: Mesh, tokenizer=None, *, interleave: int | str = 1,
                 impl: str | None = None, source: str = "in memory", page_size: int | None = None,
                 max_num_seqs: int = 8, kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float | None = None, decode_steps: int = 8,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 speculative=None):
        from dcp_jax.serving.engine import parse_bytes

        self.model, self.mesh, self.tokenizer, self.source = model, mesh, tokenizer, source
        self.impl, self.interleave = impl, interleave
        self.engine = Engine(model, mesh, interleave=interleave, impl=impl)  # the static-batch baseline
        for name, value in (("max_num_seqs", max_num_seqs), ("decode_steps", decode_steps),
                            ("max_num_batched_tokens", 1 if max_num_batched_tokens is None else max_num_batched_tokens)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise UserError(f"{name} must be an integer >= 1, got {value!r}")
        if page_size is None:  # the default, rounded up to whole runs of the interleave
            run = interleave if isinstance(interleave, int) else 1
            page_size = run * -(-DEFAULT_PAGE_SIZE // run)
        if not (isinstance(page_size, int) and not isinstance(page_size, bool) and page_size >= 1):
            raise UserError(f"page_size must be an integer >= 1, got {page_size!r}")
        if isinstance(interleave, int) and page_size % interleave:
            raise UserError(f"page_size {page_size} must be a multiple of the interleave size {interleave}")
        if kv_cache_memory is not None and gpu_memory_utilization is not None:
            raise UserError("give kv_cache_memory or gpu_memory_utilization, not both")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise UserError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.page_size, self.max_num_seqs, self.decode_steps = page_size, max_num_seqs, decode_steps
        self.max_num_batched_tokens = max_num_batched_tokens
        if not isinstance(enable_prefix_caching, bool):
            raise UserError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        # On by default: a prompt whose full blocks are cached (a shared document, a resent transcript,
        # a preempted request) prefills only its tail; the output is the same tokens either way.
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_cache_memory = None if kv_cache_memory is None else parse_bytes(kv_cache_memory)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.speculative = speculative
        if speculative is not None and speculative.draft is not None:
            check_draft(model, speculative.draft)
        self._servers = {}  # PoolConfig -> ServingEngine (its compiled programs)

    @classmethod
    def load(cls, model_dir, *, tp: int = 1, dcp: int = 1, interleave: int | str = 1, dtype: str = "float32",
             impl: str | None = None, devices=None, page_size: int | None = None, max_num_seqs: int = 8,
             kv_cache_memory: int | str | None = None, gpu_memory_utilization: float | None = None,
             decode_steps: int = 8, max_num_batched_tokens: int | None = None,
             scan_layers: bool = True, enable_prefix_caching: bool = True, speculative: str | None = None,
             num_speculative_tokens: int = 4, draft_model=None) -> "LLM":
        """`speculative`: None, "ngram" (prompt lookup) or "draft" (with `draft_model`, a checkpoint
        directory with the same vocabulary, loaded on the same mesh); `num_speculative_tokens` drafts
        per verify step."""
        from dcp_jax.spec import SpeculativeConfig
        from dcp_jax.weights import load_any

        if interleave != "contiguous" and not (isinstance(interleave, int) and interleave >= 1):
            raise UserError(f"interleave must be an integer >= 1 or 'contiguous', got {interleave!r}")
        if speculative is None and draft_model is not None:
            raise UserError("draft_model is given but speculative is not 'draft': pass speculative='draft'")
        if speculative is not None:  # refuse a bad configuration before loading anything
            SpeculativeConfig(speculative, num_speculative_tokens, draft=draft_model)
        mesh = mesh_lib.make_mesh(tp, dcp, devices)
        model, tokenizer, source = load_any(model_dir, mesh, dtype, scan_layers=scan_layers)
        spec = None
        if speculative is not None:
            draft = None if draft_model is None else load_any(draft_model, mesh, dtype, scan_layers=scan_layers)[0]
            spec = SpeculativeConfig(speculative, num_speculative_tokens, draft=draft)
        return cls(model, mesh, tokenizer, interleave=interleave, impl=impl, source=source, page_size=page_size,
                   max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory,
                   gpu_memory_utilization=gpu_memory_utilization, decode_steps=decode_steps,
                   max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                   speculative=spec)

    def save(self, path) -> int:
        """Save weights, config and tokenizer as an orbax checkpoint (atomically); returns the step."""
        from dcp_jax.weights import save_checkpoint

        return save_checkpoint(self.model, path, self.tokenizer)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UserError("this checkpoint has no tokenizer.json: give token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    # --- the serving engine behind generate ---------------------------------------------------------
    def reserve_tokens(self, tokens: int) -> None:
        """Size the pool to hold `tokens` tokens of one sequence (a KV budget per device), e.g. to report
        what a long context costs per device on this mesh."""
        pages = 1 + self.paged_layout().blocks_for(tokens)
        self.kv_cache_memory = pages * self.page_bytes()
        self.gpu_memory_utilization = None

    def page_bytes(self) -> int:
        """KV bytes one page costs each device: the target's and, with a draft model, the draft's."""
        from dcp_jax.serving.engine import draft_layout, page_bytes_per_device

        dtype = self.model.embed_tokens.get_value().dtype
        total = page_bytes_per_device(self.model, self.mesh, self.page_size, dtype)
        draft = None if self.speculative is None else self.speculative.draft
        if draft is not None:
            shards = mesh_lib.axis_size(self.mesh, draft.context_axes)
            total += page_bytes_per_device(draft, self.mesh, draft_layout(self.paged_layout(), shards).page_size, dtype)
        return total

    def num_pages(self, max_model_len: int, lengths: Sequence[int] = ()) -> int:
        """Pages per context rank: from the memory budget when one is given, else enough for `lengths`
        (peak tokens per request) at once, or max_num_seqs sequences of max_model_len."""
        from dcp_jax.serving.engine import gpu_budget

        if self.kv_cache_memory is not None or self.gpu_memory_utilization is not None:
            budget = (self.kv_cache_memory if self.kv_cache_memory is not None
                      else gpu_budget(self.mesh, self.gpu_memory_utilization))
            pages = int(budget // self.page_bytes())
            if pages < 2:
                raise UserError(f"a KV budget of {budget:,} bytes per device holds {max(pages, 0)} pages of "
                                f"{self.page_size} slots; give at least {2 * self.page_bytes():,} bytes (two pages of "
                                f"{self.page_bytes():,}: one is the reserved null page) or a smaller page size")
            return pages
        blocks = self.paged_layout().blocks_for
        most = self.max_num_seqs * blocks(max_model_len)
        return 1 + (min(most, sum(blocks(n) for n in lengths)) if lengths else most)

    def paged_layout(self) -> PagedLayout:
        """Where the pool puts tokens on this mesh ("contiguous" interleave: whole pages of consecutive
        tokens per rank)."""
        interleave = self.page_size if self.interleave == "contiguous" else self.interleave
        return PagedLayout(mesh_lib.axis_size(self.mesh, self.model.context_axes), interleave, self.page_size)

    def serving_engines(self) -> list:
        """The `ServingEngine`s `generate` has built (one per pool configuration), oldest first: their
        pools, programs and schedulers, for inspection."""
        return list(self._servers.values())

    def server(self, max_model_len: int, prefill_chunk: int, num_pages: int, max_num_seqs: int | None = None):
        """The `ServingEngine` for these sizes (kept: its programs compile once per configuration).
        `max_num_seqs` (default the LLM's) sets the decode program's slots."""
        from dcp_jax.serving.engine import PoolConfig, ServingEngine

        config = PoolConfig(num_pages=num_pages, page_size=self.page_size,
                            max_num_seqs=max_num_seqs or self.max_num_seqs,
                            max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                            decode_steps=self.decode_steps, max_num_batched_tokens=self.max_num_batched_tokens,
                            enable_prefix_caching=self.enable_prefix_caching)
        server = self._servers.pop(config, None) or ServingEngine(
            self.model, self.mesh, config, interleave=self.paged_layout().interleave, impl=self.impl,
            detokenize=None if self.tokenizer is None else self.decode, speculative=self.speculative)
        # One pool lives at a time: the others keep their compiled programs but give their pools back
        # (and with them their cached prefixes); at most MAX_SERVERS configurations are kept, newest last.
        for other in self._servers.values():
            other.release_pool()
        while len(self._servers) >= MAX_SERVERS:
            self._servers.pop(next(iter(self._servers)))
        self._servers[config] = server
        return server

    def generation_args(self, prompts, *, max_new_tokens: int, max_seq_len: int | None, prefill_chunk: int | None,
                        temperature: float, top_k: int, top_p: float, seed: int):
        """`generate`'s arguments checked and sized: (prompt ids per request, SamplingParams, the model
        context, the compiled prefill chunk, each request's peak tokens). UserError names a bad one."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        cfg = self.model.config
        if not ids:
            raise UserError("no prompt given")
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not (isinstance(seed, int) and 0 <= seed < 2**32):
            raise UserError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        sampling = SamplingParams(temperature, top_k, top_p)
        longest = max(map(len, ids))
        max_model_len = max_seq_len or longest + max_new_tokens
        if not (isinstance(max_model_len, int) and max_model_len >= 2):
            raise UserError(f"max_seq_len must be an integer >= 2, got {max_model_len!r}")
        if cfg.sliding_window and max_model_len > cfg.sliding_window:
            raise UserError(
                f"the model uses a {cfg.sliding_window}-token sliding window, which dcp_jax does not "
                f"implement; keep --max-seq-len <= {cfg.sliding_window}")
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(self.mesh.devices.flat[0].platform)
        if not (isinstance(prefill_chunk, int) and prefill_chunk >= 1):
            raise UserError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        # the compiled chunk: no longer than the longest prompt needs (a short prompt pads little)
        chunk = min(prefill_chunk, max(16, 1 << math.ceil(math.log2(max(longest, 1)))))
        peaks = [min(len(p) + max_new_tokens, max_model_len) for p in ids]
        return ids, sampling, max_model_len, chunk, peaks

    def generate(self, prompts, *, max_new_tokens: int = 32, max_seq_len: int | None = None,
                 prefill_chunk: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, ignore_eos: bool = False, on_chunk=None, on_token=None) -> Generation:
        """`prompts`: a string, a list of strings, a list of ids, or a list of id lists.

        Requests run through the scheduler: admitted while pages and slots are free, prefilled in
        chunks, decoded together, preempted and recomputed when pages run out. `max_seq_len` is the
        model context (default: longest prompt + max_new_tokens). Returns a `Generation` with `tokens`
        and `logprobs` (per request), `text` (None without a tokenizer), `finish_reasons`, `errors`
        (per request, None when it ran) and `stats`. A request that can never run fails alone; if every
        one fails, UserError. `on_chunk(done, total)` reports prefill tokens; `on_token(step, tokens [B])`
        receives new tokens as they come (-1 for requests with none at that step).
        """
        from dcp_jax.serving.engine import run_requests
        from dcp_jax.serving.request import Request

        ids, sampling, max_model_len, chunk, peaks = self.generation_args(
            prompts, max_new_tokens=max_new_tokens, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        # no more decode slots than requests: an idle slot still costs its rows in every decode step
        server = self.server(max_model_len, chunk, self.num_pages(max_model_len, peaks),
                             max_num_seqs=min(self.max_num_seqs, len(ids)))

        requests = [Request(f"r{i}", p, sampling=sampling, seed=seed, max_tokens=max_new_tokens,
                            ignore_eos=ignore_eos) for i, p in enumerate(ids)]
        tc = time.perf_counter()
        server.step_program()
        server.prefill_program(chunk)
        server.allocate()
        compile_s = time.perf_counter() - tc

        total = sum(len(p) for p in ids)
        progress = dict(done=0, step=0, emitted=[0] * len(ids))

        def on_prefill(n):
            progress["done"] += n
            if on_chunk is not None:
                on_chunk(min(progress["done"], total), total)

        def on_step(plan):
            if on_token is None:
                return
            new = [r.output_token_ids[e:] for r, e in zip(requests, progress["emitted"])]
            for j in range(max(map(len, new), default=0)):
                on_token(progress["step"], np.asarray([n[j] if j < len(n) else -1 for n in new], np.int32))
                progress["step"] += 1
            progress["emitted"] = [len(r.output_token_ids) for r in requests]

        timing0, sched0 = dict(server.timing), server.stats()
        result = run_requests(server, requests, on_step=on_step, on_prefill=on_prefill)
        timing = {k: server.timing[k] - timing0[k] for k in timing0}
        errors = [r.error for r in requests]
        if all(e is not None for e in errors):
            raise UserError(errors[0])
        first = result["first_token_s"]
        generated = sum(len(r.output_token_ids) for r in requests)
        # decode speed: the tokens the decode program made for requests, over its own time (prefill
        # chunks of other requests interleave with decoding; they are not counted against it)
        decode_s, decoded = timing["decode_s"], timing["decode_tokens"]
        layout = server.layout
        # the scheduler lives as long as the server (so does its prefix cache): this call's share
        q, h = (result[k] - sched0[k] for k in ("prefix_query_tokens", "prefix_hit_tokens"))
        prefix = dict(prefix_caching=self.enable_prefix_caching, prefix_query_tokens=q, prefix_hit_tokens=h,
                      prefix_hit_rate=h / q if q else 0.0, cached_blocks=result["cached_blocks"],
                      evictions=result["evictions"] - sched0["evictions"])
        if self.speculative is not None:  # this call's drafts, acceptances and verify steps
            d, a, n = (result[k] - sched0[k] for k in ("spec_drafted_tokens", "spec_accepted_tokens",
                                                        "spec_verify_steps"))
            prefix.update(speculative=self.speculative.method, num_speculative_tokens=self.speculative.num_tokens,
                          spec_drafted_tokens=d, spec_accepted_tokens=a, spec_verify_steps=n,
                          spec_acceptance_rate=a / d if d else 0.0, mean_acceptance_length=1 + a / n if n else 0.0)
        stats = dict(
            tp=self.mesh.shape[mesh_lib.TP], dcp=self.mesh.shape[mesh_lib.DCP], interleave=layout.interleave,
            page_size=layout.page_size, batch=len(ids), max_seq_len=max_model_len,
            max_num_seqs=server.config.max_num_seqs,
            prompt_tokens=total, generated_tokens=generated, compile_s=compile_s,
            ttft_s=max((v for v in first.values()), default=0.0), decode_s=decode_s,
            decode_tokens_per_s=decoded / decode_s if decode_s > 0 else 0.0, wall_s=result["wall_s"],
            prefill_s=timing["prefill_s"], decode_steps=timing["decode_steps"],
            kv_capacity_tokens=result["kv_capacity_tokens"], kv_pages=result["pages_total"],
            kv_shards=layout.num_shards,
            preemptions=result["preemptions"], compilations=len(server.compiled),
            requests=[dict(ttft_s=first.get(r.request_id), prompt_tokens=r.num_prompt_tokens,
                           generated_tokens=len(r.output_token_ids), finish_reason=r.finish_reason,
                           preemptions=r.num_preemptions) for r in requests],
            **prefix, **server.kv_bytes(),
        )
        out = Generation([list(r.output_token_ids) for r in requests], [list(r.output_logprobs) for r in requests],
                         stats, finish_reasons=[r.finish_reason for r in requests], errors=errors)
        out.text = None if self.tokenizer is None else [self.decode(r.output_token_ids) for r in requests]
        return out
