"""Smoke test of scripts/bench_prefill_attention.py --quick (no timings asserted)."""

import json
import runpy
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load():
    return runpy.run_path(str(SCRIPTS / "bench_prefill_attention.py"), run_name="bench")


def test_bench_prefill_attention_quick(capsys):
    assert load()["main"](["--quick", "--rounds", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["context"], row["chunk"]) == (2048, 512) and "torch_s" not in row
    assert row["ours_s"] > 0 and row["dots_s"] > 0


@pytest.mark.parametrize("argv, says", [(["--rounds", "0"], "--rounds must be > 0"),
                                        (["--chunk", "1000"], "--chunk must divide --context")])
def test_bench_prefill_attention_bad_flags(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        load()["main"](argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
