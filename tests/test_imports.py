"""The package's layering: every import points down (no circle, function-local imports included), the
package's face is lazy, the plain-Python host side loads no model, and no module outgrows one job."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dcp_jax"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports anywhere in its file (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                for cand in (f"{base}.{alias.name}", base):
                    if cand in known:
                        out.add(cand)
                        break
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
    # a package's own __init__ is not a dependency of its submodules (Python runs it first either way)
    return {d for d in out if d != name and not name.startswith(d + ".")}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_imports_form_no_circle():
    mods = modules()
    graph = {m: imports_of(m, p, set(mods) - {"dcp_jax"}) for m, p in mods.items()}
    cycle = find_cycle(graph)
    assert not cycle, "the package's imports form a circle: " + " -> ".join(cycle)


def test_every_module_imports():
    import importlib

    for name in modules():  # the entry points too: importing them runs nothing
        importlib.import_module(name)


def test_host_side_loads_no_model():
    # The scheduler, its requests and the KV manager are plain Python over integers: importing them
    # (through the lazy package face) loads neither flax nor the model.
    code = ("import sys, dcp_jax.serving.scheduler, dcp_jax.kv.manager; "
            "print(sorted(m for m in ('flax', 'dcp_jax.model', 'dcp_jax.llm', 'dcp_jax.serving.runner') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_package_face_is_lazy_and_complete():
    code = ("import sys, dcp_jax; before = 'flax' in sys.modules; "
            "from dcp_jax import LLM, SamplingParams, UserError, make_mesh, Engine, DisaggregatedLLM; "
            "print(before, 'flax' in sys.modules, LLM.__module__, Engine.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "dcp_jax.llm", "dcp_jax.dense"]
    import dcp_jax

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        dcp_jax.Nope  # noqa: B018


def test_no_module_over_450_lines():
    long = {name: n for name, p in modules().items() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_no_file_points_outside_the_project():
    # The project stands on its own: no code, test or document cites a design document it does not ship.
    hits = []
    for path in [*ROOT.glob("dcp_jax/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("scripts/*.py"),
                 *ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("notebooks/*.ipynb")]:
        text = path.read_text()
        if path.name != Path(__file__).name and ("DESIGN" + ".md" in text or "../" + "shared" in text):
            hits.append(str(path.relative_to(ROOT)))
    assert not hits, hits
