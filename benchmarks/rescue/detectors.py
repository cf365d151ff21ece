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

    @property
    def key(self) -> str:
        return f"{self.detector}+{self.action}"


def _ours(policy: dict[str, Any]) -> Callable[[Architecture, Setup], Any]:
    return lambda arch, setup: TopoDetector(dict(policy), setup.check_every)


ROLLBACK = {"action": "rollback", "on_diverged": "rollback"}
ROLLBACK_CUT = {**ROLLBACK, "rollback_lr_factor": 0.5}
# Skip the updates of two check intervals after a rollback (PaLM skipped 200-500 batches after ~100-step rollbacks).
SKIP = {"rollback_skip": 20}
GRAD_NORM = {"channels": ["grad_norm"]}
COMBINATION = {"channels": ["index", "grad_norm", "loss"], "require": 1}

DETECTORS: dict[str, DetectorSpec] = {
    spec.key: spec
    for spec in [
        DetectorSpec("ours_default", "rollback", "ours", "TopoMonitor default rule (diagram drift, z >= 4.5)",
                     _ours(ROLLBACK)),
        DetectorSpec("ours_default", "rollback_cut", "ours", "default rule; rollback_lr_factor 0.5",
                     _ours(ROLLBACK_CUT)),
        DetectorSpec("ours_default", "rollback_max4", "ours", "default rule; rollback, max_rollbacks 4 (not 2)",
                     _ours({**ROLLBACK, "max_rollbacks": 4})),
        DetectorSpec("ours_default", "rollback_skip", "ours",
                     "default rule; rollback, rollback_skip 20, max_rollbacks 4",
                     _ours({**ROLLBACK, **SKIP, "max_rollbacks": 4})),
        DetectorSpec("ours_default", "rollback_cut_skip", "ours",
                     "default rule; rollback, rollback_lr_factor 0.5, rollback_skip 20, max_rollbacks 4",
                     _ours({**ROLLBACK_CUT, **SKIP, "max_rollbacks": 4})),
        DetectorSpec("ours_default", "lower_lr", "ours", "default rule; lower_lr (x0.5, 3 cuts, then stop)",
                     _ours({"action": "lower_lr"})),
        DetectorSpec("ours_default", "stop", "ours", "default rule; stop", _ours({"action": "stop"})),
        DetectorSpec("ours_grad_norm", "rollback_cut", "ours", "policy channel grad_norm only",
                     _ours({**GRAD_NORM, **ROLLBACK_CUT})),
        DetectorSpec("ours_grad_norm", "rollback_cut_skip", "ours",
                     "policy channel grad_norm only; rollback_lr_factor 0.5, rollback_skip 20, max_rollbacks 4",
                     _ours({**GRAD_NORM, **ROLLBACK_CUT, **SKIP, "max_rollbacks": 4})),
        DetectorSpec("ours_combination", "rollback_cut", "ours", "channels index, grad_norm, loss; require 1",
                     _ours({**COMBINATION, **ROLLBACK_CUT})),
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
