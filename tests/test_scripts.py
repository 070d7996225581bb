"""Smoke tests of the benchmark scripts' --quick modes (no timings asserted)."""

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_comm_quick_is_flat_in_context(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_comm.py", "--quick", "--json"])
    mod = runpy.run_path(str(SCRIPTS / "bench_comm.py"), run_name="bench_comm")
    assert mod["main"](["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["rows"]
    for key in ("tp", "dcp", "context", "variant", "collective_bytes_per_step"):
        assert all(key in r for r in rows)
    assert {r["variant"] for r in rows} == {"scatter", "psum", "all_to_all", "scatter+q_gather"}
    assert all(r["collective_bytes_per_step"] > 0 for r in rows)
    assert out["max_relative_change_over_context"] < 0.01
    by = {(r["tp"], r["dcp"], r["variant"], r["context"]): r for r in rows}
    total = {v: by[(2, 4, v, 4096)]["collective_bytes_per_step"] for v in ("scatter", "psum", "all_to_all",
                                                                            "scatter+q_gather")}
    # scatter moves fewer bytes than psum; all_to_all sends 1/dcp of the LSEs the scatter all-gathers;
    # q_gather adds an all-gather of q
    assert total["all_to_all"] < total["scatter"] < total["psum"]
    assert total["scatter"] < total["scatter+q_gather"]
    # the number of collectives a step launches is flat in context too; q_gather adds one all-gather per layer
    counts = {}
    for r in rows:
        counts.setdefault((r["tp"], r["dcp"], r["variant"]), set()).add(r["collectives_per_step"])
    assert all(len(c) == 1 for c in counts.values())
    q = by[(2, 4, "scatter+q_gather", 4096)]["count_all_gather"] - by[(2, 4, "scatter", 4096)]["count_all_gather"]
    assert q == by[(2, 4, "scatter", 4096)]["layers"]
    assert by[(2, 4, "all_to_all", 4096)]["bytes_all_to_all"] > 0
    assert "bytes_reduce_scatter" not in by[(2, 4, "all_to_all", 4096)]


def test_bench_comm_counts_every_element_of_a_long_tuple():
    mod = runpy.run_path(str(SCRIPTS / "bench_comm.py"), run_name="bench_comm")
    parts = [f"%p.{i} = f32[1,4]{{1,0}} parameter({i})" for i in range(8)]
    elems = ", ".join(("/*index=5*/" if i == 5 else "") + "f32[1,4]{1,0}" for i in range(8))
    ops = ", ".join(("/*index=5*/" if i == 5 else "") + f"%p.{i}" for i in range(8))
    hlo = "\n".join(parts + [f"%all-to-all = ({elems}) all-to-all({ops}), channel_id=1"])
    assert mod["collective_bytes"](hlo) == {"all-to-all": 8 * 16}
    assert mod["collective_counts"](hlo) == {"all-to-all": 1}


def test_each_layer_adds_only_the_combine_and_two_all_reduces():
    """The decode step's collectives per layer (tiny model, tp=2 x dcp=4): the combine's LSE all-gather
    and reduce-scatter, then the all-reduces after o_proj and down_proj. The residual stream stays
    replicated, so no norm, projection or MLP input needs a collective of its own."""
    import collections

    mod = runpy.run_path(str(SCRIPTS / "bench_comm.py"), run_name="bench_comm")

    def count(layers):
        return collections.Counter(mod["collective_counts"](mod["step_hlo"]("tiny", layers, 2, 4, 4096, "scatter", 1)))

    one, two = count(1), count(2)
    assert two - one == {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2}
    assert one - two == collections.Counter()


def test_bench_memory_quick(capsys):
    mod = runpy.run_path(str(SCRIPTS / "bench_memory.py"), run_name="bench_memory")
    assert mod["main"](["--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    for key in ("model", "tp", "dcp", "context", "kv_heads", "kv_bytes_per_device", "weight_bytes_per_device",
                "temp_bytes_per_device", "fits"):
        assert all(key in r for r in rows)
    for r in rows:  # XLA's figure equals the exact share
        assert r["kv_bytes_per_device"] * min(r["tp"], r["kv_heads"]) * r["dcp"] == r["kv_bytes_total"]
        assert r["weight_bytes_per_device"] > 0 and r["temp_bytes_per_device"] > 0
    tp_only = next(r for r in rows if r["dcp"] == 1)
    dcp8 = next(r for r in rows if r["dcp"] == 8)
    assert dcp8["weight_bytes_per_device"] > tp_only["weight_bytes_per_device"]  # dcp=8 does not split heads


def test_bench_compile_quick(capsys):
    mod = runpy.run_path(str(SCRIPTS / "bench_compile.py"), run_name="bench_compile")
    assert mod["main"](["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shallow, deep = out["rows"]
    assert (shallow["layers"], deep["layers"]) == (4, 32)
    # the same program whatever the depth (exact); the compile-time ratio is reported, not asserted
    assert shallow["decode_instructions"] == deep["decode_instructions"]
    assert shallow["prefill_instructions"] == deep["prefill_instructions"]
    assert out["ratio_deepest_to_shallowest"]["decode"] > 0
    assert {(r["engine"], r["scan_layers"]) for r in out["decode_speed"]} == {
        ("paged", True), ("paged", False), ("dense", True), ("dense", False)}  # (same tokens: asserted inside)


def test_bench_spec_quick(capsys):
    # both tasks on a 1 x 2 mesh, small: every speculative run gives plain decoding's tokens; the figures
    # (speed-ups) are reported, not asserted
    mod = runpy.run_path(str(SCRIPTS / "bench_spec.py"), run_name="bench_spec")
    argv = ["--quick", "--json", "--mesh", "1x2", "--context", "512", "--new-tokens", "24", "--repeats", "1"]
    assert mod["main"](argv) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = {"plain", "ngram", "ngram-always", "draft", "draft-always"}
    assert out["mismatches"] == [] and set(out["docs"]["runs"]) == kinds
    for task in ("docs", "repeat"):
        for name, r in out[task]["runs"].items():
            assert r["exact"] and r["decode_tokens_per_s"] > 0
            # the speed-up pairs each round with plain decoding's round beside it
            assert len(r["rounds_speedup"]) == 1 and r["speedup"] == pytest.approx(
                r["decode_tokens_per_s"] / out[task]["runs"]["plain"]["decode_tokens_per_s"])
            if name.endswith("-always"):  # every decode iteration speculates
                assert r["spec_drafted_tokens"] > 0 and r["mean_acceptance_length"] >= 1
                assert r["spec_off_iterations"] == 0
            elif name != "plain":  # the rule decided each iteration: counted either way
                assert r["spec_on_iterations"] + r["spec_off_iterations"] > 0


# --- user mistakes: one `error:` line on stderr, a non-zero exit, no traceback, nothing lost ---
def script_module(name: str):
    """scripts/NAME.py imported as a module (its functions patchable)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_error_line(err: str, message: str) -> None:
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


TINY_RUN = ["--steps", "2", "--batch", "1", "--eval-every", "2"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 2"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--seq-len", "0"], "--seq-len must be in [1, "),
    (["--lr", "0"], "--lr must be > 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
])
def test_train_tiny_flag_errors(capsys, argv, message):
    mod = script_module("train_tiny")
    assert mod.main(TINY_RUN + argv) == 2
    captured = capsys.readouterr()
    one_error_line(captured.err, message)
    assert captured.out == ""  # refused before the corpus is read or anything trains


def test_train_tiny_refuses_an_out_it_did_not_write(capsys, tmp_path):
    # the data loss this guards against: --out named a directory of the user's, which was deleted
    mod = script_module("train_tiny")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (tmp_path / "a_file").write_text("keep me too")
    for out, message in [(mine, f"--out {mine} holds files this script did not write"),
                       (tmp_path / "a_file", f"--out {tmp_path / 'a_file'} is a file"),
                       (tmp_path / "a_file" / "x", f"--out {tmp_path / 'a_file' / 'x'}: ")]:
        assert mod.main(TINY_RUN + ["--out", str(out)]) == 2
        captured = capsys.readouterr()
        one_error_line(captured.err, message)
        assert captured.out == ""  # before training
    assert (mine / "notes.txt").read_text() == "keep me" and [p.name for p in mine.iterdir()] == [
        "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "mine"]


def test_train_tiny_replaces_only_its_previous_output(tmp_path, monkeypatch):
    mod = script_module("train_tiny")
    assert mod.previous_output(mod.DEFAULT_OUT)  # the shipped model is this script's output
    out = tmp_path / "tiny"
    (out / "1").mkdir(parents=True)
    (out / "1" / "stale").write_text("old weights")
    (out / "training_log.json").write_text('{"config": {}, "train": []}')
    (tmp_path / "other.txt").write_text("keep")
    assert mod.out_problem(out) is None and mod.out_problem(tmp_path / "new" / "dir") is None

    def save(weights):
        def fake(model, path, tokenizer):  # what save_checkpoint leaves: a numbered step
            (path / "1").mkdir()
            (path / "1" / "weights").write_text(weights)
            if weights == "fails":
                raise OSError(28, "No space left on device")
            if weights == "raced":  # someone writes into --out while this run saves
                (out / "theirs.txt").write_text("theirs")
        monkeypatch.setattr(mod, "save_checkpoint", fake)

    def siblings():
        return sorted(p.name for p in tmp_path.iterdir())

    save("new weights")
    mod.save_output(out, None, {"config": {}, "train": [[1, 5.0]]})
    assert sorted(p.name for p in out.iterdir()) == ["1", "training_log.json"]
    assert (out / "1" / "weights").read_text() == "new weights"
    assert not (out / "1" / "stale").exists()
    assert mod.previous_output(out) and siblings() == ["other.txt", "tiny"]

    save("fails")  # a failed save leaves the previous output whole, and no temporary directory
    with pytest.raises(mod.UserError, match=f"--out {out}: cannot save the checkpoint"):
        mod.save_output(out, None, {"config": {}, "train": []})
    assert (out / "1" / "weights").read_text() == "new weights"
    assert siblings() == ["other.txt", "tiny"]

    save("raced")  # --out is no longer this script's alone: not replaced; the new output kept
    with pytest.raises(mod.UserError, match="holds files this script did not write.*kept in"):
        mod.save_output(out, None, {"config": {}, "train": []})
    assert (out / "theirs.txt").exists() and (out / "1" / "weights").read_text() == "new weights"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".tiny.new-")]
    assert len(kept) == 1 and (kept[0] / "1" / "weights").read_text() == "raced"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["--prompt-range", "5"], "--prompt-range takes MIN,MAX"),
    (["--prompt-range", "0,5"], "--prompt-range takes MIN,MAX"),
    (["--output-range", "1,8"], "--output-range takes MIN,MAX, two integers with 2 <="),
    (["--concurrency", "a,b"], "--concurrency takes comma-separated integers >= 1"),
    (["--workloads", "bogus", "--client", "http://127.0.0.1:1"],
     "--workloads: unknown workload 'bogus'; choose from short, mixed, long, real"),
    (["--client", "localhost:8000"], "--client takes a server's URL"),
    (["--repeat", "0"], "--repeat takes an integer >= 1"),
])
def test_bench_serving_flag_errors(capsys, argv, message):
    mod = runpy.run_path(str(SCRIPTS / "bench_serving.py"), run_name="bench_serving")
    with pytest.raises(SystemExit) as e:
        mod["main"](["--quick"] + argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    one_error_line(captured.err, message)
    assert captured.out == ""  # before anything runs


def test_bench_serving_client_with_nothing_there(capsys):
    mod = runpy.run_path(str(SCRIPTS / "bench_serving.py"), run_name="bench_serving")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as e:  # SystemExit(text): Python prints it, exit status 1
        mod["main"](["--quick", "--client", url])
    message = str(e.value.code)
    assert message.startswith(f"error: --client {url}: nothing answers at {url}/v1"), message
    assert "\n" not in message and "--client auto" in message
    assert "Traceback" not in capsys.readouterr().err


def test_run_notebook_refuses_what_is_not_a_notebook(capsys, tmp_path):
    mod = runpy.run_path(str(SCRIPTS / "run_notebook.py"), run_name="run_notebook")
    for name, content in [("junk.ipynb", b"junk text\nmore junk\n"), ("bin.ipynb", b"\x8c\x00\xff"),
                          ("empty.ipynb", b"{}"), ("list.ipynb", b'{"cells": 3}')]:
        path = tmp_path / name
        path.write_bytes(content)
        assert mod["main"]([str(path)]) == 2
        one_error_line(capsys.readouterr().err, f"{path} is not a Jupyter notebook (")
        assert path.read_bytes() == content
    assert mod["main"]([str(tmp_path / "missing.ipynb")]) == 2
    one_error_line(capsys.readouterr().err, f"{tmp_path / 'missing.ipynb'} is not a file")
    assert mod["main"]([str(path), "--timeout", "0"]) == 2
    one_error_line(capsys.readouterr().err, "argument --timeout: --timeout must be >= 1, got 0")
