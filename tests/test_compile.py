"""No request waits for a compile: `LLM.load` compiles every program a request may run (the notebook
case: a second question about a document hits the prefix cache with no compile inside the call), and
JAX's persistent compilation cache (dcp_jax.compilation) lets a second process load what the first
compiled. No test asserts a time: they count compilations (the runner's table, JAX's own events)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from dcp_jax import compilation
from dcp_jax.errors import UserError

FIX = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # every XLA compile (or cache hit)
DOCUMENT = ("The lighthouse keeper wrote down the weather every morning: wind, rain, the colour of "
            "the sea and the ships that passed the point. ") * 2


@contextlib.contextmanager
def backend_compiles():
    """The XLA compilations (loads from the persistent cache too) inside the block, by name."""
    seen: list[str] = []

    def listener(event, duration, **kw):
        if event == BACKEND_COMPILE:
            seen.append(str(kw.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_second_question_about_a_document_compiles_nothing():
    """The notebook case on 1x2 with `LLM.load`'s defaults: the second question's prefill is the
    document's cached blocks and a short tail, a step size the first question never ran; it runs
    with no compile (nor does the first: `load` compiled them all)."""
    from dcp_jax.llm import LLM

    llm = LLM.load(FIX / "llama-tokenizer", tp=1, dcp=2, page_size=16,
                   compile="all")  # (the default)
    runner = llm.engine.runner
    sizes = runner.config.step_sizes
    assert len([k for k in runner.compiled if k[0] == "ragged"]) == len(sizes)  # compiled at load
    compiled, compile_s = len(runner.compiled), runner.compile_s
    first_q, second_q = DOCUMENT + "Question: what did he write?", DOCUMENT + "Q: when?"
    with backend_compiles() as first:
        one = llm.generate(first_q, max_new_tokens=4)
    with backend_compiles() as second:
        two = llm.generate(second_q, max_new_tokens=4)
    assert one.errors == [None] and two.errors == [None]
    assert two.stats["prefix_hit_tokens"] > 0  # the document's blocks came from the cache
    tail = two.stats["prompt_tokens"] - two.stats["prefix_hit_tokens"]
    assert runner.step_size(tail) < runner.step_size(one.stats["prompt_tokens"])  # another size
    assert (len(runner.compiled), runner.compile_s) == (compiled, compile_s)
    assert one.stats["new_compilations"] == two.stats["new_compilations"] == 0
    assert first == [] and second == []
    with backend_compiles() as third:  # penalties: the cached tokens go into the slot's history
        three = llm.generate(second_q, max_new_tokens=4, repetition_penalty=1.3)
    assert three.stats["prefix_hit_tokens"] > 0 and three.stats["new_compilations"] == 0
    assert third == []


def test_lazy_load_compiles_nothing_until_a_request():
    from dcp_jax.llm import LLM

    llm = LLM.load(FIX / "llama-tokenizer", tp=1, dcp=2, compile="lazy", max_model_len=64)
    assert len(llm.engine.runner.compiled) == 0
    with pytest.raises(UserError, match="compile must be one of"):
        LLM.load(FIX / "llama-tokenizer", compile="eager")


CHILD = """
import json, sys, time
import jax
counts = {"hits": 0, "misses": 0}
def on(event, **kw):
    for name in counts:
        if event == "/jax/compilation_cache/cache_" + name:
            counts[name] += 1
jax.monitoring.register_event_listener(on)
from dcp_jax.mesh import ensure_cpu_devices
ensure_cpu_devices(2)
from dcp_jax.llm import LLM
t = time.perf_counter()
llm = LLM.load(sys.argv[1], tp=1, dcp=2, max_model_len=64, max_num_seqs=1, compile="all")
out = llm.generate("Return the", max_new_tokens=3)
print(json.dumps(dict(counts, programs=len(llm.engine.runner.compiled), tokens=out.tokens[0],
                      cache=jax.config.jax_compilation_cache_dir)))
"""


def test_a_second_process_loads_the_compiled_programs(tmp_path):
    """Two processes with the same `DCP_JAX_CACHE_DIR` (which wins over a cache configured in
    JAX): the first compiles and writes every program, the second compiles none (every compile a
    cache hit) and adds no entry."""
    cache = tmp_path / "xla"
    env = dict(os.environ, DCP_JAX_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)  # dcp_jax's own threshold

    def child():
        proc = subprocess.run([sys.executable, "-c", CHILD, str(FIX / "llama-tokenizer")], env=env,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = child()
    entries = sorted(os.listdir(cache))
    second = child()
    assert first["cache"] == second["cache"] == str(cache)
    assert first["misses"] > 0 and first["programs"] >= 2
    assert second["misses"] == 0 and second["hits"] >= second["programs"]
    assert sorted(p for p in os.listdir(cache) if not p.endswith("-atime")) == \
        [p for p in entries if not p.endswith("-atime")]
    assert first["tokens"] == second["tokens"]


def test_where_the_cache_goes(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation.default_dir() == tmp_path / "dcp_jax" / "xla"
    assert compilation.resolve("off") is None and compilation.resolve(False) is None
    assert compilation.resolve(tmp_path / "mine") == str(tmp_path / "mine")
    # the tests configure JAX's own cache (conftest): a user's JAX setting wins over the default
    assert compilation.resolve() == jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    own = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)  # (an open cache stays where it is)
    try:
        assert compilation.resolve() == str(tmp_path / "dcp_jax" / "xla")  # none configured
    finally:
        jax.config.update("jax_compilation_cache_dir", own)
    monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "false")
    assert compilation.resolve() is None and compilation.resolve(tmp_path) == str(tmp_path)
    monkeypatch.delenv("JAX_ENABLE_COMPILATION_CACHE")
    monkeypatch.setenv(compilation.ENV, "OFF")
    assert compilation.resolve() is None
    monkeypatch.setenv(compilation.ENV, str(tmp_path / "env"))
    assert compilation.resolve() == str(tmp_path / "env")
    assert compilation.resolve(tmp_path / "kw") == str(tmp_path / "kw")  # the keyword wins
    with pytest.raises(UserError, match="compilation_cache"):
        compilation.resolve(3)


def test_the_flag_reaches_load():
    from dcp_jax.cli import engine_kwargs
    from dcp_jax.generate import build_parser

    assert engine_kwargs(build_parser().parse_args([]))["compilation_cache"] is None
    args = build_parser().parse_args(["--compilation-cache", "off"])
    assert engine_kwargs(args)["compilation_cache"] == "off"


def test_the_default_compiles_everything(monkeypatch):
    # (the suite's conftest asks for "lazy" through the environment; a user's default is "all")
    monkeypatch.delenv(compilation.MODE_ENV, raising=False)
    assert compilation.default_mode() == "all"
    monkeypatch.setenv(compilation.MODE_ENV, "lazy")
    assert compilation.default_mode() == "lazy"
