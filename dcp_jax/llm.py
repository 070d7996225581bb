"""`LLM`: the notebook API. One model on one mesh, served for the life of the object by ONE engine.

>>> llm = LLM.load("path/to/hf_checkpoint_or_orbax_dir", tp=2, dcp=4) >>> out =
llm.generate(["Hello"], SamplingParams(max_tokens=16)) >>> out.text, out.tokens,
out.stats["kv_bytes_per_device"], out.stats["kv_capacity_tokens"]

As vLLM's `LLM` and SGLang's `Engine`: the context length (`max_model_len`) and the KV pool are
fixed when the `LLM` is built, the programs compile once, and every `generate` call submits requests
to the same `ServingEngine` and waits for them. So the prefix cache and the compiled programs live
as long as the `LLM`: a second question about the same document reuses its cached blocks, whatever
its length.

The pool: `kv_cache_memory` (bytes per device) or `gpu_memory_utilization` (a fraction of each GPU's
memory, less what is in use) when given; else 0.9 of each GPU on a GPU, and on CPU at most
`CPU_KV_BUDGET` bytes for the whole pool (simulated devices share the host's memory) and no more
than `max_num_seqs` sequences of `max_model_len` need. `max_model_len` defaults to the checkpoint's
`max_position_embeddings` (and its sliding window), lowered to what the pool can hold with one
`note:` line on stderr.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.chat_template import ChatTemplate
from dcp_jax.errors import UserError
from dcp_jax.layout import PagedLayout
from dcp_jax.model import CausalLM
from dcp_jax.outputs import ChatGeneration, Generation, generation, request_stats
from dcp_jax.sampling_params import SamplingParams
from dcp_jax.serving.config import (DEFAULT_PAGE_SIZE, KV_CACHE_DTYPES, ServingConfig,
                                    default_idle_batched_tokens, default_prefill_chunk, parse_bytes)
from dcp_jax.serving.engine import ServingEngine, run_requests
from dcp_jax.serving.lockstep import Lockstep
from dcp_jax.serving.programs import draft_layout
from dcp_jax.serving.request import Request, make_requests
from dcp_jax.serving.runner import gpu_budget, page_bytes_per_device
from dcp_jax.spec.proposers import SpeculativeConfig, check_draft

CPU_KV_BUDGET = 256 * 2**20  # bytes of KV for the whole pool on CPU when no budget is given
# The engine's cumulative counters `generate` reports as the call's share (what they grew by). Each
# has one owner: the KV manager the prefix and host hits (a host hit is a prefix hit too) and the
# evictions, the scheduler preemptions, the host copier its bytes and seconds, the engine
# speculation's counts.
HOST_COUNTERS = ("host_hit_tokens", "host_bytes_to_host", "host_bytes_to_device", "host_copy_s")
CALL_COUNTERS = ("prefix_query_tokens", "prefix_hit_tokens", "evictions", "preemptions",
                 *HOST_COUNTERS, "spec_drafted_tokens", "spec_accepted_tokens", "spec_verify_steps",
                 "spec_on_iterations", "spec_off_iterations", "spec_prefill_plain_iterations",
                 "spec_switches")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


def join_runtime(coordinator, num_processes, process_id, mesh_devices: int, timeout_s: float) -> None:
    """Join jax.distributed unless this process already has (`mesh.init_distributed`)."""
    if None in (coordinator, num_processes, process_id):
        raise UserError("several processes need all of coordinator='host:port', num_processes and process_id")
    if not (isinstance(process_id, int) and 0 <= process_id < num_processes):
        raise UserError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
    mesh_lib.init_distributed(coordinator, num_processes, process_id, mesh_devices=mesh_devices,
                              timeout_s=int(timeout_s))


def _positive_int(name: str, value, least: int = 1) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        raise UserError(f"{name} must be an integer >= {least}, got {value!r}")


class LLM:
    """A model and its tokenizer on a mesh, served by continuous batching over one paged,
    sequence-sharded KV pool (`dcp_jax.serving`); see the module docstring for how it is sized.

    `page_size`: slots per page (one block-table entry covers page_size · dcp tokens);
    `max_num_seqs`: requests decoding at once; `prefill_chunk`: prompt tokens per prefill program
    call; `idle_batched_tokens`: the token budget of an iteration in which no request decodes
    (default 1024 on CPU unless `max_num_batched_tokens` or `prefill_chunk` is given; else the
    same budget); `speculative`: a `SpeculativeConfig` (n-gram lookup or a draft model) or None;
    `num_pages`: the pool's pages per context rank (the null page included), overriding the memory
    budget (as vLLM's `num_gpu_blocks_override`: for tests and benchmarks of a given pool).
    `lockstep` (several processes): "spmd", every process makes the same calls (this API); "serve",
    process 0 takes the requests and the others follow its steps (a server: `dcp_jax.launch`); or a
    `Lockstep` of one's own for this LLM's engine (e.g. over an in-process store, in tests).
    `chat_template`: the checkpoint's chat template (`ChatTemplate`), which the server renders.
    """

    def __init__(self, model: CausalLM, mesh: Mesh, tokenizer=None, *, interleave: int | str = 1,
                 impl: str | None = None, source: str = "in memory", page_size: int | None = None,
                 max_num_seqs: int = 8, max_model_len: int | None = None, prefill_chunk: int | None = None,
                 kv_cache_memory: int | str | None = None, gpu_memory_utilization: float | None = None,
                 decode_steps: int = 8, max_num_batched_tokens: int | None = None,
                 idle_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, speculative: SpeculativeConfig | None = None,
                 num_pages: int | None = None, kv_host_memory: int | str | None = None, kv_cache_dtype: str = "auto",
                 dist_timeout: float = mesh_lib.DIST_TIMEOUT_S, lockstep: str | Lockstep = "spmd",
                 chat_template: ChatTemplate | None = None):
        self.model, self.mesh, self.tokenizer, self.source = model, mesh, tokenizer, source
        self.chat_template = chat_template  # the checkpoint's, or None
        self.dist_timeout, self.engines_built = dist_timeout, 0
        if not isinstance(lockstep, Lockstep) and lockstep not in ("spmd", "serve"):
            raise UserError(f"lockstep must be 'spmd' or 'serve', got {lockstep!r}")
        self.lockstep = lockstep
        self.impl, self.interleave, self.speculative = impl, interleave, speculative
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("decode_steps", decode_steps)
        if max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if idle_batched_tokens is not None:
            _positive_int("idle_batched_tokens", idle_batched_tokens)
        if page_size is None:  # the default, rounded up to whole runs of the interleave
            run = interleave if isinstance(interleave, int) else 1
            page_size = run * -(-DEFAULT_PAGE_SIZE // run)
        _positive_int("page_size", page_size)
        if isinstance(interleave, int) and page_size % interleave:
            raise UserError(f"page_size {page_size} must be a multiple of the interleave size {interleave}")
        if kv_cache_memory is not None and gpu_memory_utilization is not None:
            raise UserError("give kv_cache_memory or gpu_memory_utilization, not both")
        if num_pages is not None and (kv_cache_memory is not None or gpu_memory_utilization is not None):
            raise UserError("give num_pages or a memory budget (kv_cache_memory, gpu_memory_utilization), not both")
        if num_pages is not None:
            _positive_int("num_pages", num_pages, least=2)
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise UserError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if not isinstance(enable_prefix_caching, bool):
            raise UserError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if speculative is not None and speculative.draft is not None:
            check_draft(model, speculative.draft)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if kv_cache_dtype != "auto" and model.config.indexer is not None:
            raise UserError(f"kv_cache_dtype {kv_cache_dtype!r}: DeepSeek-V3.2's sparse attention "
                            "reads no 8-bit KV cache yet; drop kv_cache_dtype (--kv-cache-dtype)")
        self.kv_cache_dtype = kv_cache_dtype
        self.page_size, self.max_num_seqs, self.decode_steps = page_size, max_num_seqs, decode_steps
        self.max_num_batched_tokens = max_num_batched_tokens
        # On by default: a prompt whose full blocks are cached (a shared document, a resent transcript,
        # a preempted request) prefills only its tail; the output is the same tokens either way.
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_cache_memory = None if kv_cache_memory is None else parse_bytes(kv_cache_memory)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.platform = mesh.devices.flat[0].platform
        if idle_batched_tokens is None and max_num_batched_tokens is None and prefill_chunk is None:
            # (a budget or chunk given by hand holds for every iteration unless the idle one is
            # given too)
            idle_batched_tokens = default_idle_batched_tokens(self.platform)
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(self.platform)
        _positive_int("prefill_chunk", prefill_chunk)
        max_model_len, num_pages = self.size_pool(max_model_len, num_pages)
        self.kv_host_memory = None if kv_host_memory is None else parse_bytes(kv_host_memory)
        host_blocks = self.host_blocks()
        # the compiled chunk: no longer than a whole context needs (a short context pads little)
        whole = max(16, 1 << (max_model_len - 1).bit_length())
        chunk = min(prefill_chunk, whole)
        idle = None if idle_batched_tokens is None else min(idle_batched_tokens, whole)
        self.config = ServingConfig(num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, prefill_chunk=chunk, decode_steps=decode_steps,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    idle_batched_tokens=idle,
                                    enable_prefix_caching=enable_prefix_caching, host_blocks=host_blocks,
                                    kv_cache_dtype=kv_cache_dtype)
        self.engine = self.build_engine(self.config)

    @classmethod
    def load(cls, model_dir, *, tp: int = 1, dcp: int = 1, interleave: int | str = 1, dtype: str = "auto",
             impl: str | None = None, devices=None, scan_layers: bool = True, speculative: str | None = None,
             num_speculative_tokens: int = 4, draft_model=None, speculative_auto_off: bool = True,
             coordinator: str | None = None,
             num_processes: int | None = None, process_id: int | None = None, compile: str | None = None,
             compilation_cache=None, chat_template=None, **engine_kw) -> "LLM":
        """Load a checkpoint onto a (tp, dcp) mesh: a Hugging Face directory, an orbax checkpoint or
        a GGUF file (`dcp_jax.gguf_checkpoint`). `engine_kw`: the
        constructor's (max_model_len, kv_cache_memory, page_size, max_num_seqs, prefill_chunk,
        dist_timeout, ...). `speculative`: None, "ngram" (prompt lookup) or "draft" (with
        `draft_model`, a checkpoint directory with the same vocabulary, loaded on the same mesh);
        `num_speculative_tokens` drafts per verify step; `speculative_auto_off` False: speculate
        in every decode iteration, even where it measures slower than plain decoding
        (`dcp_jax.spec.policy`). `coordinator` ("host:port"),
        `num_processes`, `process_id`: join `jax.distributed` first (every process makes the same
        calls, as `python -m dcp_jax.generate --coordinator ...`; docs/MULTIHOST.md). `compile`:
        "all" (the default; `$DCP_JAX_COMPILE` changes it) compiles every program a request may run
        before returning (`compile()`), so no request waits for a compile; "lazy" compiles the
        decode program and the first step's size at the first `generate`, and each other step size
        when a step first needs it (a one-shot run's choice). `compilation_cache`: the directory of
        JAX's persistent compilation cache, or "off"; default `$DCP_JAX_CACHE_DIR`, else a cache
        configured in JAX, else ~/.cache/dcp_jax/xla (dcp_jax.compilation): a second process loads
        the programs the first compiled. `chat_template`: a Jinja template file served instead of
        the checkpoint's (vLLM's --chat-template)."""
        from dcp_jax import compilation
        from dcp_jax.weights import load_any, resolve_dtype, template_file

        compile = compilation.check_mode(compile or compilation.default_mode())
        compilation.configure(compilation_cache)  # before this process compiles what it should keep

        if coordinator is not None or (num_processes or 1) > 1:
            join_runtime(coordinator, num_processes, process_id, tp * dcp,
                         engine_kw.get("dist_timeout", mesh_lib.DIST_TIMEOUT_S))

        if interleave != "contiguous" and not (isinstance(interleave, int) and interleave >= 1):
            raise UserError(f"interleave must be an integer >= 1 or 'contiguous', got {interleave!r}")
        if speculative is None and draft_model is not None:
            raise UserError("draft_model is given but speculative is not 'draft': pass speculative='draft'")
        if speculative is not None:  # refuse a bad configuration before loading anything
            SpeculativeConfig(speculative, num_speculative_tokens, draft=draft_model,
                              auto_off=speculative_auto_off)
        mesh = mesh_lib.make_mesh(tp, dcp, devices)
        dtype = resolve_dtype(dtype, mesh)  # "auto": bfloat16 on GPUs, float32 elsewhere
        loaded = load_any(model_dir, mesh, dtype, scan_layers=scan_layers)
        template = loaded.chat_template
        if chat_template is not None:
            template = template_file(chat_template, template, model_dir)
        spec = None
        if speculative is not None:
            draft = None if draft_model is None else load_any(draft_model, mesh, dtype,
                                                             scan_layers=scan_layers).model
            spec = SpeculativeConfig(speculative, num_speculative_tokens, draft=draft,
                                     auto_off=speculative_auto_off)
        llm = cls(loaded.model, mesh, loaded.tokenizer, interleave=interleave, impl=impl,
                  source=loaded.source, speculative=spec, chat_template=template,
                  **engine_kw)
        if compile == "all":
            llm.compile()
        return llm

    # --- sizes ---------------------------------------------------------------------------------------
    def paged_layout(self, page_size: int | None = None) -> PagedLayout:
        """Where the pool puts tokens on this mesh, in pages of `page_size` slots (default this
        LLM's; "contiguous" interleave: whole pages of consecutive tokens per rank)."""
        page_size = page_size or self.page_size
        interleave = page_size if self.interleave == "contiguous" else self.interleave
        return PagedLayout(mesh_lib.axis_size(self.mesh, self.model.context_axes), interleave, page_size)

    def page_bytes(self) -> int:
        """KV bytes one page costs each device: the target's and, with a draft model, the
        draft's."""
        dtype = self.model.embed_tokens.get_value().dtype
        total = page_bytes_per_device(self.model, self.mesh, self.page_size, dtype,
                                      None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype)
        draft = None if self.speculative is None else self.speculative.draft
        if draft is not None:
            shards = mesh_lib.axis_size(self.mesh, draft.context_axes)
            total += page_bytes_per_device(draft, self.mesh, draft_layout(self.paged_layout(), shards).page_size, dtype)
        return total

    def host_blocks(self) -> int:
        """Blocks `kv_host_memory` holds: each is this process's devices' shares of one page of
        every pool array (their shards, so 1/dcp of the block's KV per context rank)."""
        if self.kv_host_memory is None:
            return 0
        if not self.enable_prefix_caching:
            raise UserError("kv_host_memory keeps evicted prefix blocks in host memory: it needs prefix caching "
                            "on (drop --no-enable-prefix-caching)")
        local = len(self.mesh.local_devices)
        block = self.page_bytes() * local
        if self.kv_host_memory < block:
            raise UserError(f"kv_host_memory {self.kv_host_memory:,} bytes holds no block: one block takes "
                            f"{block:,} bytes of this process's host memory; give at least that")
        return self.kv_host_memory // block

    def size_pool(self, max_model_len: int | None, num_pages: int | None = None) -> tuple[int, int]:
        """(max_model_len, pages per context rank) for this LLM; see the module docstring."""
        cfg, layout, page = self.model.config, self.paged_layout(), self.page_bytes()
        explicit = max_model_len is not None
        if explicit:
            _positive_int("max_model_len", max_model_len, least=2)
            cfg.check_context(max_model_len)
            if max_model_len > cfg.max_position_embeddings:
                print(f"note: max_model_len {max_model_len:,} is past the checkpoint's max_position_embeddings "
                      f"({cfg.max_position_embeddings:,}): the model was not trained on positions that far",
                      file=sys.stderr)
        else:
            max_model_len = min(x for x in (cfg.max_position_embeddings, cfg.sliding_window) if x)
        if num_pages is not None:
            budget, where = num_pages * page, "num_pages"
        elif self.kv_cache_memory is not None:
            budget, where = self.kv_cache_memory, "kv_cache_memory"
        elif self.gpu_memory_utilization is not None or self.platform == "gpu":
            fraction = self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
            budget, where = gpu_budget(self.mesh, fraction), f"gpu_memory_utilization {fraction}"
        else:
            budget, where = CPU_KV_BUDGET // self.mesh.devices.size, "the CPU default budget"
        pages = int(budget // page)
        if where == "the CPU default budget":
            # on CPU by default, also no more pages than max_num_seqs whole contexts need
            pages = min(pages, 1 + self.max_num_seqs * layout.blocks_for(max_model_len))
        if pages < 2:
            raise UserError(f"a KV budget of {budget:,} bytes per device holds {max(pages, 0)} pages of "
                            f"{self.page_size} slots; give at least {2 * page:,} bytes (two pages of {page:,}: one "
                            "is the reserved null page) or a smaller page size")
        fits = layout.capacity_tokens(pages - 1) + 1  # the last sampled token is never written
        if max_model_len > fits:
            if explicit:
                raise UserError(f"max_model_len {max_model_len:,} does not fit the KV pool ({pages - 1:,} pages "
                                f"of {layout.tokens_per_block} tokens from {where}): lower max_model_len to at "
                                f"most {fits:,} or give more KV memory (kv_cache_memory / --kv-cache-memory)")
            print(f"note: max_model_len lowered from the checkpoint's {max_model_len:,} to {fits:,} tokens, what "
                  f"the KV pool ({where}) holds; give max_model_len or more KV memory to change it",
                  file=sys.stderr)
            max_model_len = fits
        return max_model_len, pages

    def build_engine(self, config: ServingConfig, speculative: SpeculativeConfig | None = None,
                     lockstep: Lockstep | None = None) -> ServingEngine:
        """A `ServingEngine` for this model and mesh with `config`'s sizes. The LLM's own is
        `self.engine`; another (e.g. a benchmark's pool of other sizes) has its own pool and
        programs. `lockstep`: the engine's side of a lockstep of one's own (default: this LLM's
        `lockstep`)."""
        self.engines_built += 1
        lockstep = lockstep or self.engine_lockstep()
        return ServingEngine(self.model, self.mesh, config, self.paged_layout(config.page_size),
                             impl=self.impl, detokenize=None if self.tokenizer is None else self.decode,
                             speculative=speculative or self.speculative, tokenizer=self.tokenizer,
                             lockstep=lockstep)

    def engine_lockstep(self) -> Lockstep | None:
        """The lockstep side of the engine being built: this LLM's own `Lockstep` for its first
        engine; on several processes, a server's (process 0 leads, the others follow its commands:
        `launch.follow`) for its first engine, else one in which every process makes the same calls
        and their plans are checked against process 0's."""
        first = self.engines_built == 1
        if isinstance(self.lockstep, Lockstep):
            return self.lockstep if first else None
        if jax.process_count() == 1:
            return None
        if self.lockstep == "serve" and first:
            return Lockstep.of_runtime(self.dist_timeout)
        return Lockstep.of_runtime(self.dist_timeout, spmd=True, name=f"llm{self.engines_built}")

    def engine_with(self, speculative: SpeculativeConfig | None = None, lockstep: Lockstep | None = None,
                    **sizes) -> ServingEngine:
        """A new `ServingEngine` whose `ServingConfig` is this LLM's with `sizes` replaced
        (num_pages, max_model_len, prefill_chunk, max_num_seqs, ...), for tests and benchmarks of
        other pools; `speculative` in place of this LLM's (e.g. with a proposer of one's own),
        `lockstep` its side of a lockstep of one's own."""
        import dataclasses

        if ({"prefill_chunk", "max_num_batched_tokens"} & set(sizes)
                and "idle_batched_tokens" not in sizes):
            sizes["idle_batched_tokens"] = None  # (a budget given by hand holds for every iteration)
        return self.build_engine(dataclasses.replace(self.config, **sizes), speculative, lockstep)

    # --- the API -------------------------------------------------------------------------------------
    def save(self, path) -> int:
        """Save weights, config, tokenizer and chat template as an orbax checkpoint (atomically);
        returns the step."""
        from dcp_jax.weights import save_checkpoint

        return save_checkpoint(self.model, path, self.tokenizer, self.chat_template)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UserError("this checkpoint has no tokenizer.json: give token ids instead of text")
        return self.tokenizer.encode(text).ids

    def chat_prompt(self, messages: list[dict], **variables) -> list[int]:
        """The prompt ids of a conversation (`messages`: [{"role", "content"}, ...]): the
        checkpoint's chat template with the generation prompt, tokenized (the template writes its
        own special tokens)."""
        if self.chat_template is None:
            raise UserError("this checkpoint has no chat template: give a prompt instead")
        text = self.chat_template.render(messages, **variables)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, tools=None,
             tool_choice=None, parallel_tool_calls: bool | None = None,
             tool_parser: str | None = None, reasoning_parser: str | None = None,
             **keywords) -> ChatGeneration:
        """Answer a conversation (OpenAI-shaped messages, with assistant `tool_calls` and `role:
        "tool"` results) or a list of them, as the server's chat endpoint does (the same
        `dcp_jax.agents` path): `tools` and `tool_choice` ("auto", "none", "required" or
        {"type": "function", "function": {"name": ...}}) as OpenAI's, the tools handed to the chat
        template; `tool_parser` (hermes, llama3_json, mistral, qwen3_xml, deepseek_v3) reads calls
        out of the answers (auto needs one; a required or named choice runs under the family's
        grammar, or a JSON list's without one); `reasoning_parser` (deepseek_r1, qwen3) moves the
        thinking into `reasoning_content`. `sampling_params` / `keywords`: as `generate`.
        Returns a `ChatGeneration`: `.messages` (with `.tool_calls` as objects), `.generation`."""
        from dcp_jax.agents.messages import plan_chat

        one = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages or ())
        if not conversations:
            raise UserError("no conversation given", field="messages")
        plans = [plan_chat(c, tools, tool_choice, parallel_tool_calls, tool_parser=tool_parser,
                           reasoning=reasoning_parser) for c in conversations]
        params = SamplingParams.of(sampling_params, **keywords)
        if plans[0].structured is not None:
            if params.structured is not None:
                raise UserError(f"tool_choice {tool_choice!r} constrains the answer already: drop "
                                "structured", field="structured")
            params = dataclasses.replace(params, structured=plans[0].structured)
        prompts = [self.chat_prompt(p.messages, **p.template_variables()) for p in plans]
        out = self.generate(prompts, params)
        answers = [plans[k // params.n].parser.parse(text or "", reason) for k, (text, reason)
                   in enumerate(zip(out.text or [""] * len(out.tokens), out.finish_reasons))]
        return ChatGeneration(answers, out)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block no request holds; returns how many were dropped."""
        return self.engine.reset_prefix_cache()

    def compile(self) -> float:
        """Compile every program the engine may run (the decode or verify program, the ragged step
        of each step size, the history fills, with a host tier its copies) and allocate the pool,
        as `load` does by default and a server before it serves; without it `generate` compiles a
        step size the first time a step needs it. Returns the seconds spent."""
        t = time.perf_counter()
        self.engine.runner.compile_all()
        return time.perf_counter() - t

    def requests(self, prompts, sampling_params=None, *, prefix: str = "r",
                 **keywords) -> list[Request]:
        """`generate`'s arguments checked and made into requests (ids `prefix`0, `prefix`1, ...;
        prompt i's sample j is `prefix`i.j when n > 1) by `make_requests`. UserError names a bad
        one; a prompt that cannot fit fails alone when it is added."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if not ids:
            raise UserError("no prompt given")
        if isinstance(sampling_params, (list, tuple)):
            if keywords:
                raise UserError(f"give SamplingParams or keywords ({', '.join(sorted(keywords))}), "
                                "not both")
            if len(sampling_params) != len(ids):
                raise UserError(f"{len(sampling_params)} SamplingParams for {len(ids)} prompts: "
                                "give one per prompt (or one for all)")
            params = [SamplingParams.of(p) for p in sampling_params]
        else:
            params = [SamplingParams.of(sampling_params, **keywords)] * len(ids)
        encode = None if self.tokenizer is None else self.encode_words
        return [r for i, (p, sp) in enumerate(zip(ids, params))
                for r in make_requests(f"{prefix}{i}", p, sp, encode=encode)]

    def encode_words(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (as bad words are encoded)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def generate(self, prompts,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 on_chunk=None, on_token=None, **keywords) -> Generation:
        """`prompts`: a string, a list of strings, a list of ids, or a list of id lists;
        `sampling_params`: one `SamplingParams` for every prompt, or a list of one per prompt (as
        vLLM's `LLM.generate`); None: `SamplingParams()` (greedy, 16 tokens). `keywords`:
        SamplingParams' fields instead of one (and `max_new_tokens` for max_tokens), the older form.

        The requests go to this LLM's engine: admitted while pages and slots are free, prefilled
        in chunks (after any cached prefix), decoded together, preempted and recomputed when pages
        run out. Returns a `Generation` with `tokens` and `logprobs` (per request), `text` (None
        without a tokenizer; cut before a stop string), `finish_reasons`, `errors` (per request,
        None when it ran) and `stats` (this call's); with top_logprobs N (up to 20),
        `top_logprobs`: each generated token's N most likely (id, logprob) pairs under the model,
        computed on the device from the logits it was sampled from. `n` samples per prompt come
        prompt-major (prompt i's sample j is entry i·n + j), sample j drawn with seed + j; with
        prefix caching the first sample's prefill fills the prompt's full blocks and the others
        share them (one prefill, pages by reference count). With prompt_logprobs N (0..20):
        `prompt_logprobs` and `prompt_top_logprobs`, each prompt token's log-probability given the
        ones before it and its N most likely alternatives (None for the first token); such a
        request computes its whole prompt (no prefix cache hit), as vLLM's does. `structured`:
        what the output must match, one of {"json": schema}, {"json_object": True}, {"regex": r},
        {"choice": [...]}, {"grammar": lark} (vLLM's structured_outputs; llguidance masks each
        token on the device). The other parameters: `SamplingParams`.

        A request that can never run fails alone; if every one fails, UserError.
        `on_chunk(done, total)` reports prefill tokens; `on_token(step, tokens [B])` receives new
        tokens as they come (-1 for requests with none at that step).
        """
        requests = self.requests(prompts, sampling_params, **keywords)
        server = self.engine
        if not server.lock.acquire(blocking=False):
            raise UserError("this LLM's engine is in use (a server or another generate call drives it): wait for "
                            "it, or build a second LLM on the same model for this call")
        try:
            return self._run(requests, on_chunk, on_token)
        finally:
            server.lock.release()

    def _run(self, requests: list[Request], on_chunk=None, on_token=None) -> Generation:
        """`generate` for checked `requests`, with the engine's lock held."""
        server, runner = self.engine, self.engine.runner
        compile0, compiled0 = runner.compile_s, len(runner.compiled)
        if not runner.compiled:  # the first call: the decode program and its first step's size ahead of
            # the clock; other step sizes when a step first needs one (`compile()` compiles them all)
            first = sum(r.num_prompt_tokens for r in requests[:server.config.max_num_seqs])
            runner.compile_all(step_sizes=[runner.step_size(min(first, server.config.token_budget))])

        total = sum(r.num_prompt_tokens for r in requests)
        progress = dict(done=0, step=0, emitted=[0] * len(requests))

        def on_step(plan):
            if plan.prefills and on_chunk is not None:
                progress["done"] += plan.num_prefill_tokens
                on_chunk(min(progress["done"], total), total)
            if on_token is None:
                return
            new = [r.output_token_ids[e:] for r, e in zip(requests, progress["emitted"])]
            for j in range(max(map(len, new), default=0)):
                on_token(progress["step"], np.asarray([n[j] if j < len(n) else -1 for n in new], np.int32))
                progress["step"] += 1
            progress["emitted"] = [len(r.output_token_ids) for r in requests]

        timing0, sched0 = dict(server.timing), server.stats()
        result = run_requests(server, requests, on_step=on_step)
        timing = {k: server.timing[k] - timing0[k] for k in timing0}
        now = server.stats()
        delta = {k: now[k] - sched0[k] for k in CALL_COUNTERS if k in now}
        q, h = delta["prefix_query_tokens"], delta["prefix_hit_tokens"]
        stats = dict(
            tp=self.mesh.shape[mesh_lib.TP], dcp=self.mesh.shape[mesh_lib.DCP], interleave=server.layout.interleave,
            page_size=server.layout.page_size, max_seq_len=server.config.max_model_len,
            max_num_seqs=server.config.max_num_seqs, compile_s=runner.compile_s - compile0,
            compilations=len(runner.compiled), new_compilations=len(runner.compiled) - compiled0,
            wall_s=result["wall_s"], kv_capacity_tokens=now["kv_capacity_tokens"], kv_pages=now["pages_total"],
            kv_shards=server.layout.num_shards, preemptions=delta["preemptions"],
            prefix_caching=self.enable_prefix_caching, prefix_query_tokens=q, prefix_hit_tokens=h,
            prefix_hit_rate=h / q if q else 0.0, cached_blocks=now["cached_blocks"], evictions=delta["evictions"],
            **request_stats(requests, result["first_token_s"], timing), **server.kv_bytes())
        if "host_hit_tokens" in now:  # the host tier's: the call's hits and copies, what it holds
            stats.update({k: delta[k] for k in HOST_COUNTERS}, host_blocks=now["host_blocks"],
                         host_bytes=now["host_bytes"])
        if self.speculative is not None:  # this call's drafts, acceptances and verify steps
            d, a, n = (delta[k] for k in ("spec_drafted_tokens", "spec_accepted_tokens", "spec_verify_steps"))
            stats.update(speculative=self.speculative.method, num_speculative_tokens=self.speculative.num_tokens,
                         spec_drafted_tokens=d, spec_accepted_tokens=a, spec_verify_steps=n,
                         spec_acceptance_rate=a / d if d else 0.0,
                         mean_acceptance_length=1 + a / n if n else 0.0,
                         **{k: delta[k] for k in ("spec_on_iterations", "spec_off_iterations",
                                                  "spec_prefill_plain_iterations",
                                                  "spec_switches")},
                         spec_last_switch=now["spec_last_switch"])
        return generation(requests, stats, None if self.tokenizer is None else self.decode)
