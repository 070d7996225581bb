"""The dense static-batch baseline: one padded batch, a `[B, K, S, D]` cache sharded along the sequence,
chunked prefill, then the whole decode as one donated while_loop (benchmarks and memory figures only;
`LLM` serves through `dcp_jax.serving`).

    prefill:  for each chunk of C tokens (ragged batch, padding masked):  cache <- write + attend   [jit]
    first:    sample the first token from each sequence's last prompt position                      [jit]
    decode:   while step < N and not all done: forward 1 token, sample, record                      [one jit]

The cache, the output buffers, lengths, done-flags and the RNG key are donated to the decode program,
so XLA aliases them to its outputs and updates the cache in place step after step.
"""

from __future__ import annotations

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
from dcp_jax import model as model_lib
from dcp_jax.errors import UserError
from dcp_jax.layout import KVLayout
from dcp_jax.mesh import host, kv_bytes
from dcp_jax.model import AttentionContext, CausalLM, init_cache
from dcp_jax.outputs import Generation
from dcp_jax.sampling import SamplingParams, check_seed, sample
from dcp_jax.serving.config import default_prefill_chunk


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
        prompts, prefill_chunk, max_seq_len = self._check_generate(
            prompts, max_new_tokens, max_seq_len, prefill_chunk, seed, stream_interval)
        cfg = self.model.config
        longest = max(map(len, prompts))
        cfg.check_context(max_seq_len, "--max-seq-len")
        layout = self.layout(max_seq_len)
        b, n = len(prompts), max_new_tokens
        lens, num_chunks, chunk_args = self._chunk_inputs(prompts, min(prefill_chunk, longest))
        stop = not ignore_eos and bool(self.eos)

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
        tokens, logprobs = self._decode_segments(decode, cache, tokens, logprobs, lens, done, key,
                                                 on_token, stream_interval)
        decode_s = time.perf_counter() - t1
        del cache

        out_tokens, out_lp = self._trim(tokens, logprobs, stop)
        decoded = sum(len(t) - 1 for t in out_tokens)
        stats = dict(
            tp=self.mesh.shape[mesh_lib.TP], dcp=self.mesh.shape[mesh_lib.DCP], interleave=layout.interleave,
            batch=b, max_seq_len=layout.max_seq_len, prompt_tokens=int(lens.sum()),
            generated_tokens=sum(map(len, out_tokens)), compile_s=compile_s, ttft_s=ttft, decode_s=decode_s,
            decode_tokens_per_s=decoded / decode_s if decode_s > 0 else 0.0, **kv,
        )
        return Generation(out_tokens, out_lp, stats)

    def _chunk_inputs(self, prompts: list[list[int]], chunk: int):
        """The prompts padded to whole chunks of `chunk` tokens: (lengths [B], the chunk count,
        `chunk_args(c, cache, last_logits)`, the prefill program's arguments for chunk c)."""
        b = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        padded = np.zeros((b, math.ceil(int(lens.max()) / chunk) * chunk), np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p

        def chunk_args(c, cache, last_logits):
            pos = np.arange(c * chunk, (c + 1) * chunk, dtype=np.int32)[None].repeat(b, 0)
            return (self.params, cache, last_logits, padded[:, c * chunk:(c + 1) * chunk], pos,
                    pos < lens[:, None], np.minimum(lens, (c + 1) * chunk), (lens - 1) % chunk,
                    (lens - 1) // chunk == c)

        return lens, padded.shape[1] // chunk, chunk_args

    def _check_generate(self, prompts, max_new_tokens, max_seq_len, prefill_chunk, seed,
                        stream_interval) -> tuple[list[list[int]], int, int]:
        """`generate`'s arguments checked (a UserError names the first bad one): the prompts as lists
        of ints, the prefill chunk and the sequence length, defaults filled in."""
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
        if (problem := check_seed(seed)) is not None:
            raise UserError(problem)
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
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds max_seq_len "
                f"{max_seq_len}; raise --max-seq-len or shorten the prompt")
        return prompts, prefill_chunk, max_seq_len

    def _decode_segments(self, decode, cache, tokens, logprobs, lens, done, key, on_token,
                         stream_interval):
        """Run the decode program from step 1 to the end: (tokens, logprobs) [B, n] on the host.

        Without streaming the whole decode is one call. Streaming runs the same program in segments
        of `stream_interval` steps and hands each segment's tokens to the host between them: no host
        callback inside the loop (those need a CPU device, absent under JAX_PLATFORMS=cuda), and the
        donated state goes from one segment to the next without a copy."""
        n = tokens.shape[1]
        interval = n if on_token is None else stream_interval
        step, emitted, lengths = 1, 1, lens
        while True:
            stop_step = min(step + interval, n)
            cache, tokens, logprobs, lengths, done, key, reached = decode(
                self.params, cache, tokens, logprobs, lengths, done, key, np.int32(step),
                np.int32(stop_step))
            step = int(host(reached))
            if on_token is not None:
                new = np.array(host(tokens)[:, emitted:step])  # a copy: the buffer is donated next
                for j in range(new.shape[1]):
                    on_token(emitted + j, new[:, j])
                emitted = step
            if step < stop_step or step >= n:  # every sequence done, or all steps run
                return host(tokens), host(logprobs)

    def _trim(self, tokens, logprobs, stop: bool) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's tokens and logprobs up to its first unset step (-1) or, when `stop`, through
        its first end-of-sequence token."""
        n = tokens.shape[1]
        out_tokens, out_lp = [], []
        for row, lp in zip(tokens, logprobs):
            keep = int(np.argmax(row < 0)) if (row < 0).any() else n
            if stop:
                hits = np.flatnonzero(np.isin(row[:keep], self.eos))
                keep = int(hits[0]) + 1 if hits.size else keep
            out_tokens.append(row[:keep].tolist())
            out_lp.append([float(x) for x in lp[:keep]])
        return out_tokens, out_lp
