"""The two server roles as two processes on loopback CPU devices: `python -m dcp_jax.serve --role prefill`
(tp=1 x dcp=2, pages of 3) and `--role decode --prefill-at` (tp=1 x dcp=4, interleave 2, pages of 4).
Greedy tokens equal transformers'; a mismatched or absent prefill instance stops the decode instance at
start-up with one line; a stalled prefill instance fails a request in bounded time and the decode
instance goes on; a decode side that never pulls has its offer dropped; a dead prefill instance fails
requests at once. Every wait is bounded and every child is killed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "llama-gqa"
EXP = json.loads((FIX / "expected.json").read_text())
TIMEOUT = 3  # --transfer-timeout of both roles
QUEUE_TIMEOUT = 5  # --prefill-queue-timeout of both roles


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEY = "pair-key"  # both roles take it from DCP_JAX_API_KEY: /v1 and the control channel need it
AUTH = {"Authorization": f"Bearer {KEY}"}


def env() -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             DCP_JAX_API_KEY=KEY)
    e["XLA_FLAGS"] = (e.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    return e


def spawn(*args) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dcp_jax.serve", "--model", str(FIX), "--max-model-len", "64",
            "--log-level", "warning", "--transfer-timeout", str(TIMEOUT), "--prefill-queue-timeout",
            str(QUEUE_TIMEOUT), *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            start_new_session=True)


def kill(p: subprocess.Popen) -> tuple[str, str]:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    return p.communicate(timeout=30)


def wait_up(p: subprocess.Popen, port: int, limit: float = 120) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if p.poll() is not None:
            raise AssertionError(f"the server exited: {p.communicate(timeout=10)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    kill(p)
    raise AssertionError("the server did not come up")


@pytest.fixture(scope="module")
def pair():
    pport, dport = free_port(), free_port()
    # (its KV transfer server bound to every address, reached by the name it advertises)
    prefill = spawn("--role", "prefill", "--mesh", "tp=1,dcp=2", "--page-size", 3, "--port", pport,
                    "--transfer-host", "0.0.0.0", "--transfer-advertise", "127.0.0.1")
    procs = [prefill]
    try:
        wait_up(prefill, pport)
        decode = spawn("--role", "decode", "--prefill-at", f"127.0.0.1:{pport}", "--mesh", "tp=1,dcp=4",
                       "--interleave", 2, "--page-size", 4, "--decode-steps", 2, "--port", dport)
        procs.append(decode)
        wait_up(decode, dport)
        yield dict(prefill=prefill, decode=decode, pbase=f"http://127.0.0.1:{pport}",
                   dbase=f"http://127.0.0.1:{dport}", pport=pport)
    finally:
        for p in procs:
            kill(p)


def complete(base, prompt, max_tokens, timeout=60, status=200) -> dict:
    body = dict(model=FIX.name, prompt=prompt, max_tokens=max_tokens, logprobs=1, temperature=0)
    answer = httpx.post(base + "/v1/completions", json=body, timeout=timeout, headers=AUTH)
    assert answer.status_code == status, answer.text
    return answer.json()


def ids(answer) -> list[int]:
    return [int(t) for t in answer["choices"][0]["logprobs"]["tokens"]]


def test_pair_matches_transformers_and_moves_the_prompt_kv(pair):
    n = EXP["max_new_tokens"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # at once: they decode together
        answers = list(pool.map(lambda p: complete(pair["dbase"], p, n), EXP["prompts"]))
    assert [ids(a) for a in answers] == EXP["greedy"]
    stats = httpx.get(pair["dbase"] + "/disagg/stats", timeout=10).json()
    assert stats["transfers"] == 3 and stats["failed"] == 0
    per_token = 2 * 2 * 2 * 8 * 4  # layers x (k, v) x kv heads x head dim x float32
    prompt = sum(map(len, EXP["prompts"])) * per_token
    assert prompt <= stats["transfer_bytes"] < prompt + 3 * 2 * 3 * per_token  # + under a page per source rank
    assert stats["source"]["dcp"] == 2 and stats["scheduler"]["pages_used"] == 0
    assert stats["source"]["transfer_address"].startswith("127.0.0.1:")  # the advertised name
    pre = httpx.get(pair["pbase"] + "/disagg/stats", timeout=10, headers=AUTH).json()
    assert pre["offered_bytes"] == stats["transfer_bytes"] and pre["pending_offers"] == 0
    # prompt scores would stay on the prefill instance: refused by name, and nothing is transferred
    bad = httpx.post(pair["dbase"] + "/v1/completions", timeout=30, headers=AUTH, json=dict(
        model=FIX.name, prompt=EXP["prompts"][0], max_tokens=1, echo=True, logprobs=1))
    assert bad.status_code == 400 and "prompt_logprobs (and echo with logprobs) are not supported" in bad.text


def test_a_decode_side_that_never_pulls_has_its_offer_dropped(pair):
    # Ask the prefill instance directly, as a decode instance would, then go away without pulling.
    items = [dict(request_id="gone", prompt_token_ids=[1, 2, 3, 4, 5])]
    offers = httpx.post(pair["pbase"] + "/disagg/prefill", json=dict(items=items), timeout=30,
                        headers=AUTH).json()["offers"]
    assert offers[0]["length"] == 5 and offers[0]["pieces"]
    stats = lambda: httpx.get(pair["pbase"] + "/disagg/stats", timeout=10, headers=AUTH).json()  # noqa: E731
    assert stats()["pending_offers"] == 1
    end = time.monotonic() + 10 * TIMEOUT
    while stats()["pending_offers"] and time.monotonic() < end:
        time.sleep(0.2)
    assert stats()["pending_offers"] == 0 and stats()["dropped_offers"] >= 1


def test_the_key_guards_v1_and_the_control_channel(pair):
    body = dict(model=FIX.name, prompt=[1, 2, 3], max_tokens=2)
    assert httpx.post(pair["dbase"] + "/v1/completions", json=body, timeout=30).status_code == 401
    for path in ("/disagg/handshake", "/disagg/stats"):
        r = httpx.get(pair["pbase"] + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(pair["pbase"] + path, timeout=30, headers=AUTH).status_code == 200
    assert httpx.get(pair["pbase"] + "/health", timeout=30).status_code == 200
    assert complete(pair["dbase"], [1, 2, 3], 2)["usage"]["completion_tokens"] == 2


def test_mismatch_and_absent_prefill_stop_the_decode_instance_at_start(pair):
    wrong = spawn("--role", "decode", "--prefill-at", f"127.0.0.1:{pair['pport']}", "--mesh", "tp=1,dcp=2",
                  "--dtype", "bfloat16", "--port", free_port())
    absent = spawn("--role", "decode", "--prefill-at", f"127.0.0.1:{free_port()}", "--mesh", "tp=1,dcp=2",
                   "--port", free_port())
    for p, words in ((wrong, "cannot pair: the prefill instance has KV dtype float32 but this decode instance "
                             "has bfloat16"),
                     (absent, "cannot pair with the prefill instance at 127.0.0.1:")):
        try:
            _, err = p.communicate(timeout=120)
        finally:
            kill(p)
        assert p.returncode == 1
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err[-2000:]


def test_a_burst_is_batched_at_the_prefill_instance_and_served(pair):
    # 12 requests at once while the prefill instance is paused for longer than --transfer-timeout: the
    # decode instance reserves pages for what its 8 slots hold and asks for those, the rest wait on its
    # side; the time the calls wait at the prefill instance counts against --prefill-queue-timeout, not
    # the transfer's. When it resumes, the waiting calls run as batches; every request is served
    # exactly, and the decode instance then serves normally with every page back.
    prompts = [EXP["prompts"][i % 3] for i in range(12)]
    n = EXP["max_new_tokens"]
    before = httpx.get(pair["pbase"] + "/disagg/stats", timeout=10, headers=AUTH).json()
    start = time.monotonic()
    os.killpg(pair["prefill"].pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, pair["dbase"], p, n) for p in prompts]
            time.sleep(TIMEOUT + 1)
            os.killpg(pair["prefill"].pid, signal.SIGCONT)
            answers = [f.result() for f in futures]
    finally:
        os.killpg(pair["prefill"].pid, signal.SIGCONT)
    wall = time.monotonic() - start
    assert [ids(a) for a in answers] == [EXP["greedy"][i % 3] for i in range(12)]
    after = httpx.get(pair["pbase"] + "/disagg/stats", timeout=10, headers=AUTH).json()
    batches = after["batches"] - before["batches"]
    assert after["requests"] - before["requests"] == 12 and batches < 12 and after["max_batch"] > 1
    assert after["queue_timeouts"] == before["queue_timeouts"] and after["pending_offers"] == 0
    print(f"burst: 12 requests served in {wall:.1f} s (prefill paused {TIMEOUT + 1} s), {batches} prefill batches, "
          f"largest {after['max_batch']}")
    assert ids(complete(pair["dbase"], EXP["prompts"][1], n)) == EXP["greedy"][1]
    stats = httpx.get(pair["dbase"] + "/disagg/stats", timeout=10).json()
    assert stats["scheduler"]["pages_used"] == 0 and stats["scheduler"]["reserved"] == 0


def test_stalled_then_dead_prefill_fails_requests_in_bounded_time(pair):
    os.killpg(pair["prefill"].pid, signal.SIGSTOP)  # stalled: alive, answers nothing
    try:
        # the server's failure (retry), within the queue's bound + the transfer's: a hang times out
        answer = complete(pair["dbase"], [9, 8, 7], 4, timeout=10 * TIMEOUT, status=503)
        message = answer["error"]["message"]  # the request's one-line error, as the API reports failed requests
        assert message.startswith("the prefill instance at 127.0.0.1:") and "did not answer /disagg/prefill" in message
    finally:
        os.killpg(pair["prefill"].pid, signal.SIGCONT)
    # it resumes: the decode instance goes on serving, with every page back
    assert ids(complete(pair["dbase"], EXP["prompts"][0], EXP["max_new_tokens"])) == EXP["greedy"][0]
    kill(pair["prefill"])  # dead: requests fail at once, the decode instance stays up
    answer = complete(pair["dbase"], [9, 8, 7], 4, timeout=10 * TIMEOUT, status=503)
    assert answer["error"]["message"].startswith("the prefill instance at")
    assert httpx.get(pair["dbase"] + "/health", timeout=10).status_code == 200
    stats = httpx.get(pair["dbase"] + "/disagg/stats", timeout=10).json()
    assert stats["scheduler"]["pages_used"] == 0 and stats["failed"] >= 2


@pytest.mark.parametrize("argv,message", [
    (["--role", "decode"], "--role decode needs --prefill-at HOST:PORT"),
    (["--prefill-at", "h:1"], "--prefill-at is for --role decode"),
    (["--role", "decode", "--prefill-at", "nohost"], "--prefill-at takes HOST:PORT"),
    (["--interleave", "2"], "--interleave applies to --role prefill and --role decode"),
    (["--role", "prefill", "--transfer-timeout", "0"], "--transfer-timeout must be > 0"),
    (["--role", "decode", "--prefill-at", "h:1", "--prefill-queue-timeout", "0"],
     "--prefill-queue-timeout must be > 0"),
    (["--role", "prefill", "--speculative", "ngram"], "--speculative is not supported with --role prefill"),
    (["--transfer-host", "0.0.0.0"], "--transfer-host and --transfer-advertise are for --role prefill"),
    (["--role", "prefill", "--host", "0.0.0.0"], "give --transfer-advertise HOST"),
    (["--role", "prefill", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"],
     "--role prefill runs on one process"),
])
def test_usage_errors(argv, message, capsys):
    from dcp_jax.serve import run

    assert run(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
