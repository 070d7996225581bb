"""The package's rules, each held by a test: every import points down the layer table of
docs/ARCHITECTURE.md (no upward import, no circle, function-local imports included), the package's face
is lazy, the plain-Python host side loads no model, no function outgrows one screen and no line
outgrows 100 columns."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dcp_jax"
KERNELS = ROOT / "pallas_kernels"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def modules(*roots: Path) -> dict[str, Path]:
    """Dotted name -> file for every module under `roots` (dcp_jax/ and pallas_kernels/ by default)."""
    out = {}
    for root in roots or (PACKAGE, KERNELS):
        for path in sorted(root.rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules `name` imports anywhere in its file (module level or inside functions)."""
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


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods) - {"dcp_jax"}  # the lazy face: `from dcp_jax import mesh` names dcp_jax.mesh
    return {m: imports_of(m, p, known) for m, p in mods.items()}


# ---------------------------------------------------------------------------------------------------
# The layer table. docs/ARCHITECTURE.md's "## Layers" table is the one statement of the layering; this
# test reads it. A row is `| layer | modules | job |`, bottom layer first. In the modules cell each
# backticked name is a path under dcp_jax/ (`pallas_kernels/...` is the top-level package); a name that
# ends in "/" is a whole package; a bare file name after `dir/file.py` in the same row is in `dir/` too
# (`serving/config.py`, `request.py` -> dcp_jax/serving/request.py).

# Table entries for modules that other branches of issue 44 add; they may be absent until those branches
# are merged. TEMPORARY: the merger empties this set once they exist (an entry naming no module is an
# error otherwise).
PENDING_ENTRIES = {"dcp_jax.server", "dcp_jax.compilation", "dcp_jax.serving.programs"}


def layer_table(text: str | None = None) -> list[tuple[str, list[str]]]:
    """[(layer, [dotted module or package names])], bottom first, from the "## Layers" section."""
    text = ARCHITECTURE.read_text() if text is None else text
    section = re.search(r"^## Layers\b.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"{ARCHITECTURE.relative_to(ROOT)} has no '## Layers' section"
    rows = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue
        names, folder = [], ""
        for entry in re.findall(r"`([^`]+)`", cells[1]):
            path = entry if entry.startswith("pallas_kernels/") else "dcp_jax/" + entry
            if "/" in entry.rstrip("/"):
                folder = entry.rsplit("/", 1)[0] + "/" if not entry.endswith("/") else ""
            elif folder and not entry.endswith("/"):
                path = "dcp_jax/" + folder + entry
            names.append(path.rstrip("/").removesuffix(".py").replace("/", "."))
        rows.append((cells[0], names))
    assert rows, "the '## Layers' section of docs/ARCHITECTURE.md has no table rows"
    return rows


def layer_of(name: str, entries: dict[str, int]) -> int | None:
    """The row of the most specific table entry naming `name` or a package holding it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in entries:
            return entries[".".join(parts[:i])]
    return None


def layers(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[str]]:
    """Each module's row index in the table. A package's __init__ that is not listed re-exports: it sits
    in the row of the highest module it imports."""
    rows = layer_table()
    entries = {}
    for i, (_, names) in enumerate(rows):
        for n in names:
            assert n not in entries, f"{n} is in two rows of the layer table: {rows[entries[n]][0]!r} and {rows[i][0]!r}"
            entries[n] = i
    out = {m: i for m in graph if (i := layer_of(m, entries)) is not None}
    packages = [m for m in graph if m not in out and modules()[m].name == "__init__.py"]
    for _ in packages:  # a re-export of a re-export settles after as many rounds as there are packages
        for m in packages:
            out[m] = max((out.get(d, 0) for d in graph[m]), default=0)
    return out, [layer for layer, _ in rows]


def test_layer_table_names_every_module_and_nothing_else():
    rows = layer_table()
    mods = modules()
    listed = {n for _, names in rows for n in names}
    entries = {n: i for i, (_, names) in enumerate(rows) for n in names}
    unlisted = sorted(m for m, p in mods.items() if p.name != "__init__.py" and layer_of(m, entries) is None)
    assert not unlisted, (f"modules in no row of the layer table ({ARCHITECTURE.relative_to(ROOT)}, '## Layers'): "
                          f"{unlisted}; add each to the row of its layer")
    stale = sorted(n for n in listed - PENDING_ENTRIES if n not in mods)
    assert not stale, f"the layer table names modules that do not exist: {stale}; remove or rename them"


def test_layer_table_parses_its_conventions():
    text = ("## Layers\n\n| layer | modules | job |\n|---|---|---|\n"
            "| low | `a.py`, `pallas_kernels/` | x |\n"
            "| mid | `serving/config.py`, `request.py`, `disagg/x.py`, `y.py` | y |\n"
            "| top | `dense.py`, `server/`, `llm.py` | z |\n\n## Next\n| no | `b.py` | |\n")
    assert layer_table(text) == [
        ("low", ["dcp_jax.a", "pallas_kernels"]),
        ("mid", ["dcp_jax.serving.config", "dcp_jax.serving.request", "dcp_jax.disagg.x", "dcp_jax.disagg.y"]),
        ("top", ["dcp_jax.dense", "dcp_jax.server", "dcp_jax.llm"]),
    ]


def test_every_import_points_down_the_layer_table():
    graph = import_graph()
    layer, names = layers(graph)
    bad = [f"{m} ({names[layer[m]]}) imports {d} ({names[layer[d]]})"
           for m in sorted(graph) for d in sorted(graph[m])
           if m in layer and d in layer and layer[d] > layer[m]]
    assert not bad, ("imports that point up the layer table of docs/ARCHITECTURE.md (a module may import "
                     "only from its own row and the rows above it):\n  " + "\n  ".join(bad)
                     + "\nmove the code it needs down, or, if the table is wrong, correct the table and say why")


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
    cycle = find_cycle(import_graph())
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
