"""The overhead budget's plan for each setting of the rescue suite, as the shipped default makes it on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/plans.py            # the five design settings
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/plans.py --arch vit

The shipped default (`ScheduleSettings.overhead_budget`, 0.02) plans once, at the third check the schedule calls,
from what the two intervals before it cost (`topocallbacks.budget.Budget.measure`). The rescue suite's runs are
replayed from recorded trunks, so their own intervals cost nothing to measure; this script measures a setting's
costs the way the monitor counts them and asks the library's planner (`topocallbacks.budget.replan`, with the
options the default gives it: a free core for the worker, an automatic lag and probe size) for its plan:

* ``step_ms``: a training step (the suite's ``engine.measure_costs``, median of 7 after 3 warm-up steps);
* ``probe_ms``: the probe's forward pass (the same);
* ``eval_ms``: the library's evaluation of those features (``TopoMonitor.process`` at the default settings,
  median of 7 checks after 2 warm-up checks, one training step apart);
* ``other_ms``: one copy of the training state, which the default rule takes at each healthy check (the same).

Writes ``benchmarks/results/rescue_plans.{json,md}``: per setting the measured costs and the plan (its
``Plan.settings``, the ``plan=`` that makes a monitor follow it). The figures are this machine's: another machine,
or this one under load, plans otherwise (that is what the budget does).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from engine import measure_costs  # noqa: E402
from faults import ARCHITECTURES, FULL, RescueTrainee, Setup  # noqa: E402

from topocallbacks import TopoMonitor  # noqa: E402
from topocallbacks.budget import Costs, replan  # noqa: E402
from topocallbacks.check import Plan  # noqa: E402
from topocallbacks.settings import MonitorSettings  # noqa: E402

RESULTS = HERE.parent / "results"
STEM = "rescue_plans"
#: The rescue suite's design settings (the held-out GRU is not in its grid).
DESIGN = ("resnet", "vit", "gpt", "llama", "minilm")


def eval_ms(arch_name: str, setup: Setup, repeats: int = 7, warm: int = 2) -> tuple[float, int]:
    """Median milliseconds of the library's evaluation of a setting's probe features, and the probe's size."""
    trainee = RescueTrainee(ARCHITECTURES[arch_name], 0, "healthy", setup)
    monitor = TopoMonitor(check_every=setup.check_every, overhead_budget=None)
    times = []
    n = 0
    for i in range(warm + repeats):
        trainee.step(i)
        features = trainee.probe()
        n = len(features)
        started = time.perf_counter()
        monitor.process(features, step=(i + 1) * setup.check_every)
        if i >= warm:
            times.append((time.perf_counter() - started) * 1e3)
    return float(np.median(times)), n


def measured(arch_name: str, setup: Setup = FULL) -> dict[str, Any]:
    """A setting's costs (milliseconds) and the plan the shipped default's budget makes from them."""
    costs = measure_costs(ARCHITECTURES[arch_name], setup)
    evaluation, n = eval_ms(arch_name, setup)
    found = Costs(step_ms=costs["step_seconds"] * 1e3, probe_ms=costs["probe_seconds"] * 1e3, eval_ms=evaluation,
                  other_ms=costs["copy_seconds"] * 1e3, n=n)  # fmt: skip
    return {"costs": vars(found), "plan": plan_of(found, setup)}


def plan_step(check_every: int) -> int:
    """The step of the third check the schedule calls (checks from step 0), at which the budget plans."""
    return 2 * check_every


def plan_of(costs: Costs, setup: Setup) -> dict[str, Any]:
    """The shipped default's plan for ``costs`` (`Plan.settings` with ``at_step``, the third check's step, and
    what the planner predicted)."""
    s = MonitorSettings().merged({"check_every": setup.check_every})
    chosen, _ = replan(costs, setup.check_every, s.schedule.overhead_budget, Plan(), can_move=True, can_shrink=True,
                       lag=s.schedule.apply_lag, can_lag=True)  # fmt: skip
    return {"at_step": plan_step(setup.check_every), "intervals": chosen.intervals, "background": chosen.background,
            "lag": chosen.lag, "probe_size": chosen.probe_size, "predicted": round(chosen.predicted, 4),
            "met": chosen.met}  # fmt: skip


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"The shipped default's overhead budget ({100 * payload['budget']:g} %) planned for each rescue-suite setting "
        "from its costs on this machine (`benchmarks/rescue/plans.py`; one thread; milliseconds).",
        "",
        "| setting | step | probe pass | evaluation (n) | state copy | plan: every | lag | probe | predicted | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, found in payload["settings"].items():
        c, p = found["costs"], found["plan"]
        lines.append(
            f"| {name} | {c['step_ms']:.1f} | {c['probe_ms']:.1f} | {c['eval_ms']:.1f} ({c['n']}) | "
            f"{c['other_ms']:.1f} | {p['intervals']} x {payload['check_every']} steps | {p['lag']} | "
            f"{p['probe_size'] or c['n']} | {100 * p['predicted']:.1f} % | {'yes' if p['met'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    # The benchmarks' one writer of a JSON and its table; imported here because it loads Lightning, which the
    # rescue suite's jobs (importing `plan_step` through detectors.py) do not need.
    from default_budget import write

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="*", choices=DESIGN, default=list(DESIGN))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    settings = {}
    for name in args.arch:
        settings[name] = measured(name)
        print(name, settings[name], flush=True)
    payload = {"budget": MonitorSettings().schedule.overhead_budget, "check_every": FULL.check_every,
               "settings": settings}  # fmt: skip
    write(args.out / STEM, payload, markdown)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
