"""Multi-process runs on jax.distributed: 2 processes x 4 simulated CPU devices talking through gloo on
loopback give exactly the tokens of one process with 8 devices; lost peers end runs in bounded time."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

FIX = Path(__file__).parent / "fixtures" / "llama-gqa"
EXP = json.loads((FIX / "expected.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(process_id, port, *extra):
    argv = [sys.executable, "-m", "dcp_jax.generate", "--model", str(FIX), "--ignore-eos", "--json",
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
            *map(str, extra)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def prompts():
    return [a for p in EXP["prompts"] for a in ("--prompt-ids", ",".join(map(str, p)))]


@pytest.mark.parametrize("mesh", ["tp=2,dcp=4", "tp=1,dcp=8"])
def test_two_processes_match_one(mesh):
    port = free_port()
    procs = [launch(i, port, "--mesh", mesh, "--max-new-tokens", 8, *prompts()) for i in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    result = json.loads(outs[0][0])
    assert result["tokens"] == EXP["greedy"]  # == one process with 8 devices (test_generate)
    assert (result["stats"]["tp"] * result["stats"]["dcp"]) == 8
    assert outs[1][0] == ""  # only process 0 reports


def test_killed_peer_ends_the_other_in_bounded_time():
    port = free_port()
    args = ("--mesh", "tp=2,dcp=4", "--max-new-tokens", 3000, "--max-seq-len", 3072, "--dist-timeout", 10,
            "--prompt-ids", "1,2,3")
    procs = [launch(i, port, *args) for i in (0, 1)]
    time.sleep(15)  # both joined; compiling or decoding
    assert procs[0].poll() is None, procs[0].communicate()
    os.killpg(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    _, err = procs[0].communicate(timeout=120)
    elapsed = time.monotonic() - start
    procs[1].wait()
    assert procs[0].returncode == 1
    assert elapsed < 60, elapsed
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: process 0") and "peer process" in last, err[-2000:]
    assert "Traceback" not in err


def test_unreachable_coordinator_is_a_clear_error():
    start = time.monotonic()
    p = launch(1, free_port(), "--mesh", "tp=1,dcp=8", "--prompt-ids", "1,2", "--dist-timeout", 3)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and time.monotonic() - start < 60
    assert err.strip().splitlines() == [err.strip().splitlines()[-1]]  # one line
    assert err.startswith("error: process 1") and "never reached the coordinator" in err


@pytest.mark.parametrize("argv,message", [
    (["--coordinator", "127.0.0.1:1234"], "need all of --coordinator"),
    (["--coordinator", "nohostport", "--num-processes", "2", "--process-id", "0"], "takes HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in [0, 2)"),
])
def test_distributed_usage_errors(argv, message, capsys):
    from dcp_jax.generate import run

    assert run(["--model", str(FIX), "--prompt-ids", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_collective_that_lost_its_peer_is_reported_as_the_peer(monkeypatch, capsys):
    # A peer killed while a step's collective runs surfaces in the surviving process as a failed step
    # (gloo's "Connection reset by peer"), not as the coordination service's abort: both end in one line
    # that names the peer.
    import argparse
    import subprocess as sp

    from dcp_jax import generate

    class Child:
        returncode = 1

        def __init__(self, *a, **kw):
            pass

        def communicate(self):
            return None, ("error: the step failed on the server (JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: "
                          "Read error [127.0.0.1]:5559: Connection reset by peer)\n")

    monkeypatch.setattr(sp, "Popen", Child)
    args = argparse.Namespace(process_id=0, coordinator="127.0.0.1:1", dist_timeout=10)
    assert generate._supervise([], args) == generate.RUN_ERROR
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: process 0 stopped: a peer process stopped during a step")
