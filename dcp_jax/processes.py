"""Several processes on `jax.distributed`, for every entry point: the flags, their checks, joining the
runtime, and the supervisor that turns a lost peer into one line.

Every process runs the same command with its own `--process-id` (or `--distributed`, where JAX detects
the cluster). JAX's coordination service ends a process whose peer died or stalled with SIGABRT and a
C++ stack dump; so an entry point runs its share of the job in a child process (`supervise`), keeps the
child's stderr, and reports how it ended in one `error:` line (exit status 1). The child dies with
its supervisor, even one killed by SIGKILL (`die_with_supervisor`): none is left holding devices.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

from dcp_jax.cli import RUN_ERROR, UsageError, positive_int
from dcp_jax.mesh import DIST_TIMEOUT_S

WORKER = "DCP_JAX_DISTRIBUTED_WORKER"  # set in the supervised child
# in the supervised child: "<the supervisor's pid>:<the fd of a pipe whose writing end it holds>"
SUPERVISOR = "DCP_JAX_SUPERVISOR"
PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal this process gets when its parent ends
# what a step's error says when a collective lost its peer (JAX's CPU collectives run on gloo over TCP)
PEER_LOST = re.compile(r"Gloo|Connection reset by peer|Connection closed by peer|coordination service", re.I)


def add_distributed_args(p) -> None:
    d = p.add_argument_group("multi-process (jax.distributed)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address; every process runs the same command with its --process-id")
    d.add_argument("--num-processes", type=positive_int("--num-processes"), default=None)
    d.add_argument("--process-id", type=int, default=None)
    d.add_argument("--distributed", action="store_true",
                   help="join a cluster that jax.distributed.initialize detects by itself (SLURM, MPI, ...)")
    d.add_argument("--dist-timeout", type=positive_int("--dist-timeout"), default=DIST_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for peers at start, and to tolerate a silent peer later (default {DIST_TIMEOUT_S})")


def check_distributed_args(args) -> None:
    """Raise UsageError (one line) on an incomplete or inconsistent set of the flags."""
    explicit = (args.coordinator, args.num_processes, args.process_id)
    if any(x is not None for x in explicit) and any(x is None for x in explicit):
        raise UsageError("multi-process runs need all of --coordinator HOST:PORT, --num-processes N, --process-id I")
    if args.coordinator is not None:
        if ":" not in args.coordinator:
            raise UsageError(f"--coordinator takes HOST:PORT, got {args.coordinator!r}")
        if not 0 <= args.process_id < args.num_processes:
            raise UsageError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")


def is_multi(args) -> bool:
    return bool(args.distributed or (args.num_processes or 1) > 1)


def start(module: str, argv, args, mesh_devices: int | None, stream: bool = False) -> int | None:
    """An entry point's multi-process start, after its flags were checked. In the first process of this
    share of the job: run the job in a supervised child (`supervise`) and return its exit status. In
    that child: keep stdout for results (gloo logs on fd 1: it goes to stderr), join the runtime, each
    process simulating its share of the mesh's `mesh_devices` (default 8) on CPU, and return None. One
    process alone: nothing, None."""
    if not is_multi(args):
        return None
    if not os.environ.get(WORKER):
        return supervise(module, argv if argv is not None else sys.argv[1:], args, stream=stream)
    die_with_supervisor()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = results
    from dcp_jax import mesh as mesh_lib

    mesh_lib.init_distributed(args.coordinator, args.num_processes, args.process_id,
                              mesh_devices=mesh_devices or 8, timeout_s=args.dist_timeout)
    return None


def supervise(module: str, argv, args, stream: bool = False) -> int:
    """Run `python -m module argv` as this process's share of a multi-process job, in a child, and
    report how it ended in one line: its last `error:` line, or what ended it. `stream` (a server): the
    child's other stderr lines pass through as they come (the runtime's own logging and an abort's
    stack dump left out); else they are shown only when it succeeds. SIGTERM / SIGINT are passed on to
    the child (a server drains), and the child never outlives the supervisor, not even one killed by
    SIGKILL (`die_with_supervisor`)."""
    # the child gets the reading end of a pipe whose writing end only this process holds: EOF there
    # says this process is gone
    alive_r, alive_w = os.pipe()
    env = dict(os.environ, **{WORKER: "1", SUPERVISOR: f"{os.getpid()}:{alive_r}"})
    sys.stdout.flush()
    try:
        child = subprocess.Popen([sys.executable, "-m", module, *map(str, argv)], env=env,
                                 stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                 errors="replace", pass_fds=(alive_r,))
    except BaseException:
        os.close(alive_w)
        raise
    finally:
        os.close(alive_r)
    # signals reach the main thread only (and only it may set handlers): elsewhere none pass on
    main = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGTERM, signal.SIGINT) if main else ()
    forward = {sig: signal.signal(sig, lambda s, _f: child.send_signal(s)) for sig in sigs}
    errors, kept, failing, native = [], [], False, False
    try:
        for line in child.stderr:
            if line.startswith("error: "):
                errors.append(line.rstrip("\n"))
            # from the runtime's first error log line or our first error line on: its dump, then the end
            failing = failing or bool(errors) or bool(_NATIVE_ERROR.search(line))
            # a runtime log line and the lines it runs on to (up to a line of ours) stay out of view
            native = bool(_NATIVE_LOG.search(line)) or (native and not _OURS.match(line))
            if failing or native or "[Gloo]" in line or "peer ranks" in line or not _WORDS.search(line):
                continue
            if stream:
                sys.stderr.write(line)
            else:
                kept.append(line)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(alive_w)
        for sig, handler in forward.items():
            signal.signal(sig, handler)
    if child.returncode == 0:
        sys.stderr.write("".join(kept))
        return 0
    who = f"process {args.process_id}" if args.process_id is not None else "this process"
    if errors and PEER_LOST.search(errors[-1]):  # a collective failed mid-step: the peer went away
        print(f"error: {who} stopped: a peer process stopped during a step "
              f"({errors[-1].removeprefix('error: ')[:300]})", file=sys.stderr)
        return RUN_ERROR
    if errors:
        print(errors[-1], file=sys.stderr)
        return child.returncode if child.returncode > 0 else RUN_ERROR
    how = (f"was ended by {signal.Signals(-child.returncode).name}" if child.returncode < 0
           else f"exited with status {child.returncode}")
    print(f"error: {who} {how}: a peer process stopped or never reached the coordinator "
          f"{args.coordinator or '(auto-detected)'} within --dist-timeout {args.dist_timeout} s", file=sys.stderr)
    return RUN_ERROR


def die_with_supervisor() -> None:
    """In a supervised child, as early as it runs: end this process when its supervisor ends, even
    by SIGKILL (which runs none of the supervisor's cleanup). On Linux the kernel sends SIGKILL when
    the parent ends (PR_SET_PDEATHSIG); everywhere, a thread waits for EOF on a pipe whose writing
    end only the supervisor holds, and ends this process then. A supervisor gone before this ran
    (the parent is no longer the supervisor's pid) ends it at once. Outside a supervised child (no
    SUPERVISOR in the environment): nothing."""
    pid, _, fd = os.environ.pop(SUPERVISOR, "").partition(":")
    if not pid:
        return
    _set_pdeathsig()
    if os.getppid() != int(pid):
        os._exit(RUN_ERROR)

    def watch(fd: int) -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os._exit(RUN_ERROR)  # the supervisor is gone: nobody reads our stderr, no cleanup to report

    threading.Thread(target=watch, args=(int(fd),), name="dcp-jax-supervisor-gone",
                     daemon=True).start()


def _set_pdeathsig() -> bool:
    """Linux: SIGKILL this process when its parent thread ends (the one that started it, which waits
    in `supervise` while it runs). Elsewhere, or where libc has no prctl: False."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0) == 0


_WORDS = re.compile(r"[A-Za-z]{2}")  # a line without a word is a fragment of a native write (seen: "7")
_OURS = re.compile(r"^(INFO|WARNING|ERROR|CRITICAL|DEBUG):|^(serving |note: |error: |warning: )")  # Python-side lines
# absl's log line head (E1204 15:05:54.639188   16088 file.cc:1518]), found anywhere: the runtime's native
# writes may land on the end of another line
_ABSL = r"[{}]\d{{4}} \d\d:\d\d:\d\d\.\d+ +\d+ [\w./-]+:\d+\]"
_NATIVE_ERROR = re.compile(_ABSL.format("EF"))
_NATIVE_LOG = re.compile(_ABSL.format("EFWI") + r"|^(\s+@\s+0x|\*\*\* |=== Source Location|external/|RPC: "
                         r"|The tasks have crashed|\[type\.googleapis)")

