"""A supervised child (`processes.supervise`) dies with its supervisor, even one killed by SIGKILL:
no server child is left behind as an orphan holding its devices."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run as `python -m sleeper PIDFILE [--no-pdeathsig]`: the first process is the supervisor
# (`processes.start` supervises), its child the worker, which writes its pid and sleeps. Joining the
# runtime is left out: the supervision is what is tested.
SLEEPER = """
import argparse, os, sys, time
from dcp_jax import mesh, processes
if "--no-pdeathsig" in sys.argv:  # the portable watchdog alone (the pipe's EOF)
    processes._set_pdeathsig = lambda: False
mesh.init_distributed = lambda *a, **kw: None
args = argparse.Namespace(distributed=False, num_processes=2, process_id=1,
                          coordinator="127.0.0.1:1", dist_timeout=10)
status = processes.start("sleeper", sys.argv[1:], args, None)
if status is not None:  # the supervisor
    sys.exit(status)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def env_with(path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DCP_JAX_DISTRIBUTED_WORKER",
                                                             "DCP_JAX_SUPERVISOR")}
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT)])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie, gone but not yet reaped), or None: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("extra", [[], ["--no-pdeathsig"]], ids=["pdeathsig", "pipe-eof"])
def test_the_worker_dies_with_its_supervisor_killed_by_sigkill(tmp_path, extra):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pidfile = tmp_path / "worker.pid"
    supervisor = subprocess.Popen([sys.executable, "-m", "sleeper", str(pidfile), *extra],
                                  env=env_with(tmp_path), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  start_new_session=True)  # its own group: cleaned up as one
    try:
        assert wait_for(pidfile.exists, 90), "the worker did not start"
        worker = int(pidfile.read_text())
        # the worker runs under its supervisor and outlives the start-up checks
        assert parent(worker) == supervisor.pid
        time.sleep(0.5)
        assert state(worker) not in (None, "Z")

        supervisor.kill()  # SIGKILL: none of the supervisor's own cleanup runs
        supervisor.wait(timeout=10)
        assert wait_for(lambda: state(worker) in (None, "Z"), 30), (
            f"the worker {worker} outlived its supervisor (state {state(worker)})")
    finally:
        try:
            os.killpg(supervisor.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        supervisor.communicate(timeout=10)


def test_a_worker_whose_supervisor_is_already_gone_ends_at_once(tmp_path):
    # The supervisor died before the worker could ask to die with it: the worker's parent is no
    # longer the supervisor's pid (here 0, which no parent is), so it ends with status 1 at once.
    code = ("import time; from dcp_jax import processes; processes.die_with_supervisor(); "
            "print('ran on'); time.sleep(60)")
    env = dict(env_with(tmp_path), DCP_JAX_SUPERVISOR="0:0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 1 and "ran on" not in done.stdout, done.stderr[-2000:]


def test_outside_a_supervised_child_nothing_changes(monkeypatch):
    from dcp_jax import processes

    monkeypatch.delenv(processes.SUPERVISOR, raising=False)
    before = threading.active_count()
    processes.die_with_supervisor()  # no supervisor named: no watchdog, no exit
    assert threading.active_count() == before
