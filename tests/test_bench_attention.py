"""Smoke test of scripts/bench_attention.py --quick (no timings asserted)."""

import runpy
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_attention_quick(capsys):
    mod = runpy.run_path(str(SCRIPTS / "bench_attention.py"), run_name="bench_attention")
    assert mod["main"](["--quick", "--rounds", "1", "--layers", "2", "--pages-per-step", "4"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"short", "equal"}
    # pages read per layer (page walk / block walk): rows of unequal lengths read fewer pages by pages than
    # by blocks (every row up to the longest); 8 rows of 200 tokens (4 pages of 64) read 32 either way
    pages, blocks = int(rows["short"][3]), int(rows["short"][5])
    assert pages < blocks and rows["equal"][3:6] == ["32", "/", "32"]
    assert rows["short"][-1].endswith("x") and float(rows["short"][-1][:-1]) > 0


def test_bench_attention_bad_flags(capsys):
    mod = runpy.run_path(str(SCRIPTS / "bench_attention.py"), run_name="bench_attention")
    with pytest.raises(SystemExit) as e:
        mod["main"](["--rounds", "0"])
    assert e.value.code == 2 and "must be > 0" in capsys.readouterr().err
