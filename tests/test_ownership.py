"""Run-time ownership: each piece of state has one owner.

- No attribute of another object is assigned in the package (`x.attr = ...` where x is not `self`
  or `cls`), except on the plain data records listed in DATA_RECORDS, each with its reason: nothing
  patches an attribute onto the runner, the scheduler, the engine or a collaborator after it is
  built.
- One driver loop: the server's engine thread, `LLM.generate`, a lockstep follower and both
  disaggregated roles all call the same `ServingEngine.step`.
"""

import ast
import collections
import pathlib

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dcp_jax"
FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# The names whose attributes the package may set from outside their class: records of data, not
# owners of state.
DATA_RECORDS = {
    "r": "a Request: its scheduling state is the scheduler's and the KV manager's (vLLM's way)",
    "request": "a Request (as `r`)",
    "plan": "a SchedulePlan: the scheduler marks the plan it made as applied",
    "landed": "a transfer's Landed record, filled by the decode side that pulled it",
    "block": "a HostBlock: the host tier's copier fills its payload",
    "out": "a Generation being assembled by `outputs.generation`",
    "t": "an AsyncEngine's _Tracked record (the engine thread's own bookkeeping)",
    "app.state": "FastAPI's `app.state` namespace, made for this",
    "np.float8_e4m3fn": "safetensors looks fp8 up on the numpy module; an older numpy lacks it",
    "server": "uvicorn.Server's documented stop flag (`should_exit`)",
    "sys": "`sys.stdout` redirected in a worker process (processes.start)",
    "pickler": "pickle's documented `persistent_id` hook",
    "tok": "a tokenizers.Tokenizer: its pipeline stages are set by assignment (the library's API)",
    "unpickler": "pickle's documented `persistent_load` hook",
    "env": "a jinja2 Environment's `filters` and `globals`, made for this",
}


def outside_assignments(path: pathlib.Path):
    """(line, target) of each assignment to an attribute of something other than self or cls."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        flat = []
        for t in targets:
            flat += t.elts if isinstance(t, ast.Tuple) else [t]
        for t in flat:
            if not isinstance(t, ast.Attribute):
                continue  # (a subscript mutates a container: not an attribute of another object)
            root = t.value
            while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
                root = root.value if not isinstance(root, ast.Call) else root.func
            name = root.id if isinstance(root, ast.Name) else None
            if name in ("self", "cls") and isinstance(t.value, ast.Name):
                continue  # its own attribute
            yield node.lineno, ast.unparse(t), name


def test_no_attribute_is_assigned_from_outside_its_class():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for line, target, name in outside_assignments(path):
            allowed = (name in DATA_RECORDS and target.count(".") == 1) or any(
                target == k or target.startswith(k + ".") for k in DATA_RECORDS if "." in k)
            if not allowed:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {target}")
    assert not bad, ("attributes assigned from outside their class (give the object a method, or "
                     "hand the value in at construction):\n" + "\n".join(bad))


def test_the_check_finds_a_patched_attribute(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(engine, llm):\n    engine.scheduler.structured = 1\n"
                   "    llm.engine.lockstep = 2\n    self.runner.caches = 3\n    r.state = 4\n")
    found = [(target, name) for _, target, name in outside_assignments(src)]
    assert found == [("engine.scheduler.structured", "engine"), ("llm.engine.lockstep", "llm"),
                     ("self.runner.caches", "self"), ("r.state", "r")]


@pytest.fixture
def steps(monkeypatch):
    """Count `ServingEngine.step` calls by the engine that made them."""
    from dcp_jax.serving.engine import ServingEngine

    calls = collections.Counter()
    real = ServingEngine.step

    def step(self):
        calls[id(self)] += 1
        return real(self)

    monkeypatch.setattr(ServingEngine, "step", step)
    return calls


def test_every_driver_calls_the_same_step(steps):
    import asyncio

    from dcp_jax import LLM
    from dcp_jax.disagg.llm import DisaggregatedLLM
    from dcp_jax.serving.async_engine import AsyncEngine
    from dcp_jax.serving.lockstep import Lockstep
    from tests.util import LocalStore
    from dcp_jax.serving.request import Request

    kw = dict(tp=1, dcp=2, page_size=4, max_model_len=64, max_num_seqs=2, prefill_chunk=16)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, 9)]
    # LLM.generate
    llm = LLM.load(FIXTURES / "llama-gqa", **kw)
    expect = llm.generate([prompt], max_new_tokens=3, ignore_eos=True).tokens
    assert steps[id(llm.engine)] > 0
    # the server's engine thread
    server = AsyncEngine(llm.engine)
    server.start()

    async def serve():
        queue = server.submit(Request("s", prompt, max_tokens=3, ignore_eos=True))
        tokens = []
        while True:
            update = await queue.get()
            tokens += update.token_ids
            if update.finished:
                return tokens

    before = steps[id(llm.engine)]
    assert asyncio.run(serve()) == expect[0]
    server.shutdown()
    assert steps[id(llm.engine)] > before
    # a lockstep follower (in one process: a leader and a follower over one store)
    store = LocalStore()
    lead = LLM.load(FIXTURES / "llama-gqa", lockstep=Lockstep(store, 0), **kw)
    other = LLM.load(FIXTURES / "llama-gqa", lockstep=Lockstep(store, 1),
                     devices=jax.devices()[2:4], **kw)
    assert lead.generate([prompt], max_new_tokens=3, ignore_eos=True).tokens == expect
    lead.engine.lockstep.publish(stop=True)
    assert other.engine.lockstep.follow(other.engine) == steps[id(lead.engine)] > 0
    assert steps[id(other.engine)] == steps[id(lead.engine)]
    # both disaggregated roles
    pair = DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(tp=1, dcp=1),
                                 decode=dict(tp=1, dcp=2), page_size=4, max_model_len=64)
    assert pair.generate([prompt], max_new_tokens=3, ignore_eos=True).tokens == expect
    assert steps[id(pair.prefill.engine)] > 0 and steps[id(pair.decode_instance.engine)] > 0
