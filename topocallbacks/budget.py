"""The overhead budget: what the monitor costs the training loop, predicted by a footprint model, kept under a share.

The plan says where checks are evaluated, how many probe samples they take, and how many check intervals apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .check import CheckRecord, Plan

__all__ = [
    "FLOOR_INTERVALS", "LAG_MARGIN", "MIN_PROBE", "Budget", "Costs", "Footprint", "Meter", "plan", "replan",
]  # fmt: skip

#: The safety floor: a check at least every this many configured intervals (``check_every``), whatever the budget.
#: The default rule's snapshots reach two healthy checks back and its skip covers two intervals: at 4 intervals the
#: rule still sees a fault within 4 x ``check_every`` steps of its onset and rolls back to a state from before it.
FLOOR_INTERVALS = 4
#: The fewest probe samples the budget goes down to (half of the 256-point diagram subsample a check takes).
MIN_PROBE = 128
#: The budget lengthens a background check's lag until the predicted evaluation, times this margin (the worker's
#: time varies from check to check), fits in the steps before its decision is applied.
LAG_MARGIN = 1.5
#: How the evaluation's cost grows with the probe size between the sizes the budget chooses from: pairwise
#: distances grow as n², the 256-point diagram subsample and the fixed costs slower (measured on a 512-d MLP layer:
#: 9.5, 30 and 85 ms at 128, 256 and 512 points; (n/512)^1.5 predicts 10.6 and 30).
EVAL_EXPONENT = 1.5


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one check interval cost, as measured on rank 0 (milliseconds).

    Attributes:
        step_ms: a training step's own time (the interval's wall time less the monitor's, per step).
        probe_ms: the probe pass (or the streaming copy).
        eval_ms: the evaluation of the check (the worker's own time in the background).
        other_ms: the rest of the monitor's time in the interval (snapshots, records, sinks, the steps' channels):
            its own time less the probe pass and the loop's wait for the evaluation.
        n: the probe samples of the check.
    """

    step_ms: float
    probe_ms: float
    eval_ms: float
    other_ms: float
    n: int


class Footprint:
    """The monitor's predicted cost per check interval, from one measured interval.

    The model, per check, with ``n`` probe samples, in milliseconds::

        probe(n) = probe_ms * n / n0                          (a forward pass: linear in the samples)
        eval(n)  = eval_ms * (n / n0) ** 1.5                  (EVAL_EXPONENT)
        loop(n)  = probe(n) + other_ms + (eval(n) in the loop, or max(0, eval(n) - lag * step_ms) beside it)
        share    = loop(n) / (intervals * check_every * step_ms)

    A worker beside the loop hides the evaluation while it takes less than the ``lag`` steps after which its
    decision is applied (it has a core of its own); beyond that the loop waits for the rest.

    Args:
        costs: a measured interval.
        check_every: the configured interval, in steps.
        lag: the steps a worker has before the loop waits for its check (``ScheduleSettings.apply_lag``), unless
            `share` is given another.
    """

    def __init__(self, costs: Costs, check_every: int, lag: int = 1) -> None:
        self.costs = costs
        self.check_every = check_every
        self.lag = lag

    def eval_ms(self, n: int) -> float:
        """The evaluation's predicted milliseconds at ``n`` probe samples."""
        c = self.costs
        return float(c.eval_ms * (n / c.n) ** EVAL_EXPONENT)

    def hiding_lag(self, n: int, intervals: int) -> int:
        """The fewest steps, from the footprint's lag up to the next check, that hide the evaluation at ``n``."""
        step_ms = max(self.costs.step_ms, 1e-6)
        needed = math.ceil(LAG_MARGIN * self.eval_ms(n) / step_ms)
        return int(min(max(self.lag, needed), intervals * self.check_every))

    def probe_ms(self, n: int) -> float:
        """The probe pass's predicted milliseconds at ``n`` probe samples."""
        return self.costs.probe_ms * n / self.costs.n

    def share(self, n: int, background: bool, intervals: int, lag: int | None = None) -> float:
        """The predicted share of the training step time the monitor costs (``lag``: None, the footprint's)."""
        c = self.costs
        interval_ms = intervals * self.check_every * max(c.step_ms, 1e-6)
        hidden_ms = (self.lag if lag is None else lag) * max(c.step_ms, 0.0)
        evaluation = max(0.0, self.eval_ms(n) - hidden_ms) if background else self.eval_ms(n)
        return (self.probe_ms(n) + c.other_ms + evaluation) / interval_ms


def plan(
    footprint: Footprint,
    budget: float,
    *,
    can_move: bool,
    can_shrink: bool,
    current: Plan,
    can_lag: bool = False,
) -> Plan:
    """The plan that keeps the monitor within ``budget``, adapting in this order, each only as far as needed.

    1. *where*: into the background worker, when ``can_move`` (the setting is automatic and a core is free): it
       changes nothing in what a check measures;
    2. *lag*: in the background, when ``can_lag`` (``lag`` is automatic), a decision is applied as many steps
       after its check as hide the evaluation (`LAG_MARGIN` times its prediction), at most until the next
       check: what a check measures is unchanged, its decision acts up to one interval later;
    3. *cadence*: more configured intervals between checks, up to `FLOOR_INTERVALS` (the safety floor);
    4. *probe size*: halved, down to `MIN_PROBE`, when ``can_shrink`` (the size is automatic and the warm-up
       is not over): a smaller probe restarts the calibration, so it comes last.

    When even the floor and the smallest probe miss the budget, that plan is returned with ``met`` False (the
    caller warns once). The cadence comes back down when the cost allows it.

    Examples:
        >>> costs = Costs(step_ms=10.0, probe_ms=1.0, eval_ms=80.0, other_ms=0.2, n=512)
        >>> p = plan(Footprint(costs, 10, lag=5), 0.05, can_move=True, can_shrink=True, current=Plan())
        >>> p.background, p.intervals, p.probe_size, p.met  # 80 ms outlast the 5 steps' 50 ms; 28 ms at 256 do not
        (True, 1, 256, True)
    """
    n0 = footprint.costs.n
    sizes = [n0]
    while can_shrink and sizes[-1] // 2 >= MIN_PROBE:
        sizes.append(sizes[-1] // 2)
    # Where first: beside the loop the evaluation costs the loop at most what it costs in it, never more.
    background = True if can_move else current.background
    best: Plan | None = None
    for n in sizes:  # the probe size last: only when no cadence up to the floor meets the budget with it
        for intervals in range(1, FLOOR_INTERVALS + 1):
            lag = footprint.hiding_lag(n, intervals) if background and can_lag else None
            share = footprint.share(n, background, intervals, lag)
            candidate = Plan(
                intervals=intervals,
                background=background,
                probe_size=None if n == n0 else n,
                predicted=share,
                met=share <= budget,
                lag=lag,
            )
            if candidate.met:
                return _keep_size(candidate, current)
            if best is None or share < best.predicted:
                best = candidate
    return _keep_size(best or current, current)


def _keep_size(candidate: Plan, current: Plan) -> Plan:
    """A plan never grows the probe back (that would restart the calibration again)."""
    if current.probe_size is not None and (candidate.probe_size is None or candidate.probe_size > current.probe_size):
        return dataclasses.replace(candidate, probe_size=current.probe_size)
    return candidate


def share_of(own_ms: float, train_ms: float) -> float | None:
    """The monitor's share of the training step time (None when nothing was measured)."""
    if train_ms <= 0 or not math.isfinite(own_ms):
        return None
    return own_ms / train_ms


class Meter:
    """Times the monitor's own share of the training loop: the wall time between two checks, less the monitor's.

    The monitor's entry points run inside `own` (nested calls count once); `interval`, at a check,
    gives what the interval since the check before cost and starts the next one.

    Args:
        clock: seconds, monotonic (``time.perf_counter``; a test passes its own).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._own = 0.0
        self._depth = 0
        self._entered = 0.0
        self._since: float | None = None
        self._since_step: int | None = None

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """The monitor's own time, for the outermost of nested calls."""
        if self._depth == 0:
            self._entered = self.clock()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._own += self.clock() - self._entered

    def interval(self, step: int) -> tuple[float | None, float | None, float]:
        """``(share, step_ms, own_ms)`` of the interval ending now, at the check of ``step`` (None: none measured)."""
        now = self.clock()
        running = now - self._entered if self._depth else 0.0
        own = self._own + running
        share = step_ms = None
        if self._since is not None and self._since_step is not None and step > self._since_step:
            train = (now - self._since) - own
            share = share_of(own, train)
            step_ms = max(train, 0.0) * 1e3 / (step - self._since_step)
        self._since, self._since_step = now, step
        self._own = -running  # the rest of the call under way counts in the next interval
        return share, step_ms, own * 1e3


def replan(
    costs: Costs,
    check_every: int,
    budget: float,
    current: Plan,
    *,
    can_move: bool,
    can_shrink: bool,
    lag: int = 1,
    can_lag: bool = False,
    kept_in_loop: str = "`background` is set",
) -> tuple[Plan, str | None]:
    """The plan after a measured interval, and a warning when it misses the budget (None: it meets it).

    ``kept_in_loop``: why the checks cannot move to the worker, when ``can_move`` is False (for the warning).
    """
    footprint = Footprint(costs, check_every, lag)
    chosen = plan(footprint, budget, can_move=can_move, can_shrink=can_shrink, current=current, can_lag=can_lag)
    if chosen.met:
        return chosen, None
    where = "in the training loop"
    if chosen.background:
        where = f"in the background with decisions applied {chosen.lag or lag} steps later"
    size = f"{chosen.probe_size or costs.n} probe samples"
    held = [] if can_move else [kept_in_loop]
    held += [] if can_shrink or chosen.probe_size else ["the probe size is set (or the warm-up is over)"]
    why = f" ({' and '.join(held)})" if held else ""
    return chosen, (
        f"topocallbacks: the overhead budget of {budget:.1%} of the step time cannot be met{why}: at the safety "
        f"floor of a check every {chosen.intervals} x check_every steps, {where}, on {size}, the monitor is "
        f"predicted to cost {chosen.predicted:.1%} (a training step takes {costs.step_ms:.3g} ms). Set "
        "`overhead_budget` higher, or None to turn it off, or check less often"
    )


def measured_costs(record: CheckRecord, step_ms: float, own_ms: float) -> Costs:
    """The `Costs` of the interval that ended with the check ``record``, the monitor's own time ``own_ms``."""
    return Costs(
        step_ms=step_ms,
        probe_ms=record.probe_ms,
        eval_ms=record.check_ms,
        other_ms=max(0.0, own_ms - record.probe_ms - record.wait_ms),
        n=max(record.n_points, 1),
    )


class Budget:
    """The overhead budget's part of a monitor: it measures each check interval and plans once (rank 0).

    The plan is made at the third check the schedule calls, on the cheaper of the two intervals before it (the
    first check pays one-off costs: imports, compilation, a worker starting), and kept for the rest of the run: a
    plan that followed every interval's timing would make the run's checks, and so its decisions, follow the
    machine's load. A plan given as ``plan=`` is taken instead, at its step, without measuring.

    Args:
        settings: the monitor's settings (``schedule.overhead_budget``; None: measure only).
    """

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.meter = Meter()
        self.free_core = (os.cpu_count() or 1) > torch.get_num_threads()  # a worker beside the loop gets a core
        self._scheduled: set[int] = set()  # the steps of pending checks the schedule called (on_step)
        self._previous: Costs | None = None  # the interval before: a plan needs two (one-off costs are not planned on)

    @property
    def may_move(self) -> bool:
        """Whether the budget may move the checks into the background worker.

        Then one starts beside the loop at the first check, so that it is ready when they move (a worker takes
        about a second to start). A given ``plan`` in the background starts one too.
        """
        schedule = self.settings.schedule
        if schedule.plan is not None:
            return bool(schedule.plan["background"]) and schedule.background is None
        return schedule.overhead_budget is not None and schedule.background is None and self.free_core

    def scheduled(self, step: int, by_schedule: bool) -> None:
        """Note a check submitted at ``step``: by the schedule (planned for) or by the caller (measured only)."""
        if by_schedule:
            self._scheduled.add(step)

    def measure(self, record: CheckRecord, schedule: Any, checks: int, worker: str = "ready") -> CheckRecord:
        """``record`` (a CheckRecord) with the interval's cost, and the plan when this check makes it (``record.plan``).

        ``checks``: the policy's checks so far (the probe may shrink only during the warm-up). ``worker``: the
        background worker is ``"ready"``, ``"starting"`` (the plan may move the checks to it all the same: until it
        is ready the runner evaluates them in the loop, their decisions applied at the plan's step) or ``"failed"``
        (they stay in the loop). Warns once when the plan misses the budget.
        """
        share, step_ms, own_ms = self.meter.interval(record.step)
        s, budget = self.settings, self.settings.schedule.overhead_budget
        planned = record.step in self._scheduled and schedule.plan.at_step is None  # one plan a run
        self._scheduled.discard(record.step)
        measured = dataclasses.replace(record, overhead=share, step_ms=step_ms)
        given = s.schedule.plan
        if given is not None:  # a recorded plan, followed again at its step: no measurement decides anything
            if not planned or record.step < given["at_step"]:
                return measured
            return dataclasses.replace(measured, plan=Plan(**{**given, "at_step": record.step}, predicted=0.0))
        if share is None or step_ms is None or budget is None or not record.ok or not planned:
            return measured
        costs_now = measured_costs(record, step_ms, own_ms)
        previous, self._previous = self._previous, costs_now
        if previous is None:  # the first checks pay one-off costs (compilation, caches): plan on two intervals
            return measured
        costs = min(previous, costs_now, key=lambda c: Footprint(c, s.schedule.check_every).share(c.n, False, 1))
        # An explicit `background` wins; otherwise the checks may move to a worker that started or is starting.
        can_move = self.may_move and (schedule.background or worker != "failed")
        kept_in_loop = (
            "`background` is set" if s.schedule.background is not None
            else "no core is free for a worker" if not self.free_core
            else "the background worker did not start"
        )  # fmt: skip
        can_shrink = s.probe.size is None and not schedule.streaming and checks <= s.rule.warmup
        chosen, why = replan(
            costs, s.schedule.check_every, budget, schedule.plan, can_move=can_move,
            can_shrink=can_shrink and record.n_points // 2 >= MIN_PROBE, lag=s.schedule.apply_lag,
            can_lag=s.schedule.lag is None, kept_in_loop=kept_in_loop,  # an explicit `lag` wins
        )  # fmt: skip
        if why is not None and not schedule.warned_:
            schedule.warned_ = True
            warnings.warn(why, RuntimeWarning, stacklevel=2)
        return dataclasses.replace(measured, plan=dataclasses.replace(chosen, at_step=record.step))
