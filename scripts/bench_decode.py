"""Decode throughput on CPU: the engine's donated in-jit loop against a naive per-token loop and transformers.

Three ways to greedily decode `--new-tokens` tokens after a prompt of `context` random ids, batch 1,
on the same float32 Llama checkpoint:

  donated  `Engine.generate`: chunked prefill, then the whole decode as one jitted `while_loop` whose
           cache is donated, so XLA writes each new K/V in place.
  naive    the same `CausalLM`, cache layout and prefill, but decode is a jitted single step (one
           token forward + greedy pick) called from Python once per token, without donation: every
           step returns a new cache, i.e. XLA copies the whole cache per token.
  peer     what a CPU user would otherwise pick: transformers' `AutoModelForCausalLM` with its own KV
           cache (`past_key_values`), run in another interpreter (`--peer-python`, torch + transformers).

The checkpoint (about 30M parameters: hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 8192,
random weights) is written once with NumPy + safetensors under Hugging Face's Llama names into
`--checkpoint` (default ~/.cache/dcp_jax/bench-llama-30m); an existing directory with a config.json
is used as it is, so any Llama-family checkpoint works. Timings exclude compilation; `prefill_s` is
the engine's ttft_s (prefill + first token).

  serving  time to first token of the serving engine (`LLM`, what `generate`, the server and a
           notebook run) at its CPU defaults (prefill chunk and token budgets; prefix caching
           off), warmed up on the prompt reversed (which compiles what it runs): `serve_ttft_s`,
           against the peer's prefill (`serve_ratio` = peer_prefill_s / serve_ttft_s; >= 1: as
           fast or faster).

Each mesh is measured in its own interpreter that sees exactly tp·dcp devices, as
`python -m dcp_jax.generate --mesh ...` does: XLA's CPU client sizes its thread pool to
max(cores, devices), so simulating 8 devices for a 1-device mesh puts 8 threads on the cores and
halves the dcp=1 decode speed on a 2-core machine (measured: 16K step 94-101 ms vs 47-53 ms).

`prefill_floor_s` is the least time any exact float32 prefill can take here: the prompt's
matmul FLOPs (`prefill_flops`: projections and MLP for every token, causal attention, one lm_head
row) at the fastest float32 GEMM rate measured in the same run (`gemm_gflops`: XLA, NumPy and, in
the peer, torch; the best of square products of 1024 and 2048).

    python scripts/bench_decode.py                 # contexts 4K, 16K, 32K; dcp=1 and dcp=8 meshes
    python scripts/bench_decode.py --quick --json  # tiny checkpoint in a temp dir, context 512
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers
import random_llama  # noqa: E402
from random_llama import hf_tensors  # noqa: E402,F401  (the benchmarks' checkpoint writer; tests use it)

DEFAULT_CHECKPOINT = Path("~/.cache/dcp_jax/bench-llama-30m").expanduser()
# the Python 3.11 venv beside the checkout that scripts/make_fixtures.py's docstring sets up
DEFAULT_PEER_PYTHON = Path(__file__).resolve().parent.parent.parent / "venv311" / "bin" / "python"

# Hugging Face LlamaConfig fields of the two generated checkpoints.
MODELS = {
    "llama-30m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=1536, vocab_size=8192, max_position_embeddings=65536),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=192, vocab_size=256, max_position_embeddings=4096),
}

# The peer, run by `--peer-python` on a JSON file of arguments; prints one JSON line.
PEER_SOURCE = r'''
import json, sys, time
import torch
import transformers
from transformers import AutoModelForCausalLM

args = json.load(open(sys.argv[1]))
torch.set_num_threads(args["threads"])
kw = dict(attn_implementation=args["attn"])
try:
    model = AutoModelForCausalLM.from_pretrained(args["checkpoint"], dtype=torch.float32, **kw)
except TypeError:  # transformers < 4.56 spells it torch_dtype
    model = AutoModelForCausalLM.from_pretrained(args["checkpoint"], torch_dtype=torch.float32, **kw)
model.eval()
gemm = 0.0
for size in (1024, 2048):  # torch's float32 GEMM rate on these threads, for the prefill floor
    a = torch.randn(size, size)
    a @ a
    for _ in range(3):
        t = time.perf_counter()
        a @ a
        gemm = max(gemm, 2 * size**3 / (time.perf_counter() - t) / 1e9)
ids = torch.tensor([args["prompt"]], dtype=torch.long)
n = args["new_tokens"]
with torch.inference_mode():
    model(ids[:, :8], use_cache=True)  # warm-up: thread pool, kernel choice (not timed)
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)  # generate() also keeps only the last logits
    tok = out.logits[:, -1].argmax(-1)
    tokens = [int(tok)]
    prefill_s = time.perf_counter() - t0
    past = out.past_key_values
    t1 = time.perf_counter()
    for _ in range(n - 1):
        out = model(tok[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(int(tok))
    decode_s = time.perf_counter() - t1
print(json.dumps(dict(peer_prefill_s=prefill_s, peer_decode_s=decode_s,
                      peer_tokens_per_s=(n - 1) / decode_s if decode_s > 0 else None,
                      peer_tokens=tokens, peer_cache=type(past).__name__, peer_attn=args["attn"],
                      peer_threads=torch.get_num_threads(), peer_gemm_gflops=gemm,
                      torch_version=torch.__version__,
                      transformers_version=transformers.__version__)))
'''


# --- the checkpoint --------------------------------------------------------------------------------
def hf_config(model: str) -> dict:
    m = MODELS[model]
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                head_dim=m["hidden_size"] // m["num_attention_heads"], rms_norm_eps=1e-5,
                rope_theta=10000.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=1,
                eos_token_id=2, dtype="float32", torch_dtype="float32", use_cache=True, **m)


def ensure_checkpoint(path: Path, model: str) -> Path:
    """`path` as is when it holds a config.json; else write the random `model` checkpoint there."""
    return random_llama.ensure_checkpoint(path, hf_config(model))


def count_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for name in st.keys():
                total += int(np.prod(st.get_slice(name).get_shape()))
    return total


def prefill_flops(cfg: dict, t: int) -> int:
    """FLOPs (2 per multiply-add) that any exact prefill of `t` tokens does: every token through the
    q/k/v/o projections and the MLP, causal attention (query i meets i + 1 keys, in QK^T and in PV)
    and the lm_head row of the last token. Norms, RoPE and the softmax are left out, which only
    lowers the floor."""
    e, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    h, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or e // h
    per_token = n * (2 * e * h * d + 2 * e * k * d + 3 * e * i)  # q and o, k and v, gate/up/down
    attention = n * h * 4 * d * (t * (t + 1) // 2)
    return 2 * t * per_token + attention + 2 * e * v


def gemm_gflops(put, matmul) -> float:
    """The best float32 GEMM rate `matmul(a)` (= a @ a) reaches on square products of 1024 and 2048."""
    best = 0.0
    for size in (1024, 2048):
        a = put(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
        matmul(a)
        for _ in range(3):
            t = time.perf_counter()
            matmul(a)
            best = max(best, 2 * size**3 / (time.perf_counter() - t) / 1e9)
    return best


# --- the peer --------------------------------------------------------------------------------------
def run_peer(python: str, checkpoint: Path, prompt: list[int], new_tokens: int, attn: str, threads: int) -> dict:
    return run_python(python, PEER_SOURCE, dict(checkpoint=str(checkpoint), prompt=prompt,
                                                new_tokens=new_tokens, attn=attn, threads=threads),
                      threads)


def run_python(python: str, source: str, args: dict, threads: int,
               error_key: str = "peer_error") -> dict:
    """Run `source` in the interpreter `python` (the peer: torch + transformers, PYTHONPATH
    cleared) on a JSON file of `args` (its argv[1]), at `threads` threads; its last JSON line, or
    {error_key: the exit status and its last lines}."""
    with tempfile.TemporaryDirectory(prefix="bench_peer.") as tmp:
        src, args_file = Path(tmp) / "peer.py", Path(tmp) / "args.json"
        src.write_text(source)
        args_file.write_text(json.dumps(args))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([python, str(src), str(args_file)], capture_output=True, text=True,
                              env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {error_key: f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


# --- ours ------------------------------------------------------------------------------------------
class Ours:
    """One checkpoint on one mesh: the engine's donated loop and the naive per-token loop."""

    def __init__(self, checkpoint: Path, tp: int, dcp: int):
        from dcp_jax.dense import Engine
        from dcp_jax.mesh import make_mesh
        from dcp_jax.weights import load_hf

        self.mesh = make_mesh(tp, dcp)
        model, _ = load_hf(checkpoint, self.mesh, "float32")
        self.engine = Engine(model, self.mesh)

    def donated(self, prompt: list[int], new_tokens: int, prefill_chunk: int) -> tuple[list[int], dict]:
        from dcp_jax.sampling import SamplingParams

        out = self.engine.generate([prompt], max_new_tokens=new_tokens, max_seq_len=len(prompt) + new_tokens,
                                   prefill_chunk=prefill_chunk, sampling=SamplingParams(), ignore_eos=True)
        return out.tokens[0], out.stats

    def served(self, prompt: list[int], new_tokens: int) -> tuple[list[int], dict]:
        """The serving engine (`LLM`) at its CPU defaults on this model and mesh: one request,
        warmed up on the prompt reversed (the same lengths, so the same programs, compiled then; no
        prefix caching, so nothing of it is reused); the timed request's TTFT."""
        from dcp_jax import LLM, SamplingParams
        from dcp_jax.serving.config import DEFAULT_PAGE_SIZE

        length = len(prompt) + new_tokens
        dcp = self.mesh.shape["dcp"]
        pages = 2 + -(-length // (DEFAULT_PAGE_SIZE * dcp))  # one context, and the null page
        llm = LLM(self.engine.model, self.mesh, max_model_len=length, max_num_seqs=1,
                  num_pages=pages, enable_prefix_caching=False)
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        llm.generate([prompt[::-1]], params)
        out = llm.generate([prompt], params)
        stats = out.stats
        cfg = llm.config
        return out.tokens[0], dict(serve_ttft_s=stats["ttft_s"],
                                   serve_prefill_chunk=cfg.prefill_chunk,
                                   serve_token_budget=cfg.token_budget,
                                   serve_idle_budget=cfg.idle_budget)

    def _step_fn(self, layout):
        """One token through the model + greedy pick, jitted WITHOUT donation (a new cache per call)."""
        from flax import nnx

        from dcp_jax import mesh as mesh_lib
        from dcp_jax.model import AttentionContext, cache_sharding

        engine = self.engine
        ctx = AttentionContext(self.mesh, layout, engine.impl)

        def step(params, cache, tok, length):
            """tok [B] the last token, length [B] tokens already in the cache."""
            model = nnx.merge(engine.graphdef, params)
            valid = jnp.ones((tok.shape[0], 1), jnp.bool_)
            logits, cache = model(tok[:, None], length[:, None], valid, length + 1, cache, ctx)
            return cache, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), length + 1

        replicated = mesh_lib.named(self.mesh, mesh_lib.spec())
        return jax.jit(step, out_shardings=(cache_sharding(self.engine.model, self.mesh), replicated, replicated))

    def naive(self, prompt: list[int], new_tokens: int, prefill_chunk: int) -> tuple[list[int], dict]:
        from dcp_jax import mesh as mesh_lib
        from dcp_jax.model import init_cache

        engine, cfg = self.engine, self.engine.model.config
        layout = engine.layout(len(prompt) + new_tokens)
        b, n, length = 1, new_tokens, len(prompt)
        chunk = min(prefill_chunk, length)
        padded = np.zeros((b, math.ceil(length / chunk) * chunk), np.int32)
        padded[0, :length] = prompt
        lens = np.array([length], np.int32)

        def chunk_args(c, cache, last_logits):  # as Engine.generate builds them
            pos = np.arange(c * chunk, (c + 1) * chunk, dtype=np.int32)[None].repeat(b, 0)
            return (engine.params, cache, last_logits, padded[:, c * chunk:(c + 1) * chunk], pos,
                    pos < lens[:, None], np.minimum(lens, (c + 1) * chunk), (lens - 1) % chunk,
                    (lens - 1) // chunk == c)

        cache_spec, logits_spec = engine.abstract_state(b, layout)
        replicated = mesh_lib.named(self.mesh, mesh_lib.spec())
        tc = time.perf_counter()
        prefill = engine.compile(engine.prefill_fn(layout), *chunk_args(0, cache_spec, logits_spec))
        tok_spec = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=replicated)
        step = self._step_fn(layout).lower(engine.params, cache_spec, tok_spec, tok_spec).compile()
        compile_s = time.perf_counter() - tc

        t0 = time.perf_counter()
        cache = init_cache(engine.model, b, layout, self.mesh, engine.dtype)
        last_logits = jax.device_put(np.zeros((b, cfg.vocab_size), np.float32), replicated)
        for c in range(padded.shape[1] // chunk):
            cache, last_logits = prefill(*chunk_args(c, cache, last_logits))
        first = np.argmax(np.asarray(last_logits), axis=-1).astype(np.int32)
        prefill_s = time.perf_counter() - t0

        tok, lengths = jax.device_put(first, replicated), jax.device_put(lens, replicated)
        out = [tok]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            cache, tok, lengths = step(engine.params, cache, tok, lengths)
            out.append(tok)
        jax.block_until_ready((cache, out))
        decode_s = time.perf_counter() - t1
        tokens = [int(np.asarray(t)[0]) for t in out]
        copy_s = self._copy_time(cache)
        del cache
        return tokens, dict(naive_decode_s=decode_s, naive_compile_s=compile_s, naive_prefill_s=prefill_s,
                            naive_tokens_per_s=(n - 1) / decode_s if decode_s > 0 else None,
                            cache_copy_ms=1e3 * copy_s)

    def _copy_time(self, cache, repeats: int = 3) -> float:
        """Seconds to copy the whole cache once (what a step without donation adds at least)."""
        from dcp_jax.model import cache_sharding

        sharding = cache_sharding(self.engine.model, self.mesh)
        copy = jax.jit(lambda c: jax.tree.map(jnp.copy, c),
                       out_shardings=jax.tree.map(lambda _: sharding, cache)).lower(cache).compile()
        jax.block_until_ready(copy(cache))
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(copy(cache))
            best = min(best, time.perf_counter() - t)
        return best


def measure_mesh(spec: dict) -> dict:
    """One mesh's measurements; runs in the mesh's own interpreter (`run_mesh`), which first asks for
    exactly tp·dcp devices."""
    from dcp_jax.mesh import ensure_cpu_devices

    tp, dcp = spec["tp"], spec["dcp"]
    ensure_cpu_devices(tp * dcp)
    ours = Ours(Path(spec["checkpoint"]), tp, dcp)
    results = []
    for c, prompt in spec["prompts"]:
        t = time.perf_counter()
        donated_tokens, stats = ours.donated(prompt, spec["new_tokens"], spec["prefill_chunk"])
        served_tokens, served = ours.served(prompt, spec["new_tokens"])
        naive_tokens, naive = None, {}
        if spec["naive"]:
            naive_tokens, naive = ours.naive(prompt, spec["new_tokens"], spec["prefill_chunk"])
        results.append(dict(context=c, donated_tokens=donated_tokens, stats=stats, naive_tokens=naive_tokens,
                            naive=naive, served_tokens=served_tokens, served=served))
        naive_tps = naive.get("naive_tokens_per_s")
        print(f"tp={tp} dcp={dcp} context {c:>6}: donated {stats['decode_tokens_per_s']:.2f} tok/s, naive "
              f"{naive_tps if naive_tps is None else round(naive_tps, 2)} tok/s, prefill "
              f"{stats['ttft_s']:.2f} s, serving TTFT {served['serve_ttft_s']:.2f} s "
              f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    square = jax.jit(lambda a: a @ a)
    return dict(results=results, devices=len(jax.devices()),
                gemm_gflops=gemm_gflops(jnp.asarray, lambda a: square(a).block_until_ready()))


def run_mesh(spec: dict) -> dict:
    """`measure_mesh(spec)` in a fresh interpreter: this script again, with `--worker`."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], input=json.dumps(spec),
                          stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"error: measuring tp={spec['tp']} dcp={spec['dcp']} failed (exit {proc.returncode}); "
                         "its error is printed above")
    return json.loads(lines[-1])


def ratio(a, b):
    return a / b if a is not None and b else None


def table(rows: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = (f"{'context':>8} {'tp':>2} {'dcp':>3} {'donated':>9} {'naive':>9} {'ratio':>6} {'peer':>9} "
            f"{'peer_r':>6} {'prefill':>8} {'peer_pf':>8} {'pf_r':>6} {'serve':>7} {'sv_r':>5} "
            f"{'floor':>6} {'cacheMB':>8} {'copy_ms':>8} "
            f"{'step_ms d/n':>13} same peer_same")
    lines = [head, "-" * len(head)]
    for r in rows:
        steps = f"{f(r['donated_step_ms'], '.1f')}/{f(r['naive_step_ms'], '.1f')}"
        lines.append(
            f"{r['context']:>8} {r['tp']:>2} {r['dcp']:>3} {f(r['donated_tokens_per_s'], '9.2f')} "
            f"{f(r['naive_tokens_per_s'], '9.2f'):>9} {f(r['ratio'], '6.2f'):>6} "
            f"{f(r['peer_tokens_per_s'], '9.2f'):>9} {f(r['peer_ratio'], '6.2f'):>6} {f(r['prefill_s'], '8.2f')} "
            f"{f(r['peer_prefill_s'], '8.2f'):>8} {f(r['prefill_ratio'], '6.2f'):>6} "
            f"{f(r['serve_ttft_s'], '7.2f')} {f(r['serve_ratio'], '5.2f'):>5} "
            f"{f(r['prefill_floor_s'], '6.2f')} "
            f"{r['kv_bytes_total'] / 2**20:>8.1f} {f(r['cache_copy_ms'], '8.1f'):>8} {steps:>13} "
            f"{str(r['same_tokens']):>4} {str(r['peer_same_tokens']):>9}")
    lines.append("tokens/s in decode (first token excluded); ratio = donated/naive, peer_r = donated/peer, "
                 "pf_r = peer_prefill_s/prefill_s;\nprefill = prefill + first token, seconds (the "
                 "dense engine); serve = the serving engine's TTFT at its CPU defaults, sv_r = "
                 "peer_prefill_s/serve;\nfloor = the prompt's "
                 "FLOPs at the fastest float32 GEMM rate measured (no exact prefill can be faster)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated prompt lengths (default 4096,16384,32768)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens to generate (default 32)")
    p.add_argument("--meshes", default="1x1,1x8", help="comma-separated TPxDCP meshes (default 1x1,1x8)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="the engine's default (fastest on CPU: 4K prefill 3.8 s at 256, 4.6 s at 512, 5.4 s at 1024)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help=f"HF checkpoint dir, created when missing (default {DEFAULT_CHECKPOINT})")
    p.add_argument("--peer-python", default=None,
                   help=f"interpreter with torch + transformers (default {DEFAULT_PEER_PYTHON} if present)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--peer-attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--peer-threads", type=int, default=2)
    p.add_argument("--naive-all-meshes", action=argparse.BooleanOptionalAction, default=True,
                   help="run the naive loop on every mesh, not only dcp=1 (default: yes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--quick", action="store_true", help="tiny checkpoint in a temp dir, context 512, 8 tokens")
    p.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...]}')
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # run_mesh's child: spec on stdin
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(measure_mesh(json.load(sys.stdin))))
        return 0

    meshes = [tuple(int(x) for x in m.lower().split("x")) for m in args.meshes.split(",")]
    contexts = args.contexts or ([512] if args.quick else [4096, 16384, 32768])
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    if new_tokens < 2:
        p.error("--new-tokens must be >= 2 (the first token comes from prefill)")
    peer_python = None if args.no_peer else args.peer_python
    if peer_python is None and not args.no_peer and not args.quick and DEFAULT_PEER_PYTHON.exists():
        peer_python = str(DEFAULT_PEER_PYTHON)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    tmp = tempfile.TemporaryDirectory(prefix="bench_decode.") if args.quick and args.checkpoint is None else None
    try:
        checkpoint = ensure_checkpoint(
            Path(tmp.name) / "tiny" if tmp else (args.checkpoint or DEFAULT_CHECKPOINT),
            "tiny" if args.quick else "llama-30m")
        params = count_params(checkpoint)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        log(f"checkpoint {checkpoint} ({params / 1e6:.1f}M parameters), peer: {peer_python or 'none'}")
        rng = np.random.default_rng(args.seed)
        prompts = {c: rng.integers(3, vocab, size=c).tolist() for c in contexts}

        peers = {}
        for c in contexts:
            if peer_python:
                t = time.perf_counter()
                peers[c] = run_peer(peer_python, checkpoint, prompts[c], new_tokens, args.peer_attn,
                                    args.peer_threads)
                log(f"peer    context {c:>6}: {peers[c].get('peer_tokens_per_s') or peers[c].get('peer_error')} "
                    f"tok/s, prefill {peers[c].get('peer_prefill_s')} s ({time.perf_counter() - t:.0f} s)")
            else:
                peers[c] = {}

        cfg = json.loads((checkpoint / "config.json").read_text())
        rows, rates = [], {"numpy": gemm_gflops(lambda a: a, lambda a: a @ a)}
        for c in contexts:
            if peers[c].get("peer_gemm_gflops"):
                rates["torch"] = max(rates.get("torch", 0.0), peers[c]["peer_gemm_gflops"])
        measured = []
        for tp, dcp in meshes:
            out = run_mesh(dict(checkpoint=str(checkpoint), tp=tp, dcp=dcp, new_tokens=new_tokens,
                                prefill_chunk=args.prefill_chunk, naive=dcp == 1 or args.naive_all_meshes,
                                prompts=[[c, prompts[c]] for c in contexts]))
            rates[f"xla_{tp * dcp}dev"] = out["gemm_gflops"]
            measured.append((tp, dcp, out))
        best_rate = max(rates.values())
        log("float32 GEMM GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
        for tp, dcp, out in measured:
            for res in out["results"]:
                c, stats, naive, donated_tokens = res["context"], res["stats"], res["naive"], res["donated_tokens"]
                naive_tokens = res["naive_tokens"]
                peer = peers[c]
                donated_tps = stats["decode_tokens_per_s"]
                naive_tps = naive.get("naive_tokens_per_s")
                peer_tps = peer.get("peer_tokens_per_s")
                same = None if naive_tokens is None else naive_tokens == donated_tokens
                if same is False:
                    log(f"WARNING: tp={tp} dcp={dcp} context {c}: naive and donated greedy tokens differ: "
                        f"{naive_tokens} vs {donated_tokens}")
                if res["served_tokens"] != donated_tokens:
                    log(f"WARNING: tp={tp} dcp={dcp} context {c}: the serving engine's greedy "
                        f"tokens differ from the dense engine's: {res['served_tokens']} vs "
                        f"{donated_tokens}")
                peer_tokens = peer.get("peer_tokens")
                flops = prefill_flops(cfg, c)
                row = dict(
                    context=c, new_tokens=new_tokens, batch=1, tp=tp, dcp=dcp, devices=out["devices"],
                    params=params, prefill_chunk=args.prefill_chunk,
                    donated_tokens_per_s=donated_tps, naive_tokens_per_s=naive_tps,
                    ratio=ratio(donated_tps, naive_tps), peer_tokens_per_s=peer_tps,
                    peer_ratio=ratio(donated_tps, peer_tps),
                    prefill_s=stats["ttft_s"], peer_prefill_s=peer.get("peer_prefill_s"),
                    prefill_ratio=ratio(peer.get("peer_prefill_s"), stats["ttft_s"]),
                    naive_prefill_s=naive.get("naive_prefill_s"),
                    **res["served"],
                    serve_ratio=ratio(peer.get("peer_prefill_s"), res["served"]["serve_ttft_s"]),
                    serve_same_tokens=res["served_tokens"] == donated_tokens,
                    prefill_flops=flops, gemm_gflops=best_rate, gemm_gflops_by=rates,
                    prefill_floor_s=flops / (best_rate * 1e9),
                    donated_step_ms=1e3 / donated_tps if donated_tps else None,
                    naive_step_ms=1e3 / naive_tps if naive_tps else None,
                    peer_step_ms=1e3 / peer_tps if peer_tps else None,
                    cache_copy_ms=naive.get("cache_copy_ms"),
                    kv_bytes_total=stats["kv_bytes_total"], kv_bytes_per_device=stats["kv_bytes_per_device"],
                    donated_compile_s=stats["compile_s"], naive_compile_s=naive.get("naive_compile_s"),
                    same_tokens=same,
                    peer_same_tokens=None if peer_tokens is None else peer_tokens == donated_tokens,
                    tokens=donated_tokens,
                    peer_error=peer.get("peer_error"),
                    peer_attn=peer.get("peer_attn"), peer_cache=peer.get("peer_cache"),
                )
                rows.append(row)
    finally:
        if tmp is not None:
            tmp.cleanup()

    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
