"""The silence check of ``benchmarks/silent/PREREGISTERED.md``: is a scenario's fault silent to the loss, and harmful?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/silence.py --scenario vae_kl_bug --seeds 100 101 102

Per (scenario, seed) it records the pair of runs (``benchmarks/collapse/record.py``; into
``benchmarks/silent/recordings/``, not committed) and reads only the training loss and the harm metric: the
*loss-only rule* (the library's ``Policy`` on the training loss channel alone, no sentinels, at the default
threshold, warm-up and window) replayed on the mean loss since each check, and the *5 % point* (the first of two
consecutive checks after the fault at which the faulted run's harm metric is more than 5 % worse than its twin's).
A seed passes when the rule is quiet from the fault until the 5 % point and the point comes within the run (for the
generator scenarios, the twin also covers all 8 modes at every check after the fault). A scenario passes on >= 5 of
6 seeds. No candidate signal is computed here.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "collapse"))
sys.path.insert(0, str(HERE.parents[1]))

from cases import SCENARIOS  # noqa: E402

RECORDINGS = HERE / "recordings"
HARM = 0.05  # the 5 % point's relative margin
#: The held-out classes' scenarios: their check prints pass or fail only (PREREGISTERED.md).
HELD_OUT = frozenset(
    {"contrastive_no_negatives", "minilm_pairs_no_negatives", "minilm_forgetting", "trap_neural_collapse"}
)
#: Round 2's held-out scenarios (ROUND2.md): no probe features before its stage 2, but their tuning runs print the
#: 5 % point, the room and the loss-only rule's outcome, which its mechanical adjustment reads; they must have room.
ROUND_2 = frozenset({"classes_dropped", "finetune_forgetting_images", "trap_classes_added"})
#: Round 3's held-out scenarios (ROUND3.md): the same room rule, no probe features or logits kept before stage 2.
ROUND_3 = frozenset({"digits_class_dropped", "labels_merged", "trap_long_tail"})
#: Round 4's scenarios (ROUND4.md; the room rule holds for all of them) and its held-out ones (as round 3's).
ROUND_4_HELD_OUT = frozenset({"vicreg_variance_fade", "simsiam_predictor_fade", "trap_temperature_anneal"})
ROUND_4 = ROUND_4_HELD_OUT | {"simclr_negatives_fade", "simsiam_stopgrad_fade", "trap_simclr_to_supcon"}
#: Round 5's held-out scenarios (ROUND5.md; its design split is round 4's six): the same rules as round 4's.
ROUND_5_HELD_OUT = frozenset(
    {"barlow_redundancy_fade", "simclr_views_identical", "supcon_labels_shuffled", "trap_barlow_redundancy_rise"}
)
#: Round 6's held-out scenarios (ROUND6.md; its design split is rounds 4 and 5's): the same rules.
ROUND_6_HELD_OUT = frozenset({"supcon_watermark", "simclr_narrow_finetune", "trap_simclr_full_finetune"})
#: The rounds whose scenarios need room (ROUND2.md's rule).
NEED_ROOM = ROUND_2 | ROUND_3 | ROUND_4 | ROUND_5_HELD_OUT | ROUND_6_HELD_OUT
#: Room (ROUND2.md): the 5 % point comes at least this many checks after the fault step.
ROOM = 3


def loss_rule_alarms(check_steps: np.ndarray, loss: np.ndarray) -> list[int]:
    """The checks at which the loss-only rule warns, replayed on the mean loss since the previous check."""
    means = [None if i == 0 else float(np.mean(loss[int(check_steps[i - 1]) : int(step)]))
             for i, step in enumerate(check_steps)]  # fmt: skip
    return [int(step) for step, fired in zip(check_steps, loss_rule_fires(means), strict=True) if fired]


def loss_rule_fires(means: list[float | None]) -> list[bool]:
    """Where the loss-only rule (the library's ``Policy`` on the training loss channel alone, no sentinels, at the
    default threshold, warm-up and window) warns, over a run's mean losses since each previous check."""
    from topocallbacks.policy import Policy

    policy = Policy(channels=("loss",), require=1, sentinels=False, action="warn")
    return [policy.decide(i, None, loss=mean).fired for i, mean in enumerate(means)]


def harm_point(
    steps: np.ndarray, faulted: np.ndarray, twin: np.ndarray, fault: int, higher_is_better: bool
) -> int | None:
    """The 5 % point: the first of two consecutive checks after ``fault`` at which the faulted run is more than 5 %
    (relative) worse than its twin; None if it never comes."""
    sign = 1.0 if higher_is_better else -1.0
    worse = [
        int(s) > fault and sign * (f - t) < -HARM * abs(t) if math.isfinite(f) else int(s) > fault
        for s, f, t in zip(steps, faulted, twin, strict=True)
    ]
    for i in range(len(worse) - 1):
        if worse[i] and worse[i + 1]:
            return int(steps[i])
    return None


def check(path: Path) -> dict[str, Any]:
    """The silence check of one recording."""
    data = np.load(path)
    name, fault = str(data["scenario"]), int(data["fault_step"])
    steps = data["collapse/check_steps"]
    point = harm_point(steps, data["collapse/metric"], data["healthy/metric"], fault, bool(data["higher_is_better"]))
    alarms = [s for s in loss_rule_alarms(steps, data["collapse/loss"]) if s > fault]
    before = [s for s in alarms if point is None or s < point]
    twin_modes = True
    if name.startswith("generator_modes"):
        after = data["healthy/check_steps"] > fault
        twin_modes = bool((data["healthy/metric"][after] == 8).all())
    interval = int(steps[1] - steps[0])
    room = point is not None and point - fault >= ROOM * interval
    return {
        "scenario": name,
        "seed": int(data["seed"]),
        "fault_step": fault,
        # The checks a signal has to warn before the harm: those after the fault and before the 5 % point.
        "checks_before_harm": None if point is None else int(sum(fault < s < point for s in steps)),
        "five_percent_point": point,
        "loss_alarms_after_fault": alarms,
        "quiet": not before,
        "reached": point is not None,
        "twin_covers_modes": twin_modes,
        "room": room,
        "passed": not before and point is not None and twin_modes and (room or name not in NEED_ROOM),
    }


def drop_features(path: Path) -> None:
    """Rewrite a recording without its probe features (and LiDAR's views of them)."""
    with np.load(path) as data:
        kept = {key: data[key] for key in data.files if not key.endswith(("/features", "/views", "/outputs"))}
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **kept)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    from record import record, recording_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    faults = [name for name in SCENARIOS if not name.startswith("trap_")]  # traps have no fault to be silent about
    parser.add_argument("--scenario", nargs="*", choices=sorted(faults), default=faults)
    parser.add_argument("--seeds", nargs="*", type=int, default=[100, 101, 102])
    parser.add_argument("--out", type=Path, default=RECORDINGS)
    parser.add_argument("--force", action="store_true", help="re-record pairs that have a recording")
    args = parser.parse_args(argv)
    for name in args.scenario:
        results = []
        for seed in args.seeds:
            path = recording_path(name, seed, args.out)
            if args.force or not path.exists():
                record(name, seed, args.out, scenario=SCENARIOS[name])
                if (
                    name in HELD_OUT | ROUND_2 | ROUND_3 | ROUND_4_HELD_OUT | ROUND_5_HELD_OUT | ROUND_6_HELD_OUT
                ):  # no probe features of a held-out split before its stage 2
                    drop_features(path)
            results.append(check(path))
        for r in results:
            if name in HELD_OUT:
                print(f"{name} seed {r['seed']}: {'pass' if r['passed'] else 'FAIL'}")
            else:
                print(f"{name} seed {r['seed']}: {'pass' if r['passed'] else 'FAIL'}; 5 % point "
                      f"{r['five_percent_point']} ({r['checks_before_harm']} checks after the fault; room "
                      f"{r['room']}), loss alarms after the fault {r['loss_alarms_after_fault']}, "
                      f"twin covers its modes {r['twin_covers_modes']}")  # fmt: skip
        passed = sum(r["passed"] for r in results)
        print(f"{name}: {passed}/{len(results)} seeds pass")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
