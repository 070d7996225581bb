"""`DisaggregatedLLM`: a prefill instance and a decode instance in one process, each on its own devices.

>>> pair = DisaggregatedLLM.load(model_dir, prefill=dict(tp=1, dcp=2), decode=dict(tp=1, dcp=4))
>>> out = pair.generate(["Hello"], SamplingParams(max_tokens=16))
>>> out.tokens, out.stats["transfer_bytes"], out.stats["transfer_s"]

The KV moves through `jax.experimental.transfer` exactly as between two processes (each side has its
own TransferServer; the decode side connects to the prefill side's address), so this is the two-process
pair minus HTTP. Each side is an `LLM` with its one engine, paired once; `generate` prefills every
prompt the decode side has reserved a slot and pages for on the prefill side (one batch: all of them
when the pool holds them), pulls each one's KV, writes it into those pages and decodes with continuous
batching; the rest are prefilled as pages free up.
"""

from __future__ import annotations

import collections
import time

import jax

from dcp_jax import mesh as mesh_lib
from dcp_jax.disagg.roles import DecodeInstance, LocalPrefill, PrefillInstance
from dcp_jax.disagg.transfer import TransferError, TransferPort
from dcp_jax.errors import UserError
from dcp_jax.llm import LLM
from dcp_jax.outputs import Generation, generation, request_stats

SIDE_KEYS = ("tp", "dcp", "interleave", "page_size", "max_num_seqs", "kv_cache_memory", "decode_steps",
             "max_num_batched_tokens", "enable_prefix_caching", "impl", "scan_layers", "max_model_len",
             "prefill_chunk", "kv_cache_dtype", "lockstep")


def _side(name: str, kw: dict | None) -> dict:
    kw = dict(kw or {})
    bad = sorted(set(kw) - set(SIDE_KEYS))
    if bad:
        raise UserError(f"{name}= does not take {', '.join(bad)}; it takes {', '.join(SIDE_KEYS)}")
    return kw


class DisaggregatedLLM:
    """A prefill `LLM` and a decode `LLM` over disjoint devices, paired through their transfer servers."""

    def __init__(self, prefill: LLM, decode: LLM, *, timeout_s: float = 60.0):
        self.prefill_llm, self.decode_llm, self.timeout_s = prefill, decode, timeout_s
        shared = set(prefill.mesh.devices.flat) & set(decode.mesh.devices.flat)
        if shared:
            raise UserError(f"the prefill and decode meshes share {len(shared)} device(s): give each side its own")
        self.tokenizer = decode.tokenizer
        self.prefill_port = TransferPort(prefill.mesh.devices.flat[0], offer_timeout_s=timeout_s)
        self.decode_port = TransferPort(decode.mesh.devices.flat[0])
        self.prefill = PrefillInstance(prefill.engine, self.prefill_port)
        self.decode_instance = DecodeInstance(decode.engine, LocalPrefill(self.prefill), self.decode_port,
                                              timeout_s=timeout_s)
        self.decode_instance.warm()  # the decode programs and every write program, once

    @classmethod
    def load(cls, model_dir, *, prefill: dict | None = None, decode: dict | None = None, dtype: str = "auto",
             devices=None, timeout_s: float = 60.0, **both) -> "DisaggregatedLLM":
        """Load the model twice: on the first tp·dcp devices for the prefill side (`prefill` = LLM.load's
        tp, dcp, interleave, page_size, ...), and on the next ones for the decode side (`decode`);
        `both`: keywords for both sides (e.g. max_model_len, prefill_chunk)."""
        shared = _side("both sides'", both)
        p, d = {**shared, **_side("prefill", prefill)}, {**shared, **_side("decode", decode)}
        n_p, n_d = p.get("tp", 1) * p.get("dcp", 1), d.get("tp", 1) * d.get("dcp", 1)
        if devices is None:
            mesh_lib.ensure_cpu_devices(n_p + n_d)
            devices = jax.devices()
        devices = list(devices)
        if len(devices) < n_p + n_d:
            raise UserError(f"the pair needs {n_p} + {n_d} devices but {len(devices)} are given: shrink a side's "
                            f"mesh or simulate more CPU devices (dcp_jax.ensure_cpu_devices({n_p + n_d}))")
        return cls(LLM.load(model_dir, dtype=dtype, devices=devices[:n_p], **p),
                   LLM.load(model_dir, dtype=dtype, devices=devices[n_p:n_p + n_d], **d), timeout_s=timeout_s)

    def decode(self, ids) -> str | None:
        return self.decode_llm.decode(ids)

    def generate(self, prompts, sampling_params=None, **keywords) -> Generation:
        """As `LLM.generate` (a `SamplingParams`, one per prompt, or its keywords; not
        prompt_logprobs, whose prompt scores stay on the prefill side); `stats` adds transfer_bytes
        (what the transfers delivered), transfer_s (time in the pulls), stage_s (gathering the KV
        pieces on the prefill side), write_s (writing the KV into the decode pool),
        max_device_bytes (the most KV bytes one decode device held for one request's handoff) and
        both sides' meshes; ttft_s counts until a request's KV is in the decode pool (its first
        token is then emitted)."""
        requests = self.decode_llm.requests(prompts, sampling_params, **keywords)
        if any(r.sampling.prompt_logprobs is not None for r in requests):
            raise UserError("prompt_logprobs is not supported by a disaggregated pair: score "
                            "prompts on one LLM", field="prompt_logprobs")
        pre, dec = self.prefill, self.decode_instance
        eng, sched = dec.engine, dec.engine.scheduler
        tc = time.perf_counter()
        pre.engine.runner.compile_all(decode=False)
        eng.runner.step_program()
        eng.runner.allocate()
        compile_s = time.perf_counter() - tc

        stats0, timing0, stage0 = dict(dec.stats), dict(eng.timing), pre.stats["stage_s"]
        t0 = time.perf_counter()
        for r in requests:
            r.arrival_time = time.monotonic()
        waiting, backlog, first, landed, prefill_s = collections.deque(requests), collections.deque(), {}, [], 0.0
        while waiting or backlog or sched.has_unfinished():
            batch = dec.reserve_ready(waiting)  # what the pool has pages for now: one prefill batch
            if batch:
                tf = time.perf_counter()
                for r, got in zip(batch, dec.fetch_many(batch)):
                    if isinstance(got, TransferError):
                        sched.fail(r, str(got), retryable=True)  # its reservation back
                    else:
                        backlog.append((r, got))
                        landed.append(got)
                prefill_s += time.perf_counter() - tf
            for r in dec.admit_ready(backlog):
                first[r.request_id] = time.perf_counter() - t0
            if sched.has_unfinished():
                eng.step()
            elif waiting and not batch:
                raise RuntimeError("a request fits no empty pool")  # validate() refuses those first
            sched.pop_finished()
        wall = time.perf_counter() - t0
        stats = {k: dec.stats[k] - stats0[k] for k in ("transfer_bytes", "transfer_s", "write_s", "transfers")}
        timing = {k: eng.timing[k] - timing0[k] for k in timing0}
        stats["stage_s"] = pre.stats["stage_s"] - stage0  # gathering the pieces on the prefill side
        # the most KV one decode device held for one request's handoff (pulled pieces and their copies)
        stats["max_device_bytes"] = max((max(g.device_bytes.values(), default=0) for g in landed), default=0)
        p_mesh, d_mesh = pre.engine.runner.mesh, eng.runner.mesh
        stats.update(
            prefill=dict(tp=p_mesh.shape[mesh_lib.TP], dcp=p_mesh.shape[mesh_lib.DCP],
                         interleave=pre.engine.layout.interleave, page_size=pre.engine.layout.page_size),
            decode=dict(tp=d_mesh.shape[mesh_lib.TP], dcp=d_mesh.shape[mesh_lib.DCP],
                        interleave=eng.layout.interleave, page_size=eng.layout.page_size),
            max_seq_len=eng.config.max_model_len, compile_s=compile_s, wall_s=wall,
            **request_stats(requests, first, timing), **eng.kv_bytes())
        stats["prefill_s"] = prefill_s  # the prefill side's batches, with the pulls (not the decode side's)
        return generation(requests, stats, None if self.tokenizer is None else self.decode)
