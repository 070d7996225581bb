"""The lockstep protocol of several processes (dcp_jax.serving.lockstep), in one process: a leader engine
and a follower engine share a store; the follower replays the leader's commands and takes the same
steps. (tests/test_multiprocess.py runs it across real processes on jax.distributed.)"""

import threading

import numpy as np
import pytest

from dcp_jax import LLM
from dcp_jax.sampling import SamplingParams
from dcp_jax.serving.engine import run_requests
from dcp_jax.serving.lockstep import Lockstep, LockstepError, plan_digest
from dcp_jax.serving.request import Request
from tests.util import FIXTURES, LocalStore


def engines(*locksteps, **kw):
    """A leader and a follower engine, each with its lockstep side (given at construction)."""
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=2, max_num_seqs=3, decode_steps=3,
                   enable_prefix_caching=True, max_model_len=64, compile="lazy")
    locksteps = locksteps or (None, None)
    return [llm.engine_with(max_model_len=64, prefill_chunk=8, lockstep=ls,
                            **kw) for ls in locksteps]


def requests():
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 256, size=n)) for n in (21, 6, 14, 21, 9)]
    prompts[3][:16] = prompts[0][:16]  # a prefix hit
    out = [Request(f"r{i}", p, max_tokens=n, ignore_eos=True) for i, (p, n) in enumerate(zip(prompts, (9, 14, 6, 8, 12)))]
    # two seeded samples of one prompt (the second follows the first: its `follows` travels by id)
    out += Request.samples("n", prompts[2], 2, seed=5, sampling=SamplingParams(temperature=1.0), max_tokens=7,
                           ignore_eos=True)
    return out


def test_a_follower_takes_the_leaders_steps_and_gets_the_same_tokens():
    store = LocalStore()
    # tight: requests are preempted and recomputed
    leader, follower = engines(Lockstep(store, 0, timeout_s=60), Lockstep(store, 1, timeout_s=60),
                               num_pages=1 + 10)
    done = {}

    def follow():
        try:
            done["steps"] = follower.lockstep.follow(follower)
        except BaseException as e:  # noqa: BLE001 - reported below
            done["error"] = e

    thread = threading.Thread(target=follow)
    thread.start()
    reqs = requests()
    result = run_requests(leader, reqs, arrivals=[0, 0, 0, 0.05, 0.1, 0.1, 0.1])
    leader.abort("r1")  # (already finished: a no-op on both sides)
    leader.reset_prefix_cache()
    leader.lockstep.publish(stop=True)
    thread.join(120)
    assert "error" not in done, done
    assert result["preemptions"] > 0 and result["prefix_hit_tokens"] > 0
    assert done["steps"] == leader.scheduler.step > 0
    mine = {r.request_id: r for r in follower.lockstep.known.values()}
    assert sorted(mine) == sorted(r.request_id for r in reqs)
    assert {i: mine[i].output_token_ids for i in mine} == {r.request_id: r.output_token_ids for r in reqs}
    assert mine["n.1"].follows is mine["n.0"]  # resolved to the follower's own request
    assert follower.scheduler.stats()["pages_used"] == 0 and follower.scheduler.stats()["cached_blocks"] == 0
    assert leader.lockstep.messages == done["steps"] + 1  # one per step, and the stop (carrying the reset)


def test_a_plan_that_differs_from_the_leaders_is_an_error():
    store = LocalStore()
    leader, follower = engines(Lockstep(store, 0), Lockstep(store, 1, timeout_s=30), num_pages=64)
    follower.scheduler.add_request(Request("stray", [1, 2, 3], max_tokens=2))  # only the follower has it
    leader.add_request(Request("a", [4, 5, 6], max_tokens=2))
    leader.step()
    with pytest.raises(LockstepError, match="plan for step 1 differs from process 0's"):
        follower.lockstep.follow(follower)


def test_a_silent_leader_ends_a_follower_in_bounded_time():
    follower = Lockstep(LocalStore(), 1, timeout_s=0.3)
    with pytest.raises(LockstepError, match="heard nothing from process 0 for 0.3 s"):
        follower.receive()


def test_an_idle_leader_sends_heartbeats_and_a_failed_step_is_fatal(monkeypatch):
    store = LocalStore()
    leader, _ = engines(Lockstep(store, 0, timeout_s=40), None, num_pages=64)
    leader.lockstep.heartbeat()
    assert leader.lockstep.messages == 0  # not yet due: due 10 s (timeout / 4) after the last message
    leader.lockstep.last_sent -= 10
    leader.lockstep.heartbeat()
    assert leader.lockstep.messages == 1 and store.values["dcp_jax/lockstep/serve/0"]

    leader.add_request(Request("a", [4, 5, 6], max_tokens=2))

    def broken(*a, **kw):
        raise RuntimeError("Gloo all-reduce failed: Connection reset by peer")

    monkeypatch.setattr(leader.runner, "execute", broken)
    with pytest.raises(LockstepError, match="step 1 failed on process 0"):
        leader.step()
    assert leader.scheduler.pop_finished()[0].error_retryable  # its requests fail as the server's fault


def test_plan_digest_sees_the_block_table():
    leader, _ = engines(num_pages=64)
    leader.add_request(Request("a", [4, 5, 6], max_tokens=2))
    plan = leader.scheduler.schedule()
    before = plan_digest(plan)
    plan.block_table[0, 0] += 1
    assert plan_digest(plan) != before


def test_abort_reaches_a_request_held_outside_the_scheduler():
    # A disaggregated decode server holds a request outside the scheduler while its KV is on the way: an
    # abort through the AsyncEngine (its client went away) still finishes it; the leader records it by id.
    import asyncio

    from dcp_jax.serving.async_engine import AsyncEngine, _Tracked

    leader, _ = engines(Lockstep(LocalStore(), 0), None, num_pages=64)
    runner = AsyncEngine(leader)
    held = Request("held", [1, 2, 3], max_tokens=2)  # never added to the scheduler
    loop = asyncio.new_event_loop()
    runner.tracked["held"] = _Tracked(held, loop, asyncio.Queue())
    runner.abort("held", "the client went away")
    assert held.finish_reason == "abort" and held.error == "the client went away"
    assert leader.scheduler.pop_finished() == [held]
    assert leader.lockstep.journal == [("abort", "held", "the client went away")]
    loop.close()


def test_spmd_processes_check_each_plan_against_process_0s():
    # LLM.generate on several processes: every process makes the same calls and schedules them itself;
    # process 0 publishes each plan's digest and the others compare. The same requests agree; a process
    # given other requests stops with LockstepError at its first plan (not a hang in a collective).
    def run(engine, reqs, out):
        try:
            out["result"] = run_requests(engine, reqs)
        except LockstepError as e:
            out["error"] = e

    for differ in (False, True):
        store = LocalStore()
        leader, follower = engines(Lockstep(store, 0, spmd=True, name="llm1"),
                                   Lockstep(store, 1, timeout_s=30, spmd=True,
                                            name="llm1"), num_pages=64)
        mine, theirs = requests()[:3], requests()[:3]
        if differ:
            theirs = theirs[::-1]
        done = {}
        thread = threading.Thread(target=run, args=(follower, theirs, done))
        thread.start()
        run_requests(leader, mine)  # (differing: across processes its next collective would fail instead)
        thread.join(60)
        if differ:
            assert "plan for step 1 differs from process 0's" in str(done["error"])
        else:
            assert "error" not in done and [r.output_token_ids for r in theirs] == [r.output_token_ids for r in mine]
            assert leader.lockstep.journal == [] and leader.lockstep.messages == leader.scheduler.step
