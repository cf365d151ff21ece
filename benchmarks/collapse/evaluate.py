"""Evaluate candidate collapse signals on the recordings: warning steps, lead, false positives, at equal FP rates.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collapse/evaluate.py            # table + JSON + PNGs
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collapse/evaluate.py --jobs 2   # signals on two processes

The protocol (also in ``benchmarks/README.md``):

* **Warning rule** (the same for every signal): the package's default policy rule, computed by its own functions
  (``topocallbacks.policy.rule_scores`` and ``rule_holds``): at check ``i`` after a warm-up of ``WARMUP`` checks,
  the score is ``z = direction * (s_i - median(s over the previous TRAIL checks)) / noise``, with ``noise`` the
  robust spread (1.4826 x median absolute deviation) of the check-to-check differences over the previous
  ``2 * TRAIL`` checks divided by sqrt(2); two-sided signals use ``|z|``. A check is *flagged* when ``z >= k``
  at it and the ``patience - 1`` checks before it. A diverged check (NaN/Inf features or loss) is always flagged.
  Fused signals flag when either part's score reaches ``k``.
* **Standard metric warning**: the first check at which the metric is worse than its best so far by more than a
  relative margin. The margin is held to the same false-positive budget as the signals: for each metric
  (accuracy, held-out loss, k-NN accuracy), the smallest of ``MARGINS`` that flags at most ``FP_BUDGET`` of the
  healthy twins' post-warm-up checks (pooled over the scenarios with that metric).
* **Tuning and held-out split**: two folds of three scenarios. For each signal, ``(k, patience)`` is chosen on one
  fold: the smallest ``k`` whose pooled false-positive rate on that fold's healthy twins is at most
  ``FP_BUDGET``, for each patience, keeping the patience that warns before the standard metric in the most
  collapse runs (then the largest summed lead). Every signal is reported on the *other* fold with those values,
  so all signals are compared at the same false-positive budget and no reported number was tuned on itself.
* **Per run**: the signal's warning step is its first flagged check after the fault step; lead = standard
  warning step - signal warning step (positive: earlier); lead fraction = lead / (standard warning step - fault
  step); false positives = flagged share of a healthy twin's post-warm-up checks; alarms before the fault =
  flagged checks of a collapse run up to the fault step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from record import KINDS, RECORDINGS, recordings  # noqa: E402
from signals import SIGNALS, VERSION, feature_signals, training_signals  # noqa: E402

from topocallbacks.policy import Policy, rule_holds, rule_scores  # noqa: E402
from topocallbacks.settings import PolicySettings  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: The default policy's trigger on one channel (its warm-up, z-score window and threshold): the suite measures each
#: signal alone, so the rule's second required channel (the training loss) is left out here; the rescue suite
#: measures the whole rule. It warns (this suite measures warnings; a rollback is never held back by a cooldown).
RULE = PolicySettings(channels=("index",), require=1, action="warn")
WARMUP = RULE.warmup
TRAIL = RULE.zscore_window
MARGINS = (0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
FP_BUDGET = 0.02
THRESHOLDS = tuple(float(k) for k in np.round(np.geomspace(1.0, 1000.0, 61), 3))
PATIENCES = (1, 2, 3)
FOLDS = (
    ("resnet_lr_ramp", "vit_no_warmup", "gpt_high_lr"),
    ("resnet_weight_decay", "llama_high_lr", "simsiam_no_stopgrad"),
)
BASELINES = ("rankme", "anisotropy", "grad_norm")


@dataclasses.dataclass
class Run:
    scenario: str
    kind: str
    seed: int
    fault_step: int
    steps: np.ndarray  # check steps
    metric: np.ndarray
    metric_name: str
    higher_is_better: bool
    diverged: np.ndarray  # bool per check
    signals: dict[str, np.ndarray]
    margin: float = MARGINS[2]  # the standard metric's margin, set by calibrate_standard()
    # Each signal's rule scores per threshold (the z-score's reference leaves out the checks that reached it),
    # computed once: tuning evaluates every patience on the same scores.
    zscores: dict[tuple[str, float], np.ndarray] = dataclasses.field(default_factory=dict, repr=False, compare=False)


# --- signals ----------------------------------------------------------------------------------------------------


def _pair_signals(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """All signals of both runs of one recording, cached next to it (recomputed when VERSION changes)."""
    cache = path.with_suffix(f".signals-v{VERSION}.npz")
    if cache.exists():
        with np.load(cache) as data:
            result: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in KINDS}
            for key in data.files:
                kind, name = key.split("/", 1)
                result[kind][name] = data[key]
            return result
    with np.load(path) as data:
        fault = int(data["fault_step"])
        steps = {kind: data[f"{kind}/check_steps"] for kind in KINDS}
        prefix = int(np.sum(steps["collapse"] <= fault))
        shared, state = feature_signals(data["collapse/features"][:prefix])
        result = {}
        for kind in KINDS:
            branch, _ = feature_signals(data[f"{kind}/features"][prefix:], state)
            signals = {name: np.concatenate([shared[name], branch[name]]) for name in shared}
            signals.update(training_signals(steps[kind], data[f"{kind}/loss"], data[f"{kind}/grad_norm"]))
            result[kind] = signals
    tmp = cache.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **{f"{kind}/{name}": values for kind in KINDS for name, values in result[kind].items()})
    os.replace(tmp, cache)
    return result


def load_runs(directory: Path = RECORDINGS, jobs: int = 1) -> list[Run]:
    paths = recordings(directory)
    if not paths:
        raise SystemExit(f"no recordings in {directory}: run benchmarks/collapse/record.py first")
    if jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            all_signals = list(pool.map(_pair_signals, paths))
    else:
        all_signals = [_pair_signals(path) for path in paths]
    runs = []
    for path, signals in zip(paths, all_signals, strict=True):
        with np.load(path) as data:
            for kind in KINDS:
                steps = data[f"{kind}/check_steps"]
                features = data[f"{kind}/features"]
                loss = data[f"{kind}/loss"]
                diverged = ~np.isfinite(features).all(axis=(1, 2))
                for i in range(1, steps.size):
                    diverged[i] |= not np.isfinite(loss[steps[i - 1] : steps[i]]).all()
                runs.append(
                    Run(
                        scenario=str(data["scenario"]),
                        kind=kind,
                        seed=int(data["seed"]),
                        fault_step=int(data["fault_step"]),
                        steps=steps,
                        metric=data[f"{kind}/metric"],
                        metric_name=str(data["metric_name"]),
                        higher_is_better=bool(data["higher_is_better"]),
                        diverged=diverged,
                        signals=signals[kind],
                    )
                )
    return runs


# --- rules ------------------------------------------------------------------------------------------------------


def run_scores(run: Run, name: str, k: float) -> np.ndarray:
    """The rule's score of a signal at every check with threshold ``k`` (max over the parts of a fused one; NaN
    where none). The threshold matters: checks whose score reached it stay out of the z-score's reference."""
    parts = SIGNALS[name].parts or (name,)
    rule = dataclasses.replace(RULE, threshold=k)
    for part in parts:
        if (part, k) not in run.zscores:
            run.zscores[(part, k)] = rule_scores(run.signals[part], rule, direction=SIGNALS[part].direction)
    return np.fmax.reduce([run.zscores[(part, k)] for part in parts], axis=0)


def fired_warning(run: Run, name: str, k: float, patience: int) -> int | None:
    """The first step after the fault at which the shipped :class:`Policy` (cooldown included) warns.

    The suite's warning step is the rule's first flag after the fault; a cooldown started by an alarm before the
    fault can hold that flag back when it is not larger. This replays the policy itself to count such runs
    (one-sided signals only: the policy sees the value oriented so that higher means more collapsed).
    """
    direction = SIGNALS[name].direction
    if SIGNALS[name].parts or direction == 0:
        return None
    policy = Policy(RULE, threshold=k, patience=patience)
    for step, value, diverged in zip(run.steps.tolist(), run.signals[name].tolist(), run.diverged, strict=True):
        finite = math.isfinite(value)
        decision = policy.decide(step, direction * value if finite else None, diverged=bool(diverged))
        if decision.fired and step > run.fault_step:
            return int(step)
    return None


def flagged(run: Run, z: np.ndarray, k: float, patience: int) -> np.ndarray:
    """Where the rule holds at threshold ``k`` (a diverged check always does)."""
    return rule_holds(z, k, patience, WARMUP, diverged=run.diverged)


def standard_warning(run: Run) -> int | None:
    """Step of the first check after the fault at which the metric is ``run.margin`` worse than its best."""
    flags = standard_flags(run)
    after = np.flatnonzero(flags & (run.steps > run.fault_step))
    return int(run.steps[after[0]]) if after.size else None


def standard_flags(run: Run) -> np.ndarray:
    sign = 1.0 if run.higher_is_better else -1.0
    metric = np.where(np.isfinite(run.metric), sign * run.metric, -math.inf)
    best = np.maximum.accumulate(metric)
    flags = metric < best - run.margin * np.abs(best)
    flags[:WARMUP] = False
    return flags | run.diverged


def calibrate_standard(runs: list[Run]) -> dict[str, float]:
    """Set each run's standard-metric margin: per metric, the smallest within the FP budget on healthy twins."""
    margins = {}
    for name in sorted({r.metric_name for r in runs}):
        healthy = [r for r in runs if r.metric_name == name and r.kind == "healthy"]
        for margin in MARGINS:
            for run in healthy:
                run.margin = margin
            flags = sum(int(standard_flags(r)[WARMUP:].sum()) for r in healthy)
            if flags <= FP_BUDGET * sum(r.steps.size - WARMUP for r in healthy):
                break
        margins[name] = margin
        for run in runs:
            if run.metric_name == name:
                run.margin = margin
    return margins


@dataclasses.dataclass
class Outcome:
    warning_step: int | None
    flagged_checks: int
    checks: int  # post-warm-up checks
    before_fault: int


def outcome(run: Run, flags: np.ndarray) -> Outcome:
    post = run.steps > run.fault_step
    after = np.flatnonzero(flags & post)
    return Outcome(
        warning_step=int(run.steps[after[0]]) if after.size and run.kind == "collapse" else None,
        flagged_checks=int(flags[WARMUP:].sum()),
        checks=int(run.steps.size - WARMUP),
        before_fault=int(flags[WARMUP:][~post[WARMUP:]].sum()),
    )


def lead(run: Run, warning: int | None) -> float | None:
    """Lead in steps over the standard metric; None where the standard metric never warned."""
    standard = standard_warning(run)
    if standard is None:
        return None
    if warning is None:
        return -math.inf
    return float(standard - warning)


def lead_fraction(run: Run, warning: int | None) -> float | None:
    standard = standard_warning(run)
    value = lead(run, warning)
    if value is None or standard is None:
        return None
    return max(value / (standard - run.fault_step), -1.0)


# --- tuning -----------------------------------------------------------------------------------------------------


def evaluate(runs: list[Run], name: str, k: float, patience: int) -> dict[str, Any]:
    """Per-run outcomes of one signal with one rule setting, plus pooled summaries."""
    per_run = []
    for run in runs:
        result = outcome(run, flagged(run, run_scores(run, name, k), k, patience))
        per_run.append((run, result))
    healthy = [(r, o) for r, o in per_run if r.kind == "healthy"]
    collapse = [(r, o) for r, o in per_run if r.kind == "collapse"]
    fp = sum(o.flagged_checks for _, o in healthy) / max(1, sum(o.checks for _, o in healthy))
    leads = [lead(r, o.warning_step) for r, o in collapse]
    fractions = [lead_fraction(r, o.warning_step) for r, o in collapse]
    return {
        "per_run": per_run,
        "fp": fp,
        "early": sum(1 for x in leads if x is not None and x > 0),
        "lead_sum": sum(x for x in fractions if x is not None),
    }


def tune(runs: list[Run], name: str) -> tuple[float, int]:
    """(k, patience) on ``runs``: the smallest k within the FP budget per patience; best patience by early count."""
    best: tuple[tuple[int, float], float, int] | None = None
    for patience in PATIENCES:
        for k in THRESHOLDS:
            result = evaluate(runs, name, k, patience)
            if result["fp"] <= FP_BUDGET:
                key = (result["early"], result["lead_sum"])
                if best is None or key > best[0]:
                    best = (key, k, patience)
                break
    if best is None:  # even the largest threshold flags too much: report it at that threshold
        return THRESHOLDS[-1], PATIENCES[-1]
    return best[1], best[2]


# --- report -----------------------------------------------------------------------------------------------------


def held_out(runs: list[Run], name: str) -> tuple[dict[tuple[str, str, int], Outcome], dict[str, tuple[float, int]]]:
    """Outcomes of every run with the rule tuned on the other fold; and the setting used per scenario."""
    outcomes: dict[tuple[str, str, int], Outcome] = {}
    settings: dict[str, tuple[float, int]] = {}
    for fold in FOLDS:
        tuning = [r for r in runs if r.scenario not in fold]
        k, patience = tune(tuning, name)
        for run in runs:
            if run.scenario in fold:
                settings[run.scenario] = (k, patience)
                outcomes[(run.scenario, run.kind, run.seed)] = outcome(
                    run, flagged(run, run_scores(run, name, k), k, patience)
                )
    return outcomes, settings


def summarise(runs: list[Run], outcomes: dict[tuple[str, str, int], Outcome]) -> dict[str, Any]:
    scenarios = sorted({r.scenario for r in runs})
    per_scenario = {}
    for scenario in scenarios:
        collapse = [r for r in runs if r.scenario == scenario and r.kind == "collapse"]
        healthy = [r for r in runs if r.scenario == scenario and r.kind == "healthy"]
        fractions = [lead_fraction(r, outcomes[(scenario, "collapse", r.seed)].warning_step) for r in collapse]
        leads = [lead(r, outcomes[(scenario, "collapse", r.seed)].warning_step) for r in collapse]
        known = [x for x in fractions if x is not None]
        known_leads = [x for x in leads if x is not None]
        fp_flags = sum(outcomes[(scenario, "healthy", r.seed)].flagged_checks for r in healthy)
        fp_checks = sum(outcomes[(scenario, "healthy", r.seed)].checks for r in healthy)
        silent = [r for r in collapse if standard_warning(r) is None]
        per_scenario[scenario] = {
            "standard_warned": len(collapse) - len(silent),
            "warned_without_standard": sum(
                1 for r in silent if outcomes[(scenario, "collapse", r.seed)].warning_step is not None
            ),
            "median_lead_steps": statistics.median(known_leads) if known_leads else None,
            "median_lead_fraction": statistics.median(known) if known else None,
            "fp_rate": fp_flags / max(1, fp_checks),
            "alarms_before_fault": sum(outcomes[(scenario, "collapse", r.seed)].before_fault for r in collapse),
        }
    early = [s for s, v in per_scenario.items() if v["median_lead_steps"] is not None and v["median_lead_steps"] > 0]
    fractions = [v["median_lead_fraction"] for v in per_scenario.values() if v["median_lead_fraction"] is not None]
    healthy_runs = [r for r in runs if r.kind == "healthy"]
    fp = sum(outcomes[(r.scenario, "healthy", r.seed)].flagged_checks for r in healthy_runs) / max(
        1, sum(outcomes[(r.scenario, "healthy", r.seed)].checks for r in healthy_runs)
    )
    return {
        "scenarios_early": len(early),
        "scenarios": len(per_scenario),
        "median_lead_fraction": statistics.median(fractions) if fractions else None,
        "fp_rate": fp,
        "per_scenario": per_scenario,
    }


def rank_key(summary: dict[str, Any]) -> tuple[int, float]:
    """Scenarios warned early first, then the median lead fraction (missing: last)."""
    fraction = summary["median_lead_fraction"]
    return summary["scenarios_early"], -math.inf if fraction is None else fraction


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recordings", type=Path, default=RECORDINGS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument(
        "--default", default="diagram_drift", choices=sorted(SIGNALS),
        help="the package's default index (TopoMonitor's), reported as `ci_warning_step` (default: diagram_drift)",
    )  # fmt: skip
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    runs = load_runs(args.recordings, args.jobs)
    margins = calibrate_standard(runs)
    missing = sorted({s for fold in FOLDS for s in fold} - {r.scenario for r in runs})
    if missing:
        print(f"warning: no recordings for {missing}; the folds are incomplete", file=sys.stderr)

    summaries, outcomes_by_signal, settings_by_signal = {}, {}, {}
    for name in SIGNALS:
        outcomes, settings = held_out(runs, name)
        outcomes_by_signal[name], settings_by_signal[name] = outcomes, settings
        summaries[name] = summarise(runs, outcomes)
    standard = {(r.scenario, r.kind, r.seed): outcome(r, standard_flags(r)) for r in runs}
    standard_fp = summarise(runs, standard)["fp_rate"]

    within = [n for n in SIGNALS if summaries[n]["fp_rate"] <= FP_BUDGET] or list(SIGNALS)
    best = max(within, key=lambda n: rank_key(summaries[n]))
    winner = args.default
    text = table(summaries, winner, standard_fp, margins)
    print(text)
    held = [
        (r.scenario, r.seed)
        for r in runs
        if r.kind == "collapse"
        and fired_warning(r, winner, *settings_by_signal[winner][r.scenario])
        != outcomes_by_signal[winner][(r.scenario, r.kind, r.seed)].warning_step
    ]
    print(f"{winner}: collapse runs whose first flag after the fault the policy's cooldown held back: {held or 'none'}")
    print(f"best held-out signal within the {FP_BUDGET:.0%} budget: {best}; the package default: {winner}")

    records = []
    for run in sorted(runs, key=lambda r: (r.scenario, r.seed, r.kind)):
        key = (run.scenario, run.kind, run.seed)
        records.append(
            {
                "scenario": run.scenario,
                "kind": run.kind,
                "seed": run.seed,
                "fault_step": run.fault_step,
                "standard_warning_step": standard_warning(run) if run.kind == "collapse" else None,
                "standard_flagged_checks": standard[key].flagged_checks,
                "ci_index": winner,
                "ci_warning_step": outcomes_by_signal[winner][key].warning_step,
                "ci_fired_step": (
                    fired_warning(run, winner, *settings_by_signal[winner][run.scenario])
                    if run.kind == "collapse"
                    else None
                ),
                "checks": outcomes_by_signal[winner][key].checks,
                "flagged_checks": outcomes_by_signal[winner][key].flagged_checks,
                "alarms_before_fault": outcomes_by_signal[winner][key].before_fault,
                "baselines": {
                    name: {
                        "warning_step": outcomes_by_signal[name][key].warning_step,
                        "flagged_checks": outcomes_by_signal[name][key].flagged_checks,
                    }
                    for name in SIGNALS
                    if name != winner
                },
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collapse.json").write_text(json.dumps(records, indent=1) + "\n")
    summary = {
        "protocol": {
            "warmup_checks": WARMUP,
            "trail_checks": TRAIL,
            "standard_margins": margins,
            "fp_budget": FP_BUDGET,
            "folds": FOLDS,
        },
        "default_index": winner,
        "best_index": best,
        "best_setting": dict(zip(("k", "patience"), tune(runs, best), strict=True)),
        "standard_fp_rate": standard_fp,
        "signals": {
            name: {**summaries[name], "settings": {s: list(v) for s, v in settings_by_signal[name].items()}}
            for name in SIGNALS
        },
        "deployed_setting": dict(zip(("k", "patience"), tune(runs, winner), strict=True)),
        "machine": platform.platform(),
    }
    (args.out / "collapse_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collapse/evaluate.py"
    (args.out / "collapse.md").write_text(
        f"Held-out results of every candidate (`{command}`). Cells: median lead fraction over seeds (median lead "
        "in steps); `missed`: no warning after the fault; `n/a`: the standard metric never warned.\n\n" + text + "\n"
    )
    if not args.no_plots:
        from plots import plot_scenarios

        plot_scenarios(runs, winner, best, outcomes_by_signal, args.out / "collapse", standard_warning, WARMUP)
    return 0


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "n/a"
    return "missed" if value == -math.inf else format(value, spec)


def table(summaries: dict[str, dict[str, Any]], winner: str, standard_fp: float, margins: dict[str, float]) -> str:
    scenarios = list(next(iter(summaries.values()))["per_scenario"])
    header = "| signal | early in | median lead | FP (healthy) | " + " | ".join(scenarios) + " |"
    lines = [header, "|" + "---|" * (4 + len(scenarios))]
    for name, s in sorted(summaries.items(), key=lambda item: rank_key(item[1]), reverse=True):
        cells = [
            "n/a" if v["median_lead_steps"] is None
            else "missed" if v["median_lead_steps"] == -math.inf
            else f"{v['median_lead_fraction']:+.0%} ({v['median_lead_steps']:+.0f})"
            for v in s["per_scenario"].values()
        ]  # fmt: skip
        label = f"**{name}**" if name == winner else name
        lines.append(
            f"| {label} | {s['scenarios_early']}/{s['scenarios']} | {_fmt(s['median_lead_fraction'], '+.0%')} | "
            f"{s['fp_rate']:.1%} | " + " | ".join(cells) + " |"
        )
    rule = ", ".join(f"{name} {margin:.1%}" for name, margin in margins.items())
    lines.append(f"\nstandard metric: worse than its best by {rule}; flags {standard_fp:.1%} of healthy checks")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
