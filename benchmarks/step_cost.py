"""Where a case's extra wall-clock goes: the callback's own hooks, or training steps that run slower beside it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_cost.py                 # gpt_default, 300 steps, 2 pairs
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_cost.py --steps 700     # its background checks too (~20 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_cost.py --case mlp_1ms --steps 40 --pairs 1 --out /tmp/x

Stage 8 of ``DEFAULT_BUDGET.md`` measured the GPT-2 case at the preset's cadence costing several times the monitor's
own figure and left the cause to measure. This script splits a fit's wall time, for the case of
``default_budget.py`` named by ``--case`` at the shipped default against no callback, in interleaved pairs:

* **in the callback's hooks**: two timing callbacks around it (Lightning calls each hook of its callbacks in list
  order), so the time between the first's and the last's hook is the callback's own, the first check included;
* **outside them**: everything else in the fit, per training iteration too (from one batch start to the next, less
  the callback's hooks in it), with the process's CPU time and minor page faults per iteration (the training
  process only: the background worker is another process).

If the training steps run slower beside the callback (a busy second core, memory the probe pass left behind), the
iterations outside the hooks are slower than the bare fit's; if not, the wall difference is the hooks' time and the
machine's drift between the two fits. Not a registered measurement: it changes no choice. Writes
``benchmarks/results/step_cost_<case>_<steps>x<pairs>.{json,md}`` (`stem`).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import budget_bench  # noqa: E402
import default_budget  # noqa: E402

RESULTS = HERE / "results"
_HOOKS = ("on_train_start", "on_train_batch_end", "on_before_optimizer_step", "on_train_end", "teardown")


class Clock(pl.Callback):
    """Marks the hooks where the monitor's callback spends its time (its ``setup`` only resolves layer names), and
    each batch start with the process's CPU time and faults."""

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {hook: [] for hook in _HOOKS}
        self.batches: list[tuple[float, float, int]] = []  # wall, CPU seconds, minor faults

    def _mark(self, hook: str) -> None:
        self.marks[hook].append(time.perf_counter())

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._mark("on_train_start")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.batches.append((time.perf_counter(), usage.ru_utime + usage.ru_stime, usage.ru_minflt))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._mark("on_train_batch_end")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._mark("on_before_optimizer_step")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._mark("on_train_end")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._mark("teardown")


def split(first: Clock, last: Clock) -> tuple[float, list[float]]:
    """The seconds between the two clocks' marks of each hook in all, and per training iteration (batch_end's)."""
    total = sum(b - a for hook in _HOOKS for a, b in zip(first.marks[hook], last.marks[hook], strict=True))
    per_batch = [b - a for a, b in zip(first.marks["on_train_batch_end"], last.marks["on_train_batch_end"],
                                       strict=True)]  # fmt: skip
    return total, per_batch


def one_fit(case: default_budget.Case, setting: tuple[Any, Any, dict[str, Any]], steps: int,
            with_callback: bool) -> dict[str, Any]:  # fmt: skip
    """A timed fit of ``case`` (with the callback at the shipped default, or none) and its split."""
    make, loader, arguments = setting
    first, last = Clock(), Clock()
    watched = [default_budget.callback(arguments, case.check_every, "default")] if with_callback else []
    wall = budget_bench.fit([first, *watched, last], loader, steps, make)
    hooks, per_batch = split(first, last)
    starts = first.batches
    iterations = [
        (b[0] - a[0] - own, b[1] - a[1], b[2] - a[2]) for a, b, own in zip(starts, starts[1:], per_batch, strict=False)
    ]
    outside = [i[0] for i in iterations]
    row: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "hooks_s": round(hooks, 3),
        "outside_hooks_s": round(wall - hooks, 3),
        "iteration_outside_median_ms": round(1e3 * statistics.median(outside), 2),
        "iteration_cpu_median_ms": round(1e3 * statistics.median(i[1] for i in iterations), 2),
        "iteration_faults_median": int(statistics.median(i[2] for i in iterations)),
    }
    if watched:
        said = budget_bench.monitor_said(watched[0])
        row["monitor_in_all"] = said["logged_overhead"]
        row["checks"] = said["checks"]
    return row


def run(case_name: str, steps: int, pairs: int) -> dict[str, Any]:
    case = next(c for c in default_budget.CASES if c.name == case_name)
    setting = case.setting()
    make, loader, arguments = setting
    budget_bench.fit([default_budget.callback(arguments, case.check_every, "default")], loader, 20, make)  # one-offs
    rows = []
    for pair in range(pairs):
        bare, watched = one_fit(case, setting, steps, False), one_fit(case, setting, steps, True)
        rows.append({"pair": pair + 1, "bare": bare, "default": watched})
        print(f"pair {pair + 1}: bare {bare['wall_s']} s, default {watched['wall_s']} s "
              f"(hooks {watched['hooks_s']} s)", flush=True)  # fmt: skip
    return {
        "case": case_name, "steps": steps, "check_every": case.check_every, "pairs": rows,
        "command": f"OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_cost.py --case {case_name} --steps {steps} "
                   f"--pairs {pairs}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "settings_sha256": default_budget.settings_sha(),
    }  # fmt: skip


def stem(case: str, steps: int, pairs: int) -> str:
    """The stored files' name (without the suffix) of a run of ``case``: ``pairs`` pairs of ``steps``-step fits."""
    return f"step_cost_{case}_{steps}x{pairs}"


def own_seconds(row: dict[str, Any]) -> float:
    """The monitor's own figure in seconds: its share ("in all", of the training time) times the time outside it."""
    return float(row["monitor_in_all"]) * float(row["outside_hooks_s"])


def table(payload: dict[str, Any]) -> list[str]:
    """The stored pairs as a Markdown table."""
    lines = [
        "| pair | fit | wall s | in hooks s | outside s | iteration outside ms | iteration CPU ms | faults / iteration "
        "| monitor's figure |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["pairs"]:
        for name in ("bare", "default"):
            r = row[name]
            said = (
                "-"
                if r.get("monitor_in_all") is None
                else f"{100 * r['monitor_in_all']:.1f} % ({own_seconds(r):.1f} s)"
            )
            lines.append(
                f"| {row['pair']} | {name} | {r['wall_s']:.1f} | {r['hooks_s']:.1f} | {r['outside_hooks_s']:.1f} | "
                f"{r['iteration_outside_median_ms']:.1f} | {r['iteration_cpu_median_ms']:.1f} | "
                f"{r['iteration_faults_median']} | {said} |"
            )
    return lines


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# Where the extra wall-clock goes: {payload['case']}, {payload['steps']} steps",
        "",
        f"`{payload['command']}` ({payload['machine']}; load average {payload['load_average']}); the callback at the "
        "shipped default against no callback, in interleaved pairs. *Hooks*: the callback's own hooks (its checks "
        "included); *outside*: the rest of the fit; per iteration (batch start to batch start, less the hooks): the "
        "median wall, the training process's CPU time and its minor page faults; the monitor's figure: the summary's "
        '"in all", and in seconds of the time outside the hooks.',
        "",
        *table(payload),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="gpt_default", choices=[c.name for c in default_budget.CASES])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    payload = run(args.case, args.steps, args.pairs)
    default_budget.write(args.out / stem(args.case, args.steps, args.pairs), payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
