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


def test_two_processes_match_one():
    # (tp=2 x dcp=4 on two processes: the server and LLM.generate tests below)
    port = free_port()
    procs = [launch(i, port, "--mesh", "tp=1,dcp=8", "--max-new-tokens", 8, *prompts()) for i in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    result = json.loads(outs[0][0])
    assert result["tokens"] == EXP["greedy"]  # == one process with 8 devices (test_generate)
    assert (result["stats"]["tp"] * result["stats"]["dcp"]) == 8
    assert outs[1][0] == ""  # only process 0 reports


def test_unreachable_coordinator_is_a_clear_error():
    p = launch(1, free_port(), "--mesh", "tp=1,dcp=8", "--prompt-ids", "1,2", "--dist-timeout", 3)
    _, err = p.communicate(timeout=120)  # (it gives up after its --dist-timeout, as it says below)
    assert p.returncode == 1
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


def supervise_child(monkeypatch, stderr: str, returncode: int, **kw) -> int:
    """`processes.supervise` over a fake child whose stderr is `stderr` and that exits with `returncode`."""
    import argparse
    import io
    import subprocess as sp

    from dcp_jax import processes

    class Child:
        returncode = None

        def __init__(self, *a, **kw):
            self.stderr = io.StringIO(stderr)

        def wait(self):
            self.returncode = returncode

        def poll(self):
            return self.returncode

    monkeypatch.setattr(sp, "Popen", Child)
    args = argparse.Namespace(process_id=0, coordinator="127.0.0.1:1", dist_timeout=10)
    return processes.supervise("dcp_jax.serve", [], args, **kw)


def test_a_collective_that_lost_its_peer_is_reported_as_the_peer(monkeypatch, capsys):
    # A peer killed while a step's collective runs surfaces in the surviving process as a failed step
    # (gloo's "Connection reset by peer"), not as the coordination service's abort: both end in one line
    # that names the peer.
    from dcp_jax.processes import RUN_ERROR

    assert supervise_child(monkeypatch, "[Gloo] Rank 0 is connected to 1 peer ranks.\n"
                           "error: the step failed on the server (JaxRuntimeError: UNKNOWN: Gloo all-reduce "
                           "failed: Read error [127.0.0.1]:5559: Connection reset by peer)\n", 1) == RUN_ERROR
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: process 0 stopped: a peer process stopped during a step")


def test_a_streamed_log_keeps_our_lines_and_drops_the_runtimes(monkeypatch, capsys):
    # A server's stderr passes through the supervisor: our lines stay; the runtime's log lines, the lines
    # they run on to and fragments of its writes (a line holding only "7" was seen in CI) do not.
    assert supervise_child(monkeypatch, "serving x on http://127.0.0.1:1/v1\n7\n"
                           "W1204 18:44:02.123456   1234 client.cc:99] Slow heartbeat\n"
                           "  detail the log line ran on to\nnote: ours again\n7\n\n", 0, stream=True) == 0
    assert capsys.readouterr().err.splitlines() == ["serving x on http://127.0.0.1:1/v1", "note: ours again"]


# --- the server on two processes -------------------------------------------------------------------

def serve(process_id, port, coordinator, *extra):
    argv = [sys.executable, "-m", "dcp_jax.serve", "--model", str(FIX), "--mesh", "tp=2,dcp=4", "--max-model-len", "64",
            "--page-size", "2", "--max-num-seqs", "4", "--decode-steps", "2", "--prefill-chunk", "8",
            "--port", str(port), "--log-level", "warning", "--coordinator", f"127.0.0.1:{coordinator}",
            "--num-processes", "2", "--process-id", str(process_id), *map(str, extra)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))


def wait_healthy(procs, base: str, what: str, limit_s: float = 240) -> None:
    """Until `base`/health answers 200 (an assertion error when one of `procs` exits or `limit_s` passes)."""
    import httpx

    deadline = time.monotonic() + limit_s
    while True:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.5)


class Pair:
    """A two-process server (process 0 serves HTTP) on loopback; every process group killed at the end."""

    def __init__(self, *extra):
        self.port, coordinator = free_port(), free_port()
        self.procs = [serve(i, self.port, coordinator, *extra) for i in (0, 1)]
        self.base = f"http://127.0.0.1:{self.port}"
        wait_healthy(self.procs, self.base, "the two-process server")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.communicate(timeout=60)


def completion_ids(client, prompt, n):
    r = client.completions.create(model="llama-gqa", prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    return [int(t) for t in r.choices[0].logprobs.tokens]


def mixed_requests():
    import numpy as np

    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 256, size=n)] for n in (5, 11, 17, 23, 30, 8, 14, 20, 26, 9, 12, 3)]
    for i in (3, 7, 10):  # prefix hits: the head of an earlier prompt
        prompts[i][:8] = prompts[i - 2][:8] if len(prompts[i - 2]) >= 8 else prompts[i][:8]
    prompts[11] = prompts[4][:20] + [7, 7, 7, 7, 7, 7]  # a repeated pattern for the n-gram proposer
    return prompts, [12, 8, 16, 10, 14, 6, 9, 13, 7, 11, 15, 10]


@pytest.fixture(scope="module")
def solo():
    """One process with 8 devices: the LLM, and each of `mixed_requests` alone, its greedy tokens up to the
    most any test here asks of it (a request of n tokens gets their first n)."""
    from dcp_jax import LLM

    prompts, lengths = mixed_requests()
    llm = LLM.load(FIX, tp=2, dcp=4, page_size=2, max_model_len=64)
    return llm, [llm.generate([p], max_new_tokens=max(lengths), ignore_eos=True).tokens[0] for p in prompts]


def first(tokens, lengths) -> list:
    return [t[:n] for t, n in zip(tokens, lengths, strict=True)]


def test_a_server_on_two_processes_gives_one_process_tokens(solo):
    # 2 processes x 4 simulated devices (tp=2 x dcp=4 over gloo), 12 concurrent requests of mixed lengths
    # through the openai client, a pool small enough to preempt, prefix caching and n-gram speculation:
    # every request's greedy tokens equal what one process with 8 devices gives it alone.
    import concurrent.futures as cf

    import httpx

    prompts, lengths = mixed_requests()
    llm, greedy = solo
    pair = Pair("--kv-cache-memory", llm.page_bytes() * 12, "--enable-prefix-caching", "--speculative", "ngram",
                "--num-speculative-tokens", 2)
    try:
        client = pair.client()
        with cf.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda a: completion_ids(client, *a), zip(prompts, lengths)))
        assert got == first(greedy, lengths)
        metrics = httpx.get(pair.base + "/metrics", timeout=30).text
        value = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                 if line.startswith("dcp_jax:") and " " in line}
        assert value["dcp_jax:num_preemptions_total"] > 0
        assert value["dcp_jax:prefix_cache_hits_total"] > 0
        assert value["dcp_jax:spec_decode_num_drafts_total"] > 0
        assert all(p.poll() is None for p in pair.procs)
        pair.procs[0].send_signal(signal.SIGTERM)  # the leader drains and tells the follower to stop
        outs = [p.communicate(timeout=120) for p in pair.procs]
        assert [p.returncode for p in pair.procs] == [0, 0], [o[1][-2000:] for o in outs]
        assert not any("Traceback" in err for _, err in outs)
    finally:
        pair.close()


def load_until_error(client, prompt, stop_after: float):
    """Send requests one after another until one fails (returns the error) or `stop_after` seconds pass."""
    import openai

    deadline = time.monotonic() + stop_after
    while time.monotonic() < deadline:
        try:
            completion_ids(client, prompt, 40)
        except openai.APIError as e:  # APIConnectionError (the process went) or a 5xx
            return e
    return None


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_lost_follower_ends_the_server_with_one_line(how):
    # The follower killed (or stopped) mid-load: process 0's clients get an error (not a hang), its
    # /health fails, and it exits with one line naming the peer within --dist-timeout (+ shutdown grace).
    import concurrent.futures as cf

    import httpx

    pair = Pair("--dist-timeout", 10)
    try:
        client = pair.client()
        with cf.ThreadPoolExecutor(3) as pool:
            loads = [pool.submit(load_until_error, client, [1 + i, 2, 3], 150) for i in range(3)]
            time.sleep(3)
            os.killpg(pair.procs[1].pid, how)
            errors = [f.result(timeout=150) for f in loads]
        assert all(e is not None for e in errors), errors
        _, err = pair.procs[0].communicate(timeout=120)
        assert pair.procs[0].returncode == 1, err[-2000:]
        # its stderr: the start-up line, then one error line (no runtime log, no stack dump, no traceback)
        lines = [line for line in err.strip().splitlines() if not line.startswith("serving ")]
        assert len(lines) == 1 and lines[0].startswith("error: process 0") and "peer process" in lines[0], err[-3000:]
        with pytest.raises(httpx.TransportError):
            httpx.get(pair.base + "/health", timeout=5)
    finally:
        if how == signal.SIGSTOP and pair.procs[1].poll() is None:
            os.killpg(pair.procs[1].pid, signal.SIGCONT)
        pair.close()


# --- LLM.generate on two processes (every process makes the same calls) ------------------------------

SPMD = """
import json, sys
from dcp_jax import LLM
from dcp_jax.serving.lockstep import LockstepError
pid, port, out_path, prompts, pages = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
llm = LLM.load({fix!r}, tp=2, dcp=4, page_size=2, max_model_len=64, max_num_seqs=4,
               num_pages=pages, speculative="ngram", num_speculative_tokens=2, dist_timeout=20,
               coordinator="127.0.0.1:" + port, num_processes=2, process_id=pid)
try:
    out = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
except LockstepError as e:
    print("error:", e, file=sys.stderr)
    sys.exit(1)
open(out_path, "w").write(json.dumps(dict(tokens=out.tokens, stats=out.stats)))
"""


def spmd_pair(tmp_path, prompts, pages):
    port = free_port()
    code = SPMD.format(fix=str(FIX))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), str(port), str(tmp_path / f"out{i}.json"),
                               json.dumps(prompts), str(pages)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu")) for i in (0, 1)]
    try:
        return procs, [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_llm_generate_on_two_processes_gives_one_process_tokens(tmp_path, solo):
    prompts, _ = mixed_requests()
    procs, errs = spmd_pair(tmp_path, prompts, 14)
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in (0, 1)]
    assert outs[0]["tokens"] == outs[1]["tokens"] == first(solo[1], [12] * len(prompts))
    assert outs[0]["stats"]["preemptions"] > 0 and outs[0]["stats"]["prefix_hit_tokens"] > 0
    assert outs[0]["stats"]["spec_verify_steps"] > 0


def test_a_lost_leader_ends_the_follower_with_one_line():
    pair = Pair("--dist-timeout", 10)
    try:
        os.killpg(pair.procs[0].pid, signal.SIGKILL)
        _, err = pair.procs[1].communicate(timeout=120)
        assert pair.procs[1].returncode == 1, err[-2000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: process 1"), err[-3000:]
    finally:
        pair.close()


# --- a disaggregated pair whose decode instance is two processes --------------------------------------

def test_a_decode_instance_on_two_processes_pulls_each_process_its_share(solo):
    # A prefill instance (one process, tp=1 x dcp=2, pages of 4) and a decode instance on two processes
    # (tp=2 x dcp=4, pages of 2: each process keeps one of the two kv heads over all four context ranks):
    # 12 concurrent requests through the openai client get the tokens one process with 8 devices gives
    # them alone, and each decode process pulls only its own devices' share of every prompt's KV.
    import concurrent.futures as cf

    import httpx

    prompts, lengths = mixed_requests()
    llm, greedy = solo
    cfg = llm.model.config
    pport = free_port()
    prefill = subprocess.Popen([sys.executable, "-m", "dcp_jax.serve", "--role", "prefill", "--model", str(FIX),
                                "--mesh", "tp=1,dcp=2", "--page-size", "4", "--max-model-len", "64", "--port", str(pport),
                                "--log-level", "warning", "--transfer-timeout", "20"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env=dict(os.environ, JAX_PLATFORMS="cpu"))
    pair = None
    try:
        wait_healthy([prefill], f"http://127.0.0.1:{pport}", "the prefill instance")
        pair = Pair("--role", "decode", "--prefill-at", f"127.0.0.1:{pport}", "--transfer-timeout", 20)
        client = pair.client()
        with cf.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda a: completion_ids(client, *a), zip(prompts, lengths)))
        assert got == first(greedy, lengths)
        stats = httpx.get(pair.base + "/disagg/stats", timeout=30).json()
        by_process = {int(p): b for p, b in stats["bytes_by_process"].items()}
        # each process keeps one kv head: half of every prompt's KV, plus at most the zero padding of the
        # source's last page on each source rank (a source page of 4 slots per rank, half the heads)
        tb = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # one token, every kv head, k and v
        half = sum(len(p) for p in prompts) * tb // 2
        pad = len(prompts) * 2 * 4 * tb // 2
        assert sorted(by_process) == [0, 1]
        assert all(half <= b <= half + pad for b in by_process.values()), (by_process, half, pad)
        assert by_process[0] == stats["transfer_bytes"]  # (every request admitted: all it pulled was counted)
        pair.procs[0].send_signal(signal.SIGTERM)  # the leader drains and tells the follower to stop
        outs = [p.communicate(timeout=120) for p in pair.procs]
        assert [p.returncode for p in pair.procs] == [0, 0], [o[1][-2000:] for o in outs]
        assert not any("Traceback" in err for _, err in outs)
    finally:
        if pair is not None:
            pair.close()
        if prefill.poll() is None:
            os.killpg(prefill.pid, signal.SIGKILL)
        prefill.communicate(timeout=60)
