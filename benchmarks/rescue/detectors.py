"""The grid of detectors x actions: ours through the library's ``TopoMonitor``, and the baselines."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baselines import (
    FoundryKillLossSpike,
    LightningSpikeDetection,
    MetricDetector,
    OlmoSkipStep,
    RecomputeStep,
    ZClip,
)
from engine import PlannedTopoDetector, TopoDetector
from faults import Architecture, Setup
from plans import plan_step


@dataclasses.dataclass(frozen=True)
class DetectorSpec:
    """One row of the grid: a detector, the action it takes, and how to build a fresh one."""

    detector: str
    action: str
    family: str  # "ours" (candidates for the default), "shipped" (the default as shipped), "control", "baseline"
    description: str
    make: Callable[[Architecture, Setup], Any]
    policy: dict[str, Any] | None = None  # ours: the TopoMonitor policy (check_every is the suite's)

    @property
    def key(self) -> str:
        return f"{self.detector}+{self.action}"


def _ours(policy: dict[str, Any], replay_data: bool = False) -> Callable[[Architecture, Setup], Any]:
    return lambda arch, setup: TopoDetector(dict(policy), setup.check_every, replay_data)


def ours(detector: str, action: str, description: str, policy: dict[str, Any]) -> DetectorSpec:
    """A row of ours: the library's monitor with ``policy``."""
    return DetectorSpec(detector, action, "ours", description, _ours(policy), policy)


#: The plans the shipped default's overhead budget makes for each setting on the development machine
#: (``plans.py``; ``benchmarks/DEFAULT_BUDGET.md``, stage 9).
PLANS = Path(__file__).resolve().parents[1] / "results" / "rescue_plans.json"


def planned(arch: Architecture, setup: Setup) -> PlannedTopoDetector:
    """The default rule as the shipped default runs it: the setting's stored plan, taken at the third check."""
    stored = json.loads(PLANS.read_text())["settings"][arch.name]
    plan = {key: stored["plan"][key] for key in ("intervals", "background", "lag", "probe_size")}
    return PlannedTopoDetector({}, setup.check_every, {**plan, "at_step": plan_step(setup.check_every)},
                               stored["costs"]["n"])  # fmt: skip


# Plain replay, the control for what skipping the bad window adds (training is deterministic: replaying the same
# batches from the same state meets the same fault): the default rule's trigger and rollback, but the data goes back
# with the state (the same batches again, in the same order), no updates skipped, no rate cut (the engine's actuator
# ignores the cuts the policy asks for from the second rollback on); after 4 rollbacks the stop.
PLAIN_REPLAY = {"rollback_lr_factor": None, "rollback_skip": 0}


# The library's rule before the default-rule issue (#22): diagram drift alone, z >= 4.5, with action rollback; no
# cut on the first rollback, no skip, 2 rollbacks, no sentinels. Kept as the row that shows what the change moved.
OLD_DEFAULT = {
    "channels": ["index"], "require": 1, "action": "rollback", "on_diverged": "rollback", "rollback_lr_factor": None,
    "rollback_skip": 0, "max_rollbacks": 2, "sentinels": False,
}  # fmt: skip

DETECTORS: dict[str, DetectorSpec] = {
    spec.key: spec
    for spec in [
        ours("ours_default", "rollback",
             "the library's default rule, nothing overridden (index and loss, require 2; rollback x0.5 compounding, "
             "skip 2 check intervals, max 4 rollbacks, then stop at the last healthy state; sentinels)",
             {}),
        DetectorSpec("ours_default_planned", "rollback", "shipped",
                     "the library's default rule at the shipped default's overhead budget: the plan the budget made "
                     "for the setting on the development machine (`rescue_plans.md`), followed from the third check",
                     planned, {}),
        ours("ours_default", "stop",
             "the default rule with action stop (restores the last healthy snapshot first)",
             {"action": "stop"}),
        ours("ours_default", "lower_lr",
             "the default rule with action lower_lr (x0.5, 3 cuts, then stop)",
             {"action": "lower_lr"}),
        ours("ours_no_sentinels", "rollback",
             "the default rule without the absolute sentinels",
             {"sentinels": False}),
        ours("ours_index_only", "rollback",
             "the default rule on the index alone (no loss confirmation)",
             {"channels": ["index"], "require": 1}),
        ours("ours_loss_only", "rollback",
             "the default rule's actions on the loss alone (what does the topology add?)",
             {"channels": ["loss"], "require": 1, "sentinels": False}),
        DetectorSpec("plain_replay", "rollback", "control",
                     "plain replay: the default rule's trigger and rollback, the same data again in the same order, "
                     "no skip, no rate cut (then stop after 4); the control for what the skip adds",
                     _ours(PLAIN_REPLAY, replay_data=True), PLAIN_REPLAY),
        ours("ours_old_default", "rollback",
             "the library's rule before #22 with rollback: drift alone, no first cut, no skip, 2 rollbacks",
             OLD_DEFAULT),
        DetectorSpec("lightning_spike", "stop", "baseline", "Lightning SpikeDetection defaults",
                     lambda arch, setup: LightningSpikeDetection()),
        DetectorSpec("olmo_skip", "skip", "baseline", "OLMo-core skip step (6 sigma, 128 steps)",
                     lambda arch, setup: OlmoSkipStep()),
        DetectorSpec("recompute", "recompute", "baseline",
                     "recompute the last step: OLMo-core's 6-sigma flag, the step's gradients computed again",
                     lambda arch, setup: RecomputeStep()),
        DetectorSpec("foundry_kill", "stop", "baseline", "llm-foundry KillLossSpike defaults, enabled",
                     lambda arch, setup: FoundryKillLossSpike()),
        DetectorSpec("zclip", "clip", "baseline", "ZClip z = 2.5, always on", lambda arch, setup: ZClip()),
        DetectorSpec("metric", "rollback_cut", "baseline", "standard metric: 4.5 robust z or 10 % from best",
                     lambda arch, setup: MetricDetector(arch.higher_is_better)),
    ]
}  # fmt: skip


# --- issue 35, item 5: the pre-registered candidates for the rule's two known holes (benchmarks/PREREGISTERED.md) ---
# (a) snapshot health from the watched channels only; (b) the rollback order b1-b4; (c) a stop that restores only
# when that keeps more than stopping where it is. 16 candidates, run on the design runs only; (a0, b1, c0) is today's.
ORDERS = {"b1": "skip_and_cut", "b2": "skip_if_confirmed", "b3": "from_second", "b4": "cut_if_refired"}


def candidate_policy(a: bool, b: str, c: bool) -> dict[str, Any]:
    """The policy overrides of candidate (a, b, c): only what differs from the library's defaults."""
    policy: dict[str, Any] = {}
    if a:
        policy["snapshot_health"] = "watched"
    if ORDERS[b] != "skip_and_cut":
        policy["rollback_order"] = ORDERS[b]
    if c:
        policy["stop_restores"] = "if_better"
    return policy


CANDIDATES: dict[str, DetectorSpec] = {
    spec.key: spec
    for spec in [
        DetectorSpec(f"cand_a{int(a)}_{b}_c{int(c)}", "rollback", "candidate",
                     f"candidate (a) {'on' if a else 'off'}, ({b}) {ORDERS[b]}, (c) {'on' if c else 'off'}",
                     _ours(candidate_policy(a, b, c)), candidate_policy(a, b, c))
        for a in (False, True) for b in ORDERS for c in (False, True)
    ]
}  # fmt: skip
#: Every row a cached run can belong to: the grid's and the candidates'.
ROWS: dict[str, DetectorSpec] = {**DETECTORS, **CANDIDATES}
