"""notebooks/dcp_quickstart.ipynb runs top to bottom in a real Jupyter kernel, and says what it should.

The notebook is executed from a temporary copy (the committed one, with its saved outputs, is left
alone) through nbclient and ipykernel's "python3" kernel. The kernel is a fresh process: it finds this
checkout through PYTHONPATH and runs on the CPU backend, so its first cell really is the first use of JAX.
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "dcp_quickstart.ipynb"


def cell_text(cell) -> str:
    """Everything a code cell printed or displayed as text."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    work = tmp_path_factory.mktemp("notebook")
    path = work / NOTEBOOK.name
    shutil.copy(NOTEBOOK, path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # run from scratch: no saved output may satisfy an assertion
        if cell.cell_type == "code":
            cell.outputs = []
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # (per cell: loading the real 30-layer model and compiling its two programs is the slowest)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(work)}})
    client.execute(env=env)  # raises CellExecutionError naming the cell if one fails (or times out)
    return nb


def test_runs_without_errors(executed):
    nb = executed
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


def test_first_cell_simulates_eight_devices(executed):
    nb = executed
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "ensure_cpu_devices(8)" in first.source
    assert "8 devices" in cell_text(first)


def test_key_outputs(executed):
    nb = executed
    text = "\n".join(cell_text(c) for c in nb.cells if c.cell_type == "code")

    # generation on the tp=2 x dcp=4 mesh, with its stats
    assert "mesh: {'tp': 2, 'dcp': 4}" in text
    assert re.search(r"^kv_bytes_per_device\s+\d+", text, re.M)

    # speculative decoding: both proposers give plain greedy decoding's tokens, n-gram drafts get accepted
    spec = re.findall(r"^(n-gram|draft model)\s+same tokens as plain: (\w+);\s+(\d+) of (\d+) drafts accepted", text, re.M)
    assert [(name, same) for name, same, _, _ in spec] == [("n-gram", "True"), ("draft model", "True")]
    assert int(spec[0][2]) > 0

    # the exact combine
    worst = float(re.search(r"worst max relative error: (\S+)", text).group(1))
    assert worst < 1e-5

    # round-robin placement is balanced, contiguous is not
    rows = dict(re.findall(r"^\s+(interleave=1|contiguous)\s+(\[[\d, ]+\])$", text, re.M))
    assert len(set(json.loads(rows["interleave=1"]))) == 1 and json.loads(rows["contiguous"]).count(0) > 0

    # KV bytes per device fall as 1/dcp (the pool's one reserved page aside)
    table = {(int(tp), int(dcp)): int(float(mib) * 2**20)
             for tp, dcp, mib in re.findall(r"^\d+x\d+\s+(\d+)\s+(\d+)\s+([\d.]+)", text, re.M)}
    assert {(1, 1), (1, 8), (2, 4), (4, 2)} <= set(table)
    for (tp, dcp), b in table.items():
        if tp == 1:
            assert table[1, 1] / b == pytest.approx(dcp, rel=0.05), (dcp, b)
    assert table[2, 4] == pytest.approx(table[1, 8], rel=0.05)  # 2 KV heads split over tp=2

    # the placement plot is there, and small
    pngs = [o.data["image/png"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "data" in o and "image/png" in o.data]
    assert len(pngs) == 1 and len(pngs[0]) < 100_000


def test_real_model_under_dcp(executed):
    # section 6: SmolLM2-135M-Instruct on tp=1 x dcp=4 answers a chat question greedily, and its
    # tokens' KV goes round robin over the 4 ranks
    nb = executed
    text = "\n".join(cell_text(c) for c in nb.cells if c.cell_type == "code")
    assert "mesh: {'tp': 1, 'dcp': 4} | 30 layers, 9 query / 3 KV heads" in text
    said = re.search(r"^(\d+) prompt tokens -> '(.*)' \((\w+)\)$", text, re.M)
    prompt, answer, reason = said.groups()
    assert "Paris" in answer and reason in ("stop", "length"), answer
    rows = re.findall(r"^\s+(\d+) '.*' +-> rank (\d), slot (\d+)$", text, re.M)
    placed = [tuple(map(int, row)) for row in rows]
    assert placed and placed[0][0] == int(prompt)
    assert all(rank == t % 4 and slot == t // 4 for t, rank, slot in placed), placed
    per_rank = re.search(r"^SmolLM2 tokens per rank \((\d+) tokens\): (\[[\d, ]+\])$", text, re.M)
    n, counts = int(per_rank.group(1)), json.loads(per_rank.group(2))
    assert len(counts) == 4 and sum(counts) == n == placed[-1][0] + 1
    assert max(counts) - min(counts) <= 1  # round robin
    assert re.search(r"^K pool: \(30, \d+, 3, 64, 64\) float32 spec: "
                     r"P\(None, 'dcp', 'tp', None, None\) \| per device: \(30, \d+, 3, 64, 64\)$",
                     text, re.M)


def test_committed_notebook_has_outputs_and_is_small():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs for c in code), "run the notebook and save its outputs"
    assert not any(o.output_type == "error" for c in code for o in c.outputs)
    assert NOTEBOOK.stat().st_size < 300_000
