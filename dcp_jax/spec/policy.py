"""When speculation pays: the rule that turns it off for a while and tries it again (host, plain
Python; the scheduler asks it before each decode iteration and tells it what each one measured).

A verify step emits `a` tokens per sequence (the mean acceptance length) and costs `t_verify`; a
plain decode step emits one and costs `t_plain`. Speculation wins while

    gain = a · t_plain / t_verify  >=  1

Both step times are measured per batch-size bucket (1, 2-3, 4-7, ...: a step's cost depends on how
many sequences share it, and so does the ratio, which is what vLLM's `disable_by_batch_size` keys
on); `a` is one moving average over every verify step (it depends on the text, not the batch). A
missing figure is measured first: one speculative iteration, then one plain one (the first
iteration of each kind is not counted: a program's first run pays for allocations it keeps, so a
cold figure would misjudge it). When the gain falls below 1, speculation stops for `backoff` decode
iterations, then one iteration probes it again (a fresh acceptance and verify time, over at most
`probe_steps` verify steps); each failed probe doubles the backoff (up to `max_backoff`), a
successful one turns speculation back on and resets it. A probe that loses costs what its verify
steps take beyond decoding the same tokens plainly, and with a draft model what bringing its
cache up to date takes first,

    probe_loss = probe_steps · (t_verify - a · t_plain) + t_catch_up

(t_catch_up: with a draft model, the last probe's fill of its cache with what the plain iterations
before it wrote; it is left out of t_verify, which measures speculation running), so the backoff
is also at least the number of plain iterations over which that loss is a
`probe_share` of their time (probe_loss / (probe_share · t_iteration), t_iteration a plain
iteration's measured time): a speculation that loses badly (a draft model that costs four plain
steps and is never accepted) is probed rarely enough that its probes cost at most that share.

While speculation is on, a plain iteration
every `refresh` iterations keeps `t_plain` current (contexts grow, so step times do).

An iteration that also prefills is judged by its time, not its time per token: its prefill chunks
wait for its decode rows, which plainly take K - 1 loop steps (each row's first token rides the
ragged step beside the chunks) for K tokens a row. There speculation runs the most verify steps
that take no longer, v = floor((K - 1) · t_plain / t_verify), if they emit at least as many tokens
(v · a >= K); otherwise that iteration decodes plainly, and the rule stays on (`fit`).

`stats()` says what it did and why: iterations each way, switches, and the last switch's step and
reason, with the figures it was decided on.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Estimate:
    """A moving average (`alpha`: the weight of a new figure; the first is taken as it is)."""

    alpha: float = 0.5
    value: float | None = None

    def add(self, x: float, fresh: bool = False) -> None:
        old = self.value
        self.value = x if old is None or fresh else old + self.alpha * (x - old)


class SpecSwitch:
    """Speculate or decode plainly, per decode iteration, from measured step times and acceptance
    (see the module docstring). `enabled` False: always speculate (nothing measured)."""

    def __init__(self, enabled: bool = True, *, backoff: int = 4, max_backoff: int = 256,
                 refresh: int = 32, min_gain: float = 1.0, probe_steps: int = 2,
                 probe_share: float = 0.03):
        self.enabled, self.min_gain, self.probe_steps = enabled, min_gain, probe_steps
        self.probe_share = probe_share
        self.base_backoff, self.max_backoff, self.refresh = backoff, max_backoff, refresh
        self.backoff = backoff
        self.t_plain: dict[int, Estimate] = {}
        self.t_verify: dict[int, Estimate] = {}
        self.t_iteration: dict[int, Estimate] = {}  # a plain iteration's time (all its steps)
        self.accept = Estimate()
        self.catch_up = 0.0  # the last probe's draft-cache catch-up, seconds
        self.on = True  # speculating (or measuring) unless backing off
        self.off_until = 0  # the decode iteration from which a probe runs
        self.probing = False  # the last speculative iteration was a probe
        self.since_plain = 0  # speculative iterations since the last plain one
        self.iteration = 0
        self.warm: set[bool] = set()  # the kinds of iteration whose first (cold) run is past
        self.fitted: int | None = None  # verify steps fitted to this iteration's prefills (`fit`)
        self.counts = {"spec_on_iterations": 0, "spec_off_iterations": 0, "spec_switches": 0,
                       "spec_prefill_plain_iterations": 0}
        self.last_switch = ""

    @staticmethod
    def bucket(rows: int) -> int:
        """1, 2-3, 4-7, ... sequences: one bucket each."""
        return max(int(rows), 1).bit_length()

    def figures(self, rows: int) -> tuple[float, float, float] | None:
        """(a, t_plain, t_verify) at this batch size, or None until all three are measured."""
        key = self.bucket(rows)
        tp, tv = self.t_plain.get(key), self.t_verify.get(key)
        if tp is None or tv is None or self.accept.value is None:
            return None
        return self.accept.value, tp.value, tv.value

    def gain(self, rows: int) -> float | None:
        """a · t_plain / t_verify at this batch size, or None until all three are measured."""
        got = self.figures(rows)
        return None if got is None else got[0] * got[1] / got[2]

    def choose(self, rows: int, prefilling: bool = False, plain_steps: int = 0) -> bool:
        """Whether the next decode iteration (of `rows` sequences) speculates; `prefilling`: it
        also runs prefill chunks, whose plain decoding takes `plain_steps` tokens per row
        (`fit`)."""
        self.iteration += 1
        self.fitted = None
        speculate = self.decide(rows) if self.enabled else True
        if speculate and prefilling and self.enabled and not self.probing:
            speculate = self.fit(rows, plain_steps)
        self.counts["spec_on_iterations" if speculate else "spec_off_iterations"] += 1
        return speculate

    def fit(self, rows: int, plain_steps: int) -> bool:
        """Speculate in an iteration that prefills too? Its prefill chunks wait for its decode
        rows, so what counts is the iteration's time, not the time per token: plainly, a row's
        first token rides the ragged step and the other K - 1 take K - 1 loop steps. Speculate
        with the most verify steps that take no longer (`fitted`) if they emit at least K tokens
        per row; else decode plainly this iteration (not a switch: the rule stays on)."""
        got = self.figures(rows)
        if got is None or plain_steps < 2:
            return True  # (not measured yet: decide's order measures them)
        a, tp, tv = got
        steps = math.floor((plain_steps - 1) * tp / tv)
        if steps < 1 or steps * a < plain_steps:
            self.counts["spec_prefill_plain_iterations"] += 1
            return False
        self.fitted = steps
        return True

    def verify_steps(self, configured: int) -> int:
        """The verify steps of the iteration just chosen to speculate: `configured`, at most
        `probe_steps` for a probe, at most `fitted` in an iteration that prefills."""
        if self.probing:
            return min(configured, self.probe_steps)
        return configured if self.fitted is None else min(configured, self.fitted)

    def decide(self, rows: int) -> bool:
        key = self.bucket(rows)
        if not self.on:
            if self.iteration < self.off_until:
                return False
            self.probing = True  # the backoff is over: measure speculation afresh
            return True
        if key not in self.t_verify or self.accept.value is None:
            return True
        if key not in self.t_plain or self.since_plain >= self.refresh:
            return False
        gain = self.gain(rows)
        if gain < self.min_gain:
            self.switch(False, rows, gain)
            return False
        return True

    def observe(self, speculated: bool, rows: int, seconds: float, steps: int,
                tokens: int = 0, row_steps: int = 0, catch_up: float = 0.0) -> None:
        """What one decode iteration of `rows` sequences measured: its device time over its `steps`
        (decode steps, or verify steps); speculative: the `tokens` its `row_steps` (verify steps
        summed over the sequences) emitted, and `catch_up`, the seconds before its verify steps
        that brought a draft model's cache up to date after plain iterations (not in `seconds`:
        a cost of pausing, counted in a probe's loss)."""
        if not self.enabled or steps <= 0 or seconds <= 0:
            return
        if speculated not in self.warm:
            self.warm.add(speculated)
            return
        key = self.bucket(rows)
        per_step = seconds / steps
        if not speculated:
            self.t_plain.setdefault(key, Estimate()).add(per_step)
            self.t_iteration.setdefault(key, Estimate()).add(seconds)
            self.since_plain = 0
            return
        self.since_plain += 1
        fresh, self.probing = self.probing, False
        self.t_verify.setdefault(key, Estimate()).add(per_step, fresh)
        if row_steps:
            self.accept.add(tokens / row_steps, fresh)
        if fresh:  # a probe decides at once: back on, or off for twice as long
            self.catch_up = catch_up
            gain = self.gain(rows)
            if gain is None or gain >= self.min_gain:
                self.switch(True, rows, gain)
            else:
                self.switch(False, rows, gain)

    def switch(self, on: bool, rows: int, gain: float | None) -> None:
        """Record a decision (on after a probe, or off for `backoff` iterations)."""
        got = self.figures(rows)
        figures = "" if gain is None or got is None else (
            f": acceptance {got[0]:.2f} x plain step {1e3 * got[1]:.2f}"
            f" ms / verify step {1e3 * got[2]:.2f} ms = {gain:.2f}")
        if on:
            self.backoff = self.base_backoff
            if not self.on:
                self.counts["spec_switches"] += 1
                self.last_switch = f"on at decode iteration {self.iteration} ({rows} seqs{figures})"
            self.on = True
            return
        off = min(max(self.backoff, self.probe_budget(rows)), self.max_backoff)
        self.off_until = self.iteration + off
        self.last_switch = (f"off at decode iteration {self.iteration} for {off} "
                            f"({rows} seqs{figures} < {self.min_gain:g})")
        self.backoff = min(2 * self.backoff, self.max_backoff)
        if self.on:
            self.counts["spec_switches"] += 1
        self.on = False

    def probe_budget(self, rows: int) -> int:
        """The plain iterations over which a losing probe's cost is `probe_share` of their time
        (the module docstring); 0 until its figures are measured."""
        got, it = self.figures(rows), self.t_iteration.get(self.bucket(rows))
        if got is None or it is None:
            return 0
        a, tp, tv = got
        loss = self.probe_steps * (tv - a * tp) + self.catch_up
        return max(math.ceil(loss / (self.probe_share * it.value)), 0)

    def stats(self) -> dict:
        """Iterations speculated and not, switches, whether it is on now, and the last switch."""
        return dict(self.counts, spec_auto_off=self.enabled, spec_on=self.on,
                    spec_last_switch=self.last_switch)
