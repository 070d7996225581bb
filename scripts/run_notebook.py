"""Execute a notebook top to bottom in a fresh Jupyter kernel and save it with its outputs, tidied so it
reads well on GitHub (one stream output per cell, no ANSI colour codes, no timing metadata).

    python scripts/run_notebook.py notebooks/dcp_quickstart.ipynb
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class NotANotebook(ValueError):
    pass


def read(path: Path):
    """The notebook at `path`, or NotANotebook (its one-line message) when it is not one: not
    JSON, not UTF-8, or JSON that is no valid notebook."""
    import nbformat

    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except (ValueError, TypeError, KeyError, AttributeError, nbformat.ValidationError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise NotANotebook(f"{path} is not a Jupyter notebook ({reason}); give an .ipynb file"
                           ) from None
    return nb


def execute(path: Path, timeout: int = 300) -> float:
    """Run `path` in place; returns the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    nb = read(path)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - t
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        merged = []
        for out in cell.outputs:  # the kernel flushes a stream in pieces: one output reads better
            if out.output_type == "stream" and merged and merged[-1].output_type == "stream" \
                    and merged[-1].name == out.name:
                merged[-1].text += out.text
                continue
            if "data" in out and "text/plain" in out.data:
                out.data["text/plain"] = ANSI.sub("", out.data["text/plain"])
            merged.append(out)
        cell.outputs = merged
    nbformat.validate(nb)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # whole or not at all
    try:
        nbformat.write(nb, tmp)
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return seconds


def main(argv=None) -> int:
    from dcp_jax.cli import CliParser, UsageError, positive_int

    p = CliParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebook", type=Path)
    p.add_argument("--timeout", type=positive_int("--timeout"), default=300,
                   help="seconds per cell")
    try:
        args = p.parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.notebook.is_file():
        print(f"error: {args.notebook} is not a file; give a notebook's path", file=sys.stderr)
        return 2
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError as e:
        print(f"error: running a notebook needs {e.name}: pip install nbclient", file=sys.stderr)
        return 1
    try:
        read(args.notebook)  # not a notebook: one line before a kernel starts
    except NotANotebook as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = execute(args.notebook, args.timeout)
    print(f"executed {args.notebook} in {seconds:.1f} s; {args.notebook.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
