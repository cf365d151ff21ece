"""The grid of detectors x actions: ours through the library's ``TopoMonitor``, and the baselines."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from baselines import FoundryKillLossSpike, LightningSpikeDetection, MetricDetector, OlmoSkipStep, ZClip
from engine import TopoDetector
from faults import Architecture, Setup


@dataclasses.dataclass(frozen=True)
class DetectorSpec:
    """One row of the grid: a detector, the action it takes, and how to build a fresh one."""

    detector: str
    action: str
    family: str  # "ours" or "baseline"
    description: str
    make: Callable[[Architecture, Setup], Any]
    policy: dict[str, Any] | None = None  # ours: the TopoMonitor policy (check_every is the suite's)

    @property
    def key(self) -> str:
        return f"{self.detector}+{self.action}"


def _ours(policy: dict[str, Any]) -> Callable[[Architecture, Setup], Any]:
    return lambda arch, setup: TopoDetector(dict(policy), setup.check_every)


def ours(detector: str, action: str, description: str, policy: dict[str, Any]) -> DetectorSpec:
    """A row of ours: the library's monitor with ``policy``."""
    return DetectorSpec(detector, action, "ours", description, _ours(policy), policy)


ROLLBACK = {"action": "rollback", "on_diverged": "rollback"}
ROLLBACK_CUT = {**ROLLBACK, "rollback_lr_factor": 0.5}
# Skip the updates of two check intervals after a rollback (PaLM skipped 200-500 batches after ~100-step rollbacks).
SKIP = {"rollback_skip": 20}
GRAD_NORM = {"channels": ["grad_norm"]}
COMBINATION = {"channels": ["index", "grad_norm", "loss"], "require": 1}

DETECTORS: dict[str, DetectorSpec] = {
    spec.key: spec
    for spec in [
        ours("ours_default", "rollback",
             "TopoMonitor default rule (diagram drift, z >= 4.5)",
             ROLLBACK),
        ours("ours_default", "rollback_cut",
             "default rule; rollback_lr_factor 0.5",
             ROLLBACK_CUT),
        ours("ours_default", "rollback_max4",
             "default rule; rollback, max_rollbacks 4 (not 2)",
             {**ROLLBACK, "max_rollbacks": 4}),
        ours("ours_default", "rollback_skip",
             "default rule; rollback, rollback_skip 20, max_rollbacks 4",
             {**ROLLBACK, **SKIP, "max_rollbacks": 4}),
        ours("ours_default", "rollback_cut_skip",
             "default rule; rollback, rollback_lr_factor 0.5, rollback_skip 20, max_rollbacks 4",
             {**ROLLBACK_CUT, **SKIP, "max_rollbacks": 4}),
        ours("ours_default", "lower_lr",
             "default rule; lower_lr (x0.5, 3 cuts, then stop)",
             {"action": "lower_lr"}),
        ours("ours_default", "stop",
             "default rule; stop",
             {"action": "stop"}),
        ours("ours_grad_norm", "rollback_cut",
             "policy channel grad_norm only",
             {**GRAD_NORM, **ROLLBACK_CUT}),
        ours("ours_grad_norm", "rollback_cut_skip",
             "policy channel grad_norm only; rollback_lr_factor 0.5, rollback_skip 20, max_rollbacks 4",
             {**GRAD_NORM, **ROLLBACK_CUT, **SKIP, "max_rollbacks": 4}),
        ours("ours_patience2", "rollback_cut_skip",
             "default rule held for 2 checks (patience 2); rollback_lr_factor 0.5, rollback_skip 20, max_rollbacks 4",
             {"patience": 2, **ROLLBACK_CUT, **SKIP, "max_rollbacks": 4}),
        ours("ours_index_and_loss", "rollback_cut_skip",
             "channels index and loss, both (require 2); rollback_lr_factor 0.5, rollback_skip 20, max_rollbacks 4",
             {"channels": ["index", "loss"], "require": 2, **ROLLBACK_CUT, **SKIP, "max_rollbacks": 4}),
        ours("ours_combination", "rollback_cut",
             "channels index, grad_norm, loss; require 1",
             {**COMBINATION, **ROLLBACK_CUT}),
        DetectorSpec("lightning_spike", "stop", "baseline", "Lightning SpikeDetection defaults",
                     lambda arch, setup: LightningSpikeDetection()),
        DetectorSpec("olmo_skip", "skip", "baseline", "OLMo-core skip step (6 sigma, 128 steps)",
                     lambda arch, setup: OlmoSkipStep()),
        DetectorSpec("foundry_kill", "stop", "baseline", "llm-foundry KillLossSpike defaults, enabled",
                     lambda arch, setup: FoundryKillLossSpike()),
        DetectorSpec("zclip", "clip", "baseline", "ZClip z = 2.5, always on", lambda arch, setup: ZClip()),
        DetectorSpec("metric", "rollback_cut", "baseline", "standard metric: 4.5 robust z or 10 % from best",
                     lambda arch, setup: MetricDetector(arch.higher_is_better)),
    ]
}  # fmt: skip
