"""What the monitor costs a small CPU fit, what it says it costs, and what the overhead budget does about it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/budget_bench.py          # about 5 minutes on one core
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/budget_bench.py --quick  # a smoke run

The case of issue 24, as a new user would try it: an MLP on scikit-learn's digits (64 -> 512 -> 10, batch 64, SGD),
the 512-d hidden layer watched with a 512-point probe, ``check_every=10``, 400 steps of a real Lightning fit. Timed,
interleaved over repeats (the minimum of each, so that a busy neighbour affects them alike): no callback; the
callback with ``overhead_budget=None`` (the budget off: measured and logged only); the callback with
``overhead_budget=0.02``; and the same budget on a fit ten times as long (4,000 steps, against no callback for as
long), where the one-off costs (the first checks, the worker's start) weigh a tenth as much. For each: the wall time
against no callback, the monitor's own measure (its time over the training's own time, summed over the intervals
between checks with the first check's, as the end-of-run summary gives it; the callback's set-up is not in it), the
median interval's share (the steady state), the checks run, and the plan the budget chose.

Also the footprint model's check (``topocallbacks.budget.Footprint``): from one measured check at 512 points, the
predicted evaluation time at 256 and 128 points against the measured one (median of 5 each).
Writes benchmarks/results/budget.json and budget.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from sklearn.datasets import load_digits

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from topocallbacks import TopoMonitor  # noqa: E402
from topocallbacks.budget import Costs, Footprint  # noqa: E402
from topocallbacks.lightning import TopoCollapseCallback  # noqa: E402
from topocallbacks.summary import overhead_of  # noqa: E402


class DigitsMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU())
        self.head = torch.nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> tuple[torch.utils.data.DataLoader, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    return loader, x[:512]


def fit(callbacks: list, loader: Any, steps: int, make: Callable[[], pl.LightningModule] = DigitsMLP) -> float:
    """The wall time of a real Lightning fit of ``make()`` for ``steps`` on the CPU (its construction not timed)."""
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    module = make()
    start = time.perf_counter()
    trainer.fit(module, loader)
    return time.perf_counter() - start


def monitor_said(callback: TopoCollapseCallback) -> dict:
    """The monitor's own account (its time over the training's, summed over the intervals), checks, plans."""
    checks = [r for r in callback.monitor.history if r.kind == "check"]
    measured = overhead_of(checks)
    plans = [r.plan.as_dict() for r in checks if r.plan is not None]
    return {
        "logged_overhead": None if measured is None else measured[0],
        "median_interval": None if measured is None else statistics.median(measured[1]),
        "checks": [r.step for r in checks],
        "plans": plans,
    }


def plan_text(plan: dict[str, Any] | None, interval: str = "10 steps") -> str:
    """A budget's plan as the tables write it ("-": none)."""
    if plan is None:
        return "-"
    return (
        f"every {plan['intervals']} x {interval}, {'background' if plan['background'] else 'in the loop'}"
        + (f", decisions {plan['lag']} steps later" if plan.get("lag") else "")
        + (f", {plan['probe_size']} points" if plan["probe_size"] else "")
        + ("" if plan["met"] else " (budget not met)")
    )


def percent(share: float | None) -> str:
    """A share as the tables write it ("-": none)."""
    return "-" if share is None else f"{100 * share:.1f} %"


def footprint_check(probe: torch.Tensor, repeats: int) -> list[dict]:
    """Predicted against measured evaluation time at 256 and 128 points, from a measurement at 512."""
    model = DigitsMLP()
    with torch.no_grad():
        features = model.hidden(probe).numpy().astype(np.float64)
    measured = {}
    for n in (512, 256, 128):
        times = []
        for _ in range(repeats):
            monitor = TopoMonitor(check_every=1, background=False, policy={"action": "warn"})
            monitor.process(features[:n], 0)  # the first check pays one-off costs (ε, caches)
            record = monitor.process(features[:n] + 1e-3, 1)
            times.append(record.check_ms)
            monitor.close()
        measured[n] = statistics.median(times)
    model_512 = Footprint(Costs(1.0, 0.0, measured[512], 0.0, 512), check_every=1)
    return [
        {"n": n, "predicted_ms": round(model_512.eval_ms(n), 2), "measured_ms": round(measured[n], 2),
         "ratio": round(model_512.eval_ms(n) / measured[n], 3)}
        for n in (256, 128)
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    loader, probe = data()
    steps, repeats = (60, 1) if args.quick else (400, 3)
    long_steps = 10 * steps
    long_base = f"no callback, {long_steps} steps"

    def budgeted() -> list:
        return [TopoCollapseCallback(probe=probe, layer="hidden", check_every=10, overhead_budget=0.02)]

    configs = {  # name: (steps, callbacks, the configuration it is compared with)
        "no callback": (steps, list, "no callback"),
        "callback, budget off": (
            steps,
            lambda: [TopoCollapseCallback(probe=probe, layer="hidden", check_every=10, overhead_budget=None)],
            "no callback",
        ),
        "callback, overhead_budget=0.02": (steps, budgeted, "no callback"),
        long_base: (long_steps, list, long_base),
        f"callback, overhead_budget=0.02, {long_steps} steps": (long_steps, budgeted, long_base),
    }  # fmt: skip
    fit([], loader, 20)  # warm-up: imports, allocator
    times: dict[str, list[float]] = {name: [] for name in configs}
    said: dict[str, list[dict]] = {name: [] for name in configs}
    for repeat in range(repeats):
        for name, (n_steps, make, _) in configs.items():
            callbacks = make()
            times[name].append(fit(callbacks, loader, n_steps))
            if callbacks:
                said[name].append(monitor_said(callbacks[0]))
            print(f"repeat {repeat + 1}/{repeats}: {name}: {times[name][-1]:.2f} s", flush=True)
    rows = []
    for name, values in times.items():
        best, base = min(values), min(times[configs[name][2]])
        account = said[name][values.index(best)] if said[name] else None
        rows.append({
            "config": name,
            "steps": configs[name][0],
            "seconds": round(best, 3),
            "wall_overhead": round((best - base) / base, 4),
            "logged_overhead": None if account is None or account["logged_overhead"] is None
            else round(account["logged_overhead"], 4),
            "median_interval": None if account is None or account["median_interval"] is None
            else round(account["median_interval"], 4),
            "checks": None if account is None else len(account["checks"]),
            "last_plan": None if account is None or not account["plans"] else account["plans"][-1],
        })  # fmt: skip
    footprint = footprint_check(probe, 3 if args.quick else 5)
    payload = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/budget_bench.py" + (" --quick" if args.quick else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps": steps,
        "long_steps": long_steps,
        "repeats": repeats,
        "rows": rows,
        "footprint": footprint,
    }
    lines = [
        "# The monitor's cost on a small CPU fit, and the overhead budget",
        "",
        f"`{payload['command']}` ({payload['machine']}); digits MLP, 512-d layer watched, 512-point probe, "
        f"check_every=10, {steps} steps (and {long_steps}), the minimum of {repeats} interleaved runs each; the wall "
        "overhead against no callback for as many steps.",
        "",
        "| configuration | s / fit | wall overhead | monitor's own measure (in all) | median interval | checks "
        "| plan at the end |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        logged, median = percent(row["logged_overhead"]), percent(row["median_interval"])
        lines.append(
            f"| {row['config']} | {row['seconds']:.2f} | {100 * row['wall_overhead']:+.1f} % | {logged} | {median} | "
            f"{row['checks'] if row['checks'] is not None else '-'} | {plan_text(row['last_plan'])} |"
        )
    lines += ["", "Footprint model (evaluation time as (n / 512)^1.5 of a measured 512-point check):", "",
              "| points | predicted ms | measured ms | predicted / measured |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {f['n']} | {f['predicted_ms']} | {f['measured_ms']} | {f['ratio']} |" for f in footprint]
    args.out.mkdir(parents=True, exist_ok=True)
    name = "budget_quick" if args.quick else "budget"
    (args.out / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
