"""Round 2 of the silent suite (``benchmarks/silent/ROUND2.md``): the design split is every recording of round 1
(seen), the held-out split the new scenarios S7, S8 and the trap T3.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round2.py --split design
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round2.py --split held_out --record --jobs 2

What differs from round 1 (``silent_evaluate.py``, whose signals, combinations, thresholds and patiences it reuses):
score (ii) is replaced, for the three signals measured against the reference, by ROUND2.md's repair (`repaired`);
a faulted run is also judged *caught silently* (no loss-only warning between the fault and the alarm); and the choice
counts design **scenarios** caught (>= 5 of 6 seeds), over the 60 healthy runs of round 1. Writes
``benchmarks/results/silent_r2_<split>.{json,md}``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import silent_evaluate as r1  # noqa: E402
from silent_signals import INDEX, WARMUP, linear_cka  # noqa: E402

from topocallbacks.check import measure  # noqa: E402
from topocallbacks.functional import calibrate_epsilon  # noqa: E402
from topocallbacks.policy import rule_holds  # noqa: E402
from topocallbacks.transform import FeatureTransform  # noqa: E402

CLASSES = {**r1.CLASSES, "S7": ("classes_dropped",), "S8": ("finetune_forgetting_images",)}
TRAPS = {**r1.TRAPS, "T3": "trap_classes_added"}
SPLITS = {"design": (("S1", "S2", "S3", "S4", "S5", "S6"), ("T1", "T2")), "held_out": (("S7", "S8"), ("T3",))}
SCORES = ("trailing", "frozen_r")
#: The signals measured against the reference, whose score (ii) ROUND2.md repairs.
DRIFTS = ("diagram_drift_ref", "cka_drift")
#: Round 6's ``knn_drift_ref`` (ROUND6.md: "the drift family's rate") is repaired as the drifts are, against its
#: churn over the warm-up (`silent_signals.neighbour_signals`).
REPAIRED = ("modes", *DRIFTS, "knn_drift_ref")
ROUND2 = HERE / "ROUND2.md"
STAGE_2 = "## Stage 2: the chosen silent path (round 2)"


def warm_rates(frames: np.ndarray) -> dict[str, np.ndarray]:
    """The run's own healthy rate of each drift: the distance between consecutive warm-up checks (checks 2-10)."""
    transform = FeatureTransform()
    rates: dict[str, list[float]] = {name: [] for name in DRIFTS}
    previous: tuple[np.ndarray, Any] | None = None
    for frame in frames[:WARMUP].astype(np.float64):
        if not np.isfinite(frame).all():
            previous = None
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cloud = transform(frame)
            found = measure(cloud, calibrate_epsilon(cloud, INDEX), INDEX,
                            previous=None if previous is None else previous[1])  # fmt: skip
        if previous is not None:
            drift = found.values.get("diagram_drift")
            rates["diagram_drift_ref"].append(math.nan if drift is None else float(drift))
            rates["cka_drift"].append(1.0 - linear_cka(frame, previous[0]))
        previous = (frame, found.diagrams)
    return {name: np.asarray(values, dtype=np.float64) for name, values in rates.items()}


def repaired(values: np.ndarray, signal: str, rates: np.ndarray | None = None) -> np.ndarray:
    """Score (ii-r) of ROUND2.md: modes lost since the reference check (``modes``), or a drift's rate against the
    run's own healthy rate (``rates``: its consecutive warm-up distances); NaN during the warm-up."""
    values = np.asarray(values, dtype=np.float64)
    scores = np.full(values.size, math.nan)
    if values.size <= WARMUP:
        return scores
    if signal == "modes":
        scores[WARMUP:] = values[WARMUP - 1] - values[WARMUP:]
        return scores
    healthy = np.asarray(rates, dtype=np.float64)
    healthy = healthy[np.isfinite(healthy)]
    if healthy.size == 0:
        return scores
    centre = float(np.median(healthy))
    scale = max(1.4826 * float(np.median(np.abs(healthy - centre))), 0.25 * centre, 1e-12)
    scores[WARMUP:] = (values[WARMUP:] - centre) / scale
    return scores


def alarms(run: r1.Run, signal: str, score: str, k: float, p: int) -> np.ndarray:
    """Where one signal alarms on ``run`` (round 1's `silent_evaluate.alarms`, with score (ii-r) for ``frozen_r``)."""
    if score == "frozen_r" and signal in REPAIRED:
        found = repaired(run.values[signal], signal, run.values.get(f"{signal}/warm_rates"))
        return rule_holds(np.nan_to_num(found, nan=-math.inf), k, p, WARMUP)
    source = r1.SOURCES.get(signal, signal)
    return r1.alarms(run.values[source], signal, "frozen" if score == "frozen_r" else score, k, p)


def loss_warned(run: r1.Run, until: int) -> bool:
    """Whether the loss-only rule warned after the fault and at or before ``until`` (its replay is kept with the
    run's values: every candidate asks it again)."""
    if "loss_rule/fired" not in run.values:
        run.values["loss_rule/fired"] = r1.alarms(run.values["loss"], *r1.LOSS_RULE)
    return bool(((run.steps > run.fault) & (run.steps <= until) & run.values["loss_rule/fired"]).any())


def replayed(runs: list[r1.Run], scenarios: tuple[str, ...], name: str,
             alarm: Callable[..., np.ndarray] | None = None) -> dict[str, Any]:  # fmt: skip
    """The default (``"default"``, or its silent path alone, ``"default_silent"``) or the loss-only rule
    (``"loss_rule"``) judged on ``runs``: each acts as it would, so its row is scored as the loss-only rule is
    (`silent_evaluate.LOSS_RULE`; ``alarm``: as `judge`'s)."""
    return {"combination": name, **judge(runs, scenarios, (name,), *r1.LOSS_RULE[1:], alarm)}


def scenarios_of(split: str) -> tuple[str, ...]:
    """The faulted scenarios of a split, in its classes' order."""
    return tuple(name for c in SPLITS[split][0] for name in CLASSES[c])


def remembered(where: Callable[..., np.ndarray], run: r1.Run, signal: str, score: str, k: float, p: int) -> np.ndarray:
    """``where(run, signal, score, k, p)``, kept with the run's values (as `loss_warned`'s replay): a signal's alarms
    at a setting are asked again by every combination that holds it."""
    key = f"alarms/{where.__module__}.{where.__qualname__}/{signal}/{score}/{k}/{p}"
    if key not in run.values:
        run.values[key] = where(run, signal, score, k, p)
    return run.values[key]


def judge(runs: list[r1.Run], scenarios: tuple[str, ...], signals: tuple[str, ...], score: str, k: float,
          p: int, alarm: Callable[..., np.ndarray] | None = None) -> dict[str, Any]:  # fmt: skip
    """One candidate on ``runs``: seeds caught (and caught silently) per scenario, scenarios caught, median lead,
    healthy runs alarmed (``alarm``: where a signal alarms, `alarms` unless given; round 3 passes its own)."""
    where = alarms if alarm is None else alarm
    found = r1.tally(runs, signals, score, k, p, hits=lambda run, signal: remembered(where, run, signal, score, k, p))
    caught = {name: found.caught.get(name, []) for name in scenarios}
    silent: dict[str, int] = dict.fromkeys(scenarios, 0)
    leads = []
    for run, alarm in found.hits:
        leads.append((run.point or 0) - alarm)
        silent[run.scenario] = silent.get(run.scenario, 0) + (not loss_warned(run, alarm))
    alarmed, healthy = found.alarmed, found.healthy
    seeds = {name: sum(v) for name, v in caught.items()}
    return {
        "score": score, "k": k, "p": p, "signals": len(signals),
        "scenarios_caught": sorted(name for name, n in seeds.items() if n >= 5), "seeds_caught": seeds,
        "seeds_caught_silently": silent, "runs": sum(len(v) for v in caught.values()),
        "runs_caught": sum(seeds.values()), "runs_caught_silently": sum(silent.values()),
        "median_lead": float(np.median(leads)) if leads else None, "healthy_alarmed": alarmed, "healthy_runs": healthy,
    }  # fmt: skip


def rank(row: dict[str, Any]) -> tuple[Any, ...]:
    """ROUND2.md's order: most scenarios caught, then more runs caught silently, the larger median lead, fewer
    signals, larger ``k``, larger ``p``, score (ii-r) over (i)."""
    return (-len(row["scenarios_caught"]), -row["runs_caught_silently"], -(row["median_lead"] or 0), row["signals"],
            -row["k"], -row["p"], row["score"] != "frozen_r")  # fmt: skip


def evaluate(runs: list[r1.Run], scenarios: tuple[str, ...], candidates: dict[str, tuple[str, ...]],
             alarm: Callable[..., np.ndarray] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Every candidate at every score, ``k`` and ``p`` (``alarm``: as `judge`'s)."""
    return [{"combination": name, **judge(runs, scenarios, signals, score, k, p, alarm)}
            for (name, signals), score, k, p in itertools.product(candidates.items(), SCORES, r1.THRESHOLDS,
                                                                   r1.PATIENCES)]  # fmt: skip


def best_at_zero(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best candidate alarming on no healthy run (ROUND2.md's order), or None."""
    eligible = [r for r in results if r["healthy_alarmed"] == 0]
    return min(eligible, key=rank) if eligible else None


def report(runs: list[r1.Run], split: str) -> dict[str, Any]:
    """Round 2's report of one split: the choice (design only: eligible at zero healthy alarms, at least one
    scenario caught), each family and anchor at the same budget, the loss-only rule and the default as shipped."""
    scenarios = scenarios_of(split)
    results = evaluate(runs, scenarios, r1.combinations())
    best = best_at_zero(results)
    chosen = best if split == "design" and best is not None and best["scenarios_caught"] else None
    pools = {family: [r for r in results if r["combination"] in (family, f"{family}+sentinels")]
             for family in ("geometry", "spectrum", "drift")}  # fmt: skip
    pools["sentinels"] = evaluate(runs, scenarios, {"sentinels": r1.SENTINELS})
    for name in r1.ANCHORS:
        pools[name] = evaluate(runs, scenarios, {name: (name,)})
    return {"chosen": chosen, "at_zero": {name: best_at_zero(pool) for name, pool in pools.items()},
            "loss_rule": replayed(runs, scenarios, "loss_rule"), "default": replayed(runs, scenarios, "default"),
            "results": results}  # fmt: skip


def shipped_cadence_runs(runs: list[r1.Run], recording: Callable[[r1.Run], Path],
                         watched: str = "features") -> list[r1.Run]:  # fmt: skip
    """Each run subsampled to the shipped default's cadence (``MonitorSettings().schedule.check_every`` steps, where
    the recordings check every 10), with the default replayed there (``default``, and its silent path alone,
    ``default_silent``): ROUND2.md's second replay of the default. ``recording(run)``: the run's file; ``watched``:
    the recorded frames the default watches (``features``, or round 3's ``outputs`` where a run has them)."""
    from silent_signals import training_signals

    from topocallbacks.settings import MonitorSettings

    every = MonitorSettings().schedule.check_every
    out = []
    for run in runs:
        keep = run.steps % every == 0
        kind = "healthy" if run.kind == "trap" else run.kind
        with np.load(recording(run)) as data:
            key = f"{kind}/{watched}" if f"{kind}/{watched}" in data.files else f"{kind}/features"
            steps = run.steps[keep]
            values = training_signals(steps, data[f"{kind}/loss"], data[f"{kind}/grad_norm"])
            values["default"], values["default_silent"] = r1.default_replay(data[key][keep], steps, values)
        out.append(r1.Run(run.scenario, run.seed, run.kind, steps, values, run.fault, run.point))
    return out


def load_runs(directory: Path, split: str) -> list[r1.Run]:
    """Round 1's runs and signals for the split's recordings, with each run's healthy drift rates added."""
    scenarios = [*scenarios_of(split), *(TRAPS[t] for t in SPLITS[split][1])]
    runs = r1.load_runs(directory, scenarios, r1.EVALUATION_SEEDS)
    for run in runs:
        with np.load(directory / f"{run.scenario}-seed{run.seed}.npz") as data:
            kind = "healthy" if run.kind == "trap" else run.kind
            for name, rates in warm_rates(data[f"{kind}/features"]).items():
                run.values[f"{name}/warm_rates"] = rates
    return runs


def write_markdown(payload: dict[str, Any], path: Path) -> None:
    """Write the split's page (`markdown`; the held-out page with the design split's stored choice)."""
    design = path.parent / "silent_r2_design.json"
    choice = json.loads(design.read_text())["chosen"] if payload["split"] == "held_out" and design.exists() else None
    path.write_text(markdown(payload, choice))


#: How a table row names the rules replayed as they act (round 3 adds the default's silent path alone).
REPLAYS = {"default": "`MonitorSettings()`", "default_silent": "`MonitorSettings().silent`",
           "loss_rule": "`Policy` on the loss alone, its defaults",
           "opt_in_silent": "`MonitorSettings()` with `silent_path=True`"}  # fmt: skip


def row(name: str, found: dict[str, Any] | None) -> str:
    """One candidate's (or replayed rule's) row of a results table: seeds caught (silently) per scenario, scenarios
    caught, median lead, healthy runs alarmed."""
    if found is None:
        return f"| {name} | none | - | - | - | - |"
    what = REPLAYS.get(found["combination"], f"{found['combination']}, {found['score']}, k {found['k']:g}, "
                                             f"p {found['p']}")  # fmt: skip
    seeds = ", ".join(f"{s} {n}/{found['seeds_caught_silently'].get(s, 0)}" for s, n in found["seeds_caught"].items())
    lead = "-" if found["median_lead"] is None else f"{found['median_lead']:.0f}"
    return (f"| {name} | {what} | {seeds or '-'} | {', '.join(found['scenarios_caught']) or 'none'} | {lead} | "
            f"{found['healthy_alarmed']}/{found['healthy_runs']} |")  # fmt: skip


def markdown(payload: dict[str, Any], choice: dict[str, Any] | None = None) -> str:
    """The split's page: the choice, each family's and anchor's best at zero healthy alarms, the loss-only rule and
    the default, per scenario (and on the held-out split, the silence check)."""
    chosen = payload["chosen"]
    verdict = "Chosen: nothing."
    if payload["split"] == "held_out":
        verdict = ("Nothing is chosen on this split: it tests the design split's choice, which the library ships as "
                   "its silent path (the default's rows).")  # fmt: skip
    elif chosen is not None:
        verdict = f"Chosen: `{chosen['combination']}`, score {chosen['score']}, k {chosen['k']:g}, p {chosen['p']}."
    lines = [
        f"Round 2, split **{payload['split']}** (classes {', '.join(payload['classes'])}; traps "
        f"{', '.join(payload['traps'])}); evaluation seeds 0-5; evaluated at commit `{payload['commit'][:12]}`.",
        "",
        verdict,
        "",
        "| signal | candidate | seeds caught / caught silently (of 6), per scenario | scenarios caught | "
        "median lead (steps) | healthy runs alarmed |",
        "|---|---|---|---|---|---|",
        row("the default (every 10 steps)", payload["default"]),
        *([row("the default (every 100 steps, as shipped)", payload["default_shipped_cadence"])]
          if "default_shipped_cadence" in payload else []),
        *([row("the design split's choice", next(r for r in payload["results"] if all(
            r[key] == choice[key] for key in ("combination", "score", "k", "p"))))] if choice else []),
        row("loss-only rule", payload["loss_rule"]),
        *(row(name, found) for name, found in payload["at_zero"].items()),
    ]  # fmt: skip
    if "silence" in payload:
        lines += ["", "The silence check on the evaluation seeds (ROUND2.md: a quiet loss-only rule, harm, room):",
                  "", "| scenario | seeds passing (of 6) | passes |", "|---|---|---|",
                  *(f"| {name} | {found['passed']} | {'yes' if found['passes'] else '**no**'} |"
                    for name, found in payload["silence"].items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = r1.parser_for(__doc__, SPLITS)
    parser.add_argument("--record-only", action="store_true", help="record the missing evaluation seeds, no more")
    args = parser.parse_args(argv)
    if args.render:
        stored = args.out / f"silent_r2_{args.split}.json"
        write_markdown(json.loads(stored.read_text()), stored.with_suffix(".md"))
        return 0
    classes, traps = SPLITS[args.split]
    if args.split == "held_out" and STAGE_2 not in ROUND2.read_text():
        parser.error("round 2's held-out split is recorded and evaluated only after its stage 2 (ROUND2.md)")
    commit = r1._commit()
    scenarios = scenarios_of(args.split)
    if args.record or args.record_only:
        r1.record_missing([*scenarios, *(TRAPS[t] for t in traps)], args.recordings, args.jobs)
        if args.record_only:
            return 0
    runs = load_runs(args.recordings, args.split)
    found = report(runs, args.split)
    if args.split == "held_out":
        found["default_shipped_cadence"] = replayed(
            shipped_cadence_runs(runs, lambda run: args.recordings / f"{run.scenario}-seed{run.seed}.npz"),
            scenarios,
            "default",
        )
        found["silence"] = r1.silence_checks(args.recordings, list(scenarios), r1.EVALUATION_SEEDS)
    payload = {"split": args.split, "classes": list(classes), "traps": list(traps), "commit": commit, **found}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"silent_r2_{args.split}.json").write_text(json.dumps(payload, indent=1) + "\n")
    write_markdown(payload, args.out / f"silent_r2_{args.split}.md")
    print(f"round 2, {args.split}: {len(found['results'])} candidates; chosen {found['chosen']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
