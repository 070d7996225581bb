"""Execute a notebook top to bottom in a fresh Jupyter kernel and save it with its outputs, tidied so it
reads well on GitHub (one stream output per cell, no ANSI colour codes, no timing metadata).

    python scripts/run_notebook.py notebooks/dcp_quickstart.ipynb
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def execute(path: Path, timeout: int = 300) -> float:
    """Run `path` in place; returns the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
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
    nbformat.write(nb, path)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebook", type=Path)
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = p.parse_args(argv)
    if not args.notebook.is_file():
        print(f"error: {args.notebook} is not a file", file=sys.stderr)
        return 2
    seconds = execute(args.notebook, args.timeout)
    print(f"executed {args.notebook} in {seconds:.1f} s; {args.notebook.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
