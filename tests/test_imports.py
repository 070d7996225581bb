"""The package's rules, each held by a test: every import points down the layer table of
docs/ARCHITECTURE.md (no upward import, no circle, function-local imports included), the package's
face is lazy, the plain-Python host side loads no model, no function outgrows one screen and no new
line outgrows 100 columns."""

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
    """Dotted name -> file of every module under `roots` (default dcp_jax/ and pallas_kernels/)."""
    out = {}
    for root in roots or (PACKAGE, KERNELS):
        for path in sorted(root.rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules `name` imports anywhere in its file (module level or in functions)."""
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
    # a package's own __init__ is not a dependency of its submodules (Python runs it first anyway)
    return {d for d in out if d != name and not name.startswith(d + ".")}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods) - {"dcp_jax"}  # the lazy face: `from dcp_jax import mesh` is dcp_jax.mesh
    return {m: imports_of(m, p, known) for m, p in mods.items()}


# -------------------------------------------------------------------------------------------------
# The layer table: the "## Layers" table of docs/ARCHITECTURE.md is the one statement of the
# layering, and this test reads it. A row is `| layer | modules | job |`, the bottom layer first. In
# the modules cell each backticked name is a path under dcp_jax/ (`pallas_kernels/...` is the
# top-level package); a name ending in "/" is a whole package; a bare file name after `dir/file.py`
# in the same row is in `dir/` too (`serving/config.py`, `request.py`: dcp_jax/serving/request.py).



def layer_table(text: str | None = None) -> list[tuple[str, list[str]]]:
    """[(layer, [dotted module or package names])], bottom first, from the "## Layers" section."""
    text = ARCHITECTURE.read_text() if text is None else text
    section = re.search(r"^## Layers\b.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"{ARCHITECTURE.relative_to(ROOT)} has no '## Layers' section"
    rows = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 2 or cells[0] in ("layer", ""):
            continue
        if set(cells[0]) <= set("-: "):  # the header's separator
            continue
        names, folder = [], ""
        for entry in re.findall(r"`([^`]+)`", cells[1]):
            path = entry if entry.startswith("pallas_kernels/") else "dcp_jax/" + entry
            if "/" in entry.rstrip("/"):
                folder = "" if entry.endswith("/") else entry.rsplit("/", 1)[0] + "/"
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


def table_entries() -> tuple[dict[str, int], list[str]]:
    """Each table entry's row index, and the rows' layer names."""
    rows = layer_table()
    entries = {}
    for i, (layer, names) in enumerate(rows):
        for n in names:
            assert n not in entries, \
                f"{n} is in two rows of the layer table: {rows[entries[n]][0]!r}, {layer!r}"
            entries[n] = i
    return entries, [layer for layer, _ in rows]


def layers(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[str]]:
    """Each module's row index in the table, and the rows' names. A package's __init__ not in the
    table only re-exports: it sits in the row of the highest module it imports."""
    entries, names = table_entries()
    out = {m: i for m in graph if (i := layer_of(m, entries)) is not None}
    packages = [m for m in graph if m not in out and modules()[m].name == "__init__.py"]
    for _ in packages:  # a re-export of a re-export settles in as many rounds as there are packages
        for m in packages:
            out[m] = max((out.get(d, 0) for d in graph[m]), default=0)
    return out, names


def test_layer_table_names_every_module_and_nothing_else():
    entries, _ = table_entries()
    mods = modules()
    unlisted = sorted(m for m, p in mods.items()
                      if p.name != "__init__.py" and layer_of(m, entries) is None)
    doc = ARCHITECTURE.relative_to(ROOT)
    assert not unlisted, (f"modules in no row of the layer table of {doc}: {unlisted}; add each to "
                          "the row of its layer")
    stale = sorted(n for n in set(entries) if n not in mods)
    assert not stale, f"the layer table names modules that do not exist: {stale}; fix the table"


def test_layer_table_parses_its_conventions():
    text = ("## Layers\n\n| layer | modules | job |\n|---|---|---|\n"
            "| low | `a.py`, `pallas_kernels/` | x |\n"
            "| mid | `serving/config.py`, `request.py`, `disagg/x.py`, `y.py` | y |\n"
            "| top | `dense.py`, `server/`, `llm.py` | z |\n\n## Next\n| no | `b.py` | |\n")
    assert layer_table(text) == [
        ("low", ["dcp_jax.a", "pallas_kernels"]),
        ("mid", ["dcp_jax.serving.config", "dcp_jax.serving.request", "dcp_jax.disagg.x",
                 "dcp_jax.disagg.y"]),
        ("top", ["dcp_jax.dense", "dcp_jax.server", "dcp_jax.llm"]),
    ]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    layer, names = layers(graph)
    return [f"{m} ({names[layer[m]]}) imports {d} ({names[layer[d]]})"
            for m in sorted(graph) for d in sorted(graph[m])
            if m in layer and d in layer and layer[d] > layer[m]]


def test_upward_import_is_found():
    graph = import_graph()
    graph["dcp_jax.mesh"] = graph["dcp_jax.mesh"] | {"dcp_jax.serving.runner"}
    found = upward_imports(graph)
    assert "dcp_jax.mesh (leaves) imports dcp_jax.serving.runner (serving)" in found


def test_every_import_points_down_the_layer_table():
    bad = upward_imports(import_graph())
    assert not bad, ("imports that point up the layer table of docs/ARCHITECTURE.md (a module may "
                     "import only from its own row and the rows above it):\n  " + "\n  ".join(bad)
                     + "\nmove the code it needs down, or, if the table is wrong, correct the "
                     "table and say why")


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

    for name in modules(PACKAGE):  # the entry points too: importing them runs nothing
        importlib.import_module(name)


def test_host_side_loads_no_model():
    # The scheduler, its requests and the KV manager are plain Python over integers: importing them
    # (through the lazy package face) loads neither flax nor the model.
    code = ("import sys, dcp_jax.serving.scheduler, dcp_jax.kv.manager; "
            "print(sorted(m for m in ('flax', 'dcp_jax.model', 'dcp_jax.llm', "
            "'dcp_jax.serving.runner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_package_face_is_lazy_and_complete():
    code = ("import sys, dcp_jax; before = 'flax' in sys.modules; "
            "from dcp_jax import LLM, SamplingParams, UserError, make_mesh, Engine, "
            "DisaggregatedLLM; "
            "print(before, 'flax' in sys.modules, LLM.__module__, Engine.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "dcp_jax.llm", "dcp_jax.dense"]
    import dcp_jax

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        dcp_jax.Nope  # noqa: B018


# -------------------------------------------------------------------------------------------------
# No function outgrows one screen: at most 80 lines (def to last line; a nested function is measured
# on its own too). A kernel's body is one traced program whose parts share its refs and block sizes,
# so a kernel may be longer when its reason is written here.
MAX_FUNCTION_LINES = 80
KERNEL_EXCEPTIONS = {
    "pallas_kernels.attention.reference.attention":
        "the CPU kernel and the oracle: the block walk and the page walk share one online "
        "softmax's carry and the paged, layered and 8-bit reads, traced as one program",
    "pallas_kernels.attention.triton._kernel":
        "one Pallas program: the KV split's visible blocks, the unmasked and masked loops and the "
        "write-out share the refs and the softmax carry",
    "pallas_kernels.attention.triton.attention":
        "the kernel's call: folds rows, picks blocks and splits, builds the grid's BlockSpecs for "
        "the paged, layered and 8-bit layouts, and merges the splits",
}


def function_lengths(name: str, path: Path) -> dict[str, int]:
    """`module.Class.function` (nested: `module.f.inner`) -> lines, for every def and async def."""
    out = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[qual] = child.end_lineno - child.lineno + 1
                walk(child, qual)
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), name)
    return out


def test_no_function_over_80_lines():
    assert all(n.startswith("pallas_kernels.") for n in KERNEL_EXCEPTIONS), \
        "KERNEL_EXCEPTIONS is for kernels (pallas_kernels/) only"
    allowed = dict(KERNEL_EXCEPTIONS)
    lengths = {q: n for m, p in modules().items() for q, n in function_lengths(m, p).items()}
    long = {q: n for q, n in lengths.items() if n > MAX_FUNCTION_LINES and q not in allowed}
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines: {long}; split each along its "
                      "seams (a helper per step it takes), or, for a kernel only, add it to "
                      "KERNEL_EXCEPTIONS in tests/test_imports.py with its reason")
    stale = sorted(q for q in allowed if lengths.get(q, 0) <= MAX_FUNCTION_LINES)
    assert not stale, f"exceptions whose function is gone or short enough now: {stale}; drop them"


# -------------------------------------------------------------------------------------------------
# Lines of at most 100 columns in new code, a ratchet: tests/fixtures/long_lines.json records, per
# file, how many of its lines were longer when the rule came in. No file may gain one; a file not in
# the record may have none.
MAX_COLUMNS = 100
LONG_LINES = ROOT / "tests" / "fixtures" / "long_lines.json"


def long_lines() -> dict[str, list[int]]:
    """Path -> the numbers of its lines over MAX_COLUMNS, for the project's Python files."""
    out = {}
    for folder in ("dcp_jax", "pallas_kernels", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            if numbers := [i for i, line in enumerate(lines, 1) if len(line) > MAX_COLUMNS]:
                out[str(path.relative_to(ROOT))] = numbers
    return out


def test_no_file_gains_lines_over_100_columns():
    record = json.loads(LONG_LINES.read_text())
    grown = [f"{path}: {len(numbers)} lines over {MAX_COLUMNS} columns, the record is "
             f"{record.get(path, 0)} (lines {', '.join(map(str, numbers))})"
             for path, numbers in long_lines().items() if len(numbers) > record.get(path, 0)]
    assert not grown, (f"lines over {MAX_COLUMNS} columns:\n  " + "\n  ".join(grown)
                       + f"\nwrap the lines you added to at most {MAX_COLUMNS} columns; a file "
                       f"whose count falls may lower its number in {LONG_LINES.relative_to(ROOT)}, "
                       "never raise it")


def test_no_file_points_outside_the_project():
    # The project stands on its own: no code, test or document cites a design document it does not
    # ship.
    hits = []
    for path in [*ROOT.glob("dcp_jax/**/*.py"), *ROOT.glob("tests/*.py"),
                 *ROOT.glob("scripts/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md",
                 *ROOT.glob("notebooks/*.ipynb")]:
        text = path.read_text()
        cites = "DESIGN" + ".md" in text or "../" + "shared" in text
        if path.name != Path(__file__).name and cites:
            hits.append(str(path.relative_to(ROOT)))
    assert not hits, hits
