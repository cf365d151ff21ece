"""Round 3 of the silent suite (``benchmarks/silent/ROUND3.md``): admission, the classifiers watched at their logits
too, the outputs family, and the rule for whether the default keeps a silent path.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round3.py --split design --record
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round3.py --split held_out --record --jobs 2

The classifier scenarios (`CLASSIFIERS`) are recorded into ``recordings/evaluation/round3/`` with their probe
logits; the design split's classifiers are recorded again there (same seeds, same code) and their features must equal
round 2's recordings, checked on loading. Each run is judged at two *places*: its watched features, and its outputs
(a classifier's logits; elsewhere the same features). A scenario counts at a place where it is *admitted* (its
silence check passes, with room, and its harm is in that place: `admitted`). Candidates are round 2's at both places,
and the outputs family alone and with each of round 2's combinations at the outputs place. Writes
``benchmarks/results/silent_r3_<split>.{json,md}``.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import round2 as r2  # noqa: E402
import silent_evaluate as r1  # noqa: E402
from silent_signals import OUTPUTS, feature_signals, output_signals, training_signals  # noqa: E402
from where_harm import at_harm, interval  # noqa: E402

from topocallbacks.policy import rule_holds  # noqa: E402

CLASSES = {**r2.CLASSES, "S9": ("digits_class_dropped",), "S10": ("labels_merged",)}
TRAPS = {**r2.TRAPS, "T4": "trap_long_tail"}
SPLITS = {
    "design": (("S1", "S2", "S3", "S4", "S5", "S6", "S7", "S8"), ("T1", "T2", "T3")),
    "held_out": (("S9", "S10"), ("T4",)),
}
#: The scenarios recorded with their probe logits (``recordings/evaluation/round3/``).
CLASSIFIERS = frozenset({"watermark_shortcut", "classes_dropped", "trap_classes_added", "digits_class_dropped",
                         "labels_merged", "trap_long_tail"})  # fmt: skip
#: Scenarios whose harm metric is a fixed function of the watched features (a linear probe, active units, modes
#: covered, pair accuracy of the embedding): admitted at the features by their metric (ROUND3.md).
FEATURE_METRICS = frozenset({"simsiam_no_stopgrad", "contrastive_no_negatives", "minilm_pairs_no_negatives",
                             "generator_modes_grid", "generator_modes_circle", "vae_kl_bug", "minilm_forgetting",
                             "finetune_forgetting_images"})  # fmt: skip
PLACES = ("features", "outputs")
#: The rules replayed as they act: the loss-only rule, the default, and the default's silent path alone.
REPLAYED = ("loss_rule", "default", "default_silent")
ROUND3 = HERE / "ROUND3.md"
STAGE_2 = "## Stage 2: the chosen silent path (round 3)"


def scenarios_of(split: str) -> tuple[str, ...]:
    """The faulted scenarios of a split, in its classes' order."""
    return tuple(name for c in SPLITS[split][0] for name in CLASSES[c])


def recording(directory: Path, name: str, seed: int) -> Path:
    """Where a scenario's evaluation seed is recorded (the classifiers with their logits in ``round3/``)."""
    return (directory / "round3" if name in CLASSIFIERS else directory) / f"{name}-seed{seed}.npz"


def probe_labels(name: str) -> np.ndarray:
    """The labels of a classifier scenario's probe (the first 512 of its held-out inputs)."""
    from cases import PROBE_SIZE, SCENARIOS

    return SCENARIOS[name].build(0).eval_y[:PROBE_SIZE].numpy()


def admitted(directory: Path, name: str) -> dict[str, Any]:
    """ROUND3.md's admission of one faulted scenario at each place: its silence check with room on >= 5 of 6 seeds,
    and its harm at the place (by its metric, or by the watched features' linear probe at the 5 % point)."""
    from silence import check

    checks = [check(recording(directory, name, seed)) for seed in r1.EVALUATION_SEEDS]
    silent = sum(c["quiet"] and c["reached"] and c["room"] and c["twin_covers_modes"] for c in checks) >= 5
    found: dict[str, Any] = {"silence_passed": silent}
    probe = None
    if name in CLASSIFIERS:  # where_harm.py's measure at each seed's 5 % point
        labels = probe_labels(name)
        seeds = [at_harm(recording(directory, name, seed), labels) for seed in r1.EVALUATION_SEEDS]
        harmed = [s for s in seeds if s["point"] is not None]
        differences = [s["collapse"]["linear_probe"] - s["healthy"]["linear_probe"] for s in harmed]
        probe = interval(differences) if len(differences) >= 2 else None
    found["linear_probe_difference"] = probe
    harm_in_features = name in FEATURE_METRICS or (probe is not None and probe["high"] < 0)
    found["features"] = silent and harm_in_features
    # A classifier's accuracy is the argmax of its logits: its harm is in its outputs; elsewhere the outputs place
    # is the features.
    found["outputs"] = silent and (name in CLASSIFIERS or harm_in_features)
    return found


def run_values(data: Any, kind: str, steps: np.ndarray, place: str) -> dict[str, np.ndarray]:
    """Every signal of one run at one place: round 2's (with the drifts' warm rates), the training channels, the
    default's replay (any action, and the silent path's alone) and the outputs family (NaN where no logits)."""
    frames = data[f"{kind}/outputs"] if place == "outputs" and f"{kind}/outputs" in data.files else None
    watched = frames if frames is not None else data[f"{kind}/features"]
    values, _ = feature_signals(watched)
    values.update(training_signals(steps, data[f"{kind}/loss"], data[f"{kind}/grad_norm"]))
    for name, rates in r2.warm_rates(watched).items():
        values[f"{name}/warm_rates"] = rates
    values["default"], values["default_silent"] = r1.default_replay(watched, steps, values)
    if f"{kind}/views" in data.files and place == "features":
        from silent_signals import lidar

        values["lidar"] = np.array([lidar(v) for v in data[f"{kind}/views"]])
    outputs = output_signals(frames) if frames is not None else {s: np.full(steps.size, math.nan) for s in OUTPUTS}
    return {**values, **outputs}


def load_runs(directory: Path, split: str, place: str, at_features: list[r1.Run] | None = None) -> list[r1.Run]:
    """The split's runs with their signals at ``place`` (``at_features``: the same runs at the features, whose
    non-classifiers the outputs place takes as they are: their outputs are their features)."""
    names = [*scenarios_of(split), *(TRAPS[t] for t in SPLITS[split][1])]
    runs = []
    for name, seed in itertools.product(names, r1.EVALUATION_SEEDS):
        if at_features is not None and name not in CLASSIFIERS:
            runs += [run for run in at_features if (run.scenario, run.seed) == (name, seed)]
            continue
        with np.load(recording(directory, name, seed)) as data:
            if name in CLASSIFIERS and split == "design":
                same_features(directory, name, seed, data)
            runs += runs_of(data, name, seed, lambda kind, steps: run_values(data, kind, steps, place))
    return runs


def runs_of(data: Any, name: str, seed: int, values_of: Any) -> list[r1.Run]:
    """One recording's runs (a trap's one, a faulted run and its twin with the 5 % point), each with
    ``values_of(kind, steps)``."""
    from silence import harm_point

    trap, fault = name.startswith("trap_"), int(data["fault_step"])
    point = None
    if not trap:
        metrics = data["collapse/metric"], data["healthy/metric"]
        point = harm_point(data["collapse/check_steps"], *metrics, fault, bool(data["higher_is_better"]))
    runs = []
    for kind in ("healthy",) if trap else ("collapse", "healthy"):
        steps = data[f"{kind}/check_steps"]
        runs.append(r1.Run(name, seed, "trap" if trap else kind, steps, values_of(kind, steps), fault, point))
    return runs


def same_features(directory: Path, name: str, seed: int, data: Any) -> None:
    """ROUND3.md: a design classifier recorded again with its logits must hold round 2's features exactly."""
    with np.load(directory / f"{name}-seed{seed}.npz") as before:
        for kind in ("collapse", "healthy"):
            if f"{kind}/features" in before.files and not np.array_equal(before[f"{kind}/features"],
                                                                         data[f"{kind}/features"]):  # fmt: skip
                raise RuntimeError(f"{name} seed {seed}: the re-recorded {kind} features differ from round 2's")


def alarms(run: r1.Run, signal: str, score: str, k: float, p: int) -> np.ndarray:
    """Round 2's alarms, with the outputs family's: ``coverage`` under score (ii-r) counts the classes lost since
    the reference check, as round 2's mode counter."""
    if signal == "default_silent":
        return np.nan_to_num(run.values[signal], nan=0.0) >= 1.0
    if signal == "coverage" and score == "frozen_r":
        found = r2.repaired(run.values[signal], "modes")
        return rule_holds(np.nan_to_num(found, nan=-math.inf), k, p, r1.WARMUP)
    return r2.alarms(run, signal, score, k, p)


def candidates(place: str) -> dict[str, tuple[str, ...]]:
    """Round 2's combinations, and at the outputs place the outputs family alone and with each of them."""
    found = dict(r1.combinations())
    if place == "outputs":
        found["outputs"] = OUTPUTS
        found.update({f"outputs+{name}": OUTPUTS + signals for name, signals in r1.combinations().items()})
    return found


def with_family(name: str, signals: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """A later round's new family as a candidate: alone, with the sentinels, and with each of round 2's
    combinations (ROUND6.md)."""
    return {name: signals, f"{name}+sentinels": signals + r1.SENTINELS,
            **{f"{name}+{other}": signals + more for other, more in r1.combinations().items()}}  # fmt: skip


def place_report(runs: list[r1.Run], admitted_here: tuple[str, ...], choosing: bool, place: str,
                 extra: dict[str, tuple[str, ...]] | None = None) -> dict[str, Any]:  # fmt: skip
    """One place's results: every candidate, the best at zero healthy alarms, each family and anchor there, the
    loss-only rule and the default (and its silent path alone). ``extra``: a later round's new families (each
    with `with_family`'s combinations; its pool, as round 2's families': alone and with the sentinels)."""
    found = candidates(place)
    for name, signals in (extra or {}).items():
        found.update(with_family(name, signals))
    results = [{"place": place, **row} for row in r2.evaluate(runs, admitted_here, found, alarms)]
    pools = {family: [r for r in results if r["combination"] in (family, f"{family}+sentinels")]
             for family in ("geometry", "spectrum", "drift")}  # fmt: skip
    if place == "outputs":
        pools["outputs"] = [r for r in results if r["combination"].startswith("outputs")]
    for name in extra or {}:
        pools[name] = [r for r in results if r["combination"] in (name, f"{name}+sentinels")]
    for name in (*r1.ANCHORS, "sentinels"):
        signals = r1.SENTINELS if name == "sentinels" else (name,)
        pools[name] = [{"place": place, **row} for row in r2.evaluate(runs, admitted_here, {name: signals}, alarms)]
    best = r2.best_at_zero(results)
    return {
        "best": best if choosing and best is not None and best["scenarios_caught"] else None,
        "at_zero": {name: r2.best_at_zero(pool) for name, pool in pools.items()},
        **{name: r2.replayed(runs, admitted_here, name, alarms) for name in REPLAYED}, "results": results,
    }  # fmt: skip


def report(directory: Path, split: str) -> dict[str, Any]:
    """Round 3's report of one split: admission, each place's results, the choice (design: across both places, by
    ROUND2.md's order) and, on the held-out split, the keep rule."""
    scenarios = scenarios_of(split)
    admission = {name: admitted(directory, name) for name in scenarios}
    places = {}
    for place in PLACES:
        here = tuple(name for name in scenarios if admission[name][place])
        runs = load_runs(directory, split, place, places["features"]["runs"] if place == "outputs" else None)
        places[place] = place_report(runs, here, split == "design", place)
        shipped = r2.shipped_cadence_runs(runs, lambda run: recording(directory, run.scenario, run.seed), place)
        places[place]["shipped"] = {name: r2.replayed(shipped, here, name, alarms) for name in REPLAYED[1:]}
        places[place]["runs"] = runs
    for found in places.values():
        del found["runs"]
    bests = [found["best"] for found in places.values() if found["best"] is not None]
    out = {"admission": admission, "places": places, "chosen": min(bests, key=r2.rank) if bests else None}
    if split == "held_out":
        out["keep"] = keep_rule(places)
    return out


def keep_rule(places: dict[str, Any]) -> dict[str, Any]:
    """ROUND3.md's rule, at the shipped cadence: the default keeps its silent path on when, at some place, the
    default catches an admitted held-out scenario and its silent path alarms on at most 1 of the held-out healthy
    runs."""
    rows = {place: {"caught": found["shipped"]["default"]["scenarios_caught"],
                    "silent_alarmed": found["shipped"]["default_silent"]["healthy_alarmed"],
                    "healthy": found["shipped"]["default_silent"]["healthy_runs"]}
            for place, found in places.items()}  # fmt: skip
    keep = any(row["caught"] and row["silent_alarmed"] <= 1 for row in rows.values())
    return {"by_place": rows, "keep": keep}


def markdown(payload: dict[str, Any]) -> str:
    """The split's page: admission, then per place the default (both cadences), the loss-only rule, the choice and
    each family's and anchor's best at zero healthy alarms; on the held-out split, the keep rule."""
    lines = [f"Round 3, split **{payload['split']}** (classes {', '.join(payload['classes'])}; traps "
             f"{', '.join(payload['traps'])}); evaluation seeds 0-5; evaluated at commit `{payload['commit'][:12]}`.",
             "", "Admission (ROUND3.md: the silence check with room, and the harm where the monitor watches):", "",
             "| scenario | silence check | linear probe of the watched features at the 5 % point, faulted - twin "
             "(95 % interval) | admitted at the features | at the outputs |", "|---|---|---|---|---|"]  # fmt: skip
    for name, found in payload["admission"].items():
        d = found["linear_probe_difference"]
        probe = "-" if d is None else f"{d['mean']:+.3f} ({d['low']:+.3f} to {d['high']:+.3f})"
        yes = {True: "yes", False: "no"}
        lines.append(f"| {name} | {'passes' if found['silence_passed'] else 'fails'} | {probe} | "
                     f"{yes[found['features']]} | {yes[found['outputs']]} |")  # fmt: skip
    chosen = payload.get("chosen")
    if payload["split"] == "design":
        lines += ["", "Chosen: nothing." if chosen is None else
                  f"Chosen: `{chosen['combination']}` at the {chosen['place']}, score {chosen['score']}, "
                  f"k {chosen['k']:g}, p {chosen['p']}."]  # fmt: skip
    for place, found in payload["places"].items():
        rows = [("the default (every 10 steps)", found["default"]),
                ("the default, shipped cadence", found["shipped"]["default"]),
                ("its silent path alone, shipped cadence", found["shipped"]["default_silent"]),
                ("loss-only rule", found["loss_rule"]),
                *([("best at zero healthy alarms", found["best"])] if found.get("best") else []),
                *found["at_zero"].items()]  # fmt: skip
        lines += ["", f"At the **{place}**:", "", "| signal | candidate | seeds caught / caught silently (of 6), per "
                  "admitted scenario | scenarios caught | median lead (steps) | healthy runs alarmed |",
                  "|---|---|---|---|---|---|", *(r2.row(name, row) for name, row in rows)]  # fmt: skip
    if "keep" in payload:
        keep = payload["keep"]
        lines += ["", "The keep rule (ROUND3.md, at the shipped cadence): the default keeps its silent path on: "
                  f"**{'yes' if keep['keep'] else 'no'}**.", "",
                  "| place | admitted held-out scenarios the default catches | healthy runs its silent path alarms |",
                  "|---|---|---|", *(f"| {place} | {', '.join(row['caught']) or 'none'} | "
                                     f"{row['silent_alarmed']}/{row['healthy']} |"
                                     for place, row in keep["by_place"].items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return r1.round_main(argv, __doc__, SPLITS, "silent_r3", ROUND3, STAGE_2, evaluate, markdown)


def evaluate(args: Any) -> dict[str, Any]:
    """Record the split's missing evaluation seeds when asked (the classifiers with their logits), then report."""
    scenarios = [*scenarios_of(args.split), *(TRAPS[t] for t in SPLITS[args.split][1])]
    if args.record:
        r1.record_missing(sorted(set(scenarios) & CLASSIFIERS), args.recordings / "round3", args.jobs)
        r1.record_missing(sorted(set(scenarios) - CLASSIFIERS), args.recordings, args.jobs)
    classes, traps = SPLITS[args.split]
    return {"classes": list(classes), "traps": list(traps), **report(args.recordings, args.split)}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
