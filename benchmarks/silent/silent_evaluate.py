"""The silent suite's evaluation (``benchmarks/silent/PREREGISTERED.md``): which signals catch a silent collapse
before its harm, and at what cost to healthy runs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/silent_evaluate.py --split design

For every recording (``benchmarks/silent/recordings/``, seeds 0-5), the candidates (``silent_signals.py``) and the
training channels are computed per check; each candidate (a combination of signals, a score, a threshold ``k`` and a
patience ``p``) is replayed on every run; a faulted run is *caught* when the candidate's first alarm after the fault
comes strictly before the run's 5 % point (``silence.harm_point``), and a healthy run (a twin, a trap) is
*alarmed* when it alarms anywhere after the warm-up (alarms on a faulted run's shared prefix count as its twin's).
On ``--split design`` it applies the pre-registered choice (no alarm on the design split's healthy runs; the most
design classes caught; then the ties) and writes ``benchmarks/results/silent_design.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "collapse"))
sys.path.insert(0, str(HERE.parents[1]))

from silence import RECORDINGS, harm_point, loss_rule_fires  # noqa: E402
from silent_signals import DIRECTIONS, FAMILIES, WARMUP, feature_signals, lidar, training_signals  # noqa: E402

from topocallbacks import silent  # noqa: E402
from topocallbacks.policy import rule_holds, rule_scores  # noqa: E402
from topocallbacks.settings import PolicySettings  # noqa: E402

RESULTS = HERE.parents[1] / "benchmarks" / "results"
EVALUATION_SEEDS = tuple(range(6))
#: The classes and their scenarios (a class with two variants needs both); the traps.
CLASSES = {
    "S1": ("simsiam_no_stopgrad",),
    "S2": ("contrastive_no_negatives", "minilm_pairs_no_negatives"),
    "S3": ("watermark_shortcut",),
    "S4": ("generator_modes_grid", "generator_modes_circle"),
    "S5": ("vae_kl_bug",),
    "S6": ("minilm_forgetting",),
}
TRAPS = {"T1": "trap_neural_collapse", "T2": "trap_transfer"}
SPLITS = {"design": (("S1", "S3", "S4", "S5"), ("T2",)), "held_out": (("S2", "S6"), ("T1",))}
THRESHOLDS = (3.0, 4.5, 6.0, 8.0, 12.0)
PATIENCES = (2, 3, 4)
SCORES = ("trailing", "frozen")
SENTINELS = FAMILIES["sentinels"]


@dataclasses.dataclass
class Run:
    """One run's per-check signals: a faulted run (its fault step and 5 % point) or a healthy one."""

    scenario: str
    seed: int
    kind: str  # "collapse", "healthy" or "trap"
    steps: np.ndarray
    values: dict[str, np.ndarray]
    fault: int | None = None
    point: int | None = None


def frozen_scores(values: np.ndarray, direction: int, warmup: int = WARMUP) -> np.ndarray:
    """Score (ii): the robust z-score against the warm-up checks, frozen (NaN during the warm-up); the library's
    (`topocallbacks.silent.frozen_scores`, the geometry family's score)."""
    return silent.frozen_scores(values, direction, warmup)


#: The anchors (PREREGISTERED.md: reported beside the candidates, never selected). ``loss_two_sided`` is the
#: training loss scored both ways (a rise or a drop).
ANCHORS = ("rankme", "lidar", "norm_std", "loss", "loss_two_sided", "grad_norm")
#: The silence check's rule: the library's ``Policy`` on the loss channel alone at its defaults (replayed as the
#: policy itself, with the training channels' noise floor; ``score``, ``k`` and ``p`` are its defaults, for the
#: tables). The ``loss`` anchor is scored as every candidate is, without that floor.
LOSS_RULE = ("loss_rule", "trailing", 4.5, 1)
#: Signals computed from another one's values.
SOURCES = {"loss_two_sided": "loss", "loss_rule": "loss"}


def _scores(values: np.ndarray, direction: int, score: str, k: float) -> np.ndarray:
    if score == "trailing":
        return rule_scores(values, PolicySettings(threshold=k, warmup=WARMUP), direction=direction)
    return frozen_scores(values, direction)


def alarms(values: np.ndarray, signal: str, score: str, k: float, p: int) -> np.ndarray:
    """Where one signal alarms (a boolean per check)."""
    if signal in SENTINELS or signal == "default":
        return np.nan_to_num(values, nan=0.0) >= 1.0
    if signal == "loss_rule":
        means = [float(v) if math.isfinite(v) else None for v in values]
        return np.array(loss_rule_fires(means), dtype=bool)
    if signal == "loss_two_sided":
        both = np.fmax(_scores(values, 1, score, k), _scores(values, -1, score, k))
        return rule_holds(np.nan_to_num(both, nan=-math.inf), k, p, WARMUP)
    scores = _scores(values, DIRECTIONS.get(signal, 1), score, k)
    return rule_holds(np.nan_to_num(scores, nan=-math.inf), k, p, WARMUP)


def combinations() -> dict[str, tuple[str, ...]]:
    """The pre-registered combinations: each family alone, each pair, all three, each with and without the
    sentinels."""
    families = ("geometry", "spectrum", "drift")
    out: dict[str, tuple[str, ...]] = {}
    for size in (1, 2, 3):
        for chosen in itertools.combinations(families, size):
            signals = tuple(s for f in chosen for s in FAMILIES[f])
            out["+".join(chosen)] = signals
            out["+".join(chosen) + "+sentinels"] = signals + SENTINELS
    return out


def first_alarm(run: Run, signals: tuple[str, ...], score: str, k: float, p: int,
                hits: Callable[[str], np.ndarray] | None = None) -> tuple[int | None, bool]:  # fmt: skip
    """The first alarm after the fault (faulted runs) and whether the run alarms where a healthy run would (anywhere
    after the warm-up for a healthy run; on the shared prefix for a faulted one). ``hits(signal)``: where a signal
    alarms (default: `alarms` on the run's values; round 2 passes its repaired score)."""
    hit = np.zeros(run.steps.size, dtype=bool)
    for signal in signals:
        hit |= (hits(signal) if hits is not None else
                alarms(run.values[SOURCES.get(signal, signal)], signal, score, k, p))  # fmt: skip
    if "default" not in signals:  # the default touches a run wherever it acts, its sentinels in the warm-up too
        hit[:WARMUP] = False
    steps = run.steps[hit]
    if run.kind != "collapse":
        return None, bool(steps.size)
    after = steps[steps > run.fault]
    return (int(after[0]) if after.size else None), False


def default_actions(frames: np.ndarray, steps: np.ndarray, values: dict[str, np.ndarray]) -> np.ndarray:
    """Where the library's default (``MonitorSettings()``: its check pipeline and rule, the training loss and
    gradient norm since the last check passed as the adapters pass them) decides anything but nothing (1.0), replayed
    open-loop on a run's recorded features: its first action is where it would first touch the run."""
    return default_replay(frames, steps, values)[0]


def default_replay(
    frames: np.ndarray, steps: np.ndarray, values: dict[str, np.ndarray], settings: Any = None
) -> tuple[np.ndarray, ...]:
    """`default_actions`, and where of those the default's silent path decided (its reason starts "silent path");
    ``settings``: other `MonitorSettings` than the default's (round 4 replays round 2's path turned on)."""
    from topocallbacks.pipeline import CheckPipeline
    from topocallbacks.settings import MonitorSettings

    def channel(name: str, i: int) -> float | None:
        value = float(values[name][i])
        return value if math.isfinite(value) else None

    pipeline = CheckPipeline(MonitorSettings() if settings is None else settings)
    fired, silent = np.zeros(len(frames)), np.zeros(len(frames))
    for i, (frame, step) in enumerate(zip(frames, steps, strict=True)):
        dynamics = {"loss": channel("loss", i), "grad_norm": channel("grad_norm", i)}
        record = pipeline.evaluate(frame, int(step), dynamics).record
        fired[i] = float(record is not None and record.decision.fired)
        silent[i] = float(fired[i] == 1.0 and record is not None and record.decision.reason.startswith("silent path"))
    return fired, silent


def load_runs(directory: Path, scenarios: list[str], seeds: tuple[int, ...]) -> list[Run]:
    """Every run of the recordings, with its signals (computed here, from the recorded features and losses)."""
    runs = []
    for name in scenarios:
        for seed in seeds:
            path = directory / f"{name}-seed{seed}.npz"
            data = np.load(path)
            fault = int(data["fault_step"])
            trap = name.startswith("trap_")
            point = None
            if not trap:
                point = harm_point(data["collapse/check_steps"], data["collapse/metric"], data["healthy/metric"],
                                   fault, bool(data["higher_is_better"]))  # fmt: skip
            for kind in ("healthy",) if trap else ("collapse", "healthy"):
                steps = data[f"{kind}/check_steps"]
                values, _ = feature_signals(data[f"{kind}/features"])
                values.update(training_signals(steps, data[f"{kind}/loss"], data[f"{kind}/grad_norm"]))
                values["default"] = default_actions(data[f"{kind}/features"], steps, values)
                if f"{kind}/views" in data.files:  # the LiDAR anchor
                    values["lidar"] = np.array([lidar(v) for v in data[f"{kind}/views"]])
                runs.append(Run(name, seed, "trap" if trap else kind, steps, values, fault, point))
    return runs


@dataclasses.dataclass
class Tally:
    """One candidate's outcome over runs: per scenario whether each faulted run was caught, the caught runs with
    their first alarm, and the healthy runs alarmed of those judged."""

    caught: dict[str, list[bool]] = dataclasses.field(default_factory=dict)
    hits: list[tuple[Run, int]] = dataclasses.field(default_factory=list)
    alarmed: int = 0
    healthy: int = 0


def tally(runs: list[Run], signals: tuple[str, ...], score: str, k: float, p: int,
          hits: Callable[[Run, str], np.ndarray] | None = None) -> Tally:  # fmt: skip
    """Replay one candidate on every run (``hits(run, signal)``: where a signal alarms, as in `first_alarm`)."""
    found = Tally()
    for run in runs:
        if any(SOURCES.get(signal, signal) not in run.values for signal in signals):
            continue  # an anchor a recording cannot give (LiDAR without views)
        where = None if hits is None else functools.partial(hits, run)
        alarm, healthy_alarm = first_alarm(run, signals, score, k, p, where)
        if run.kind != "collapse":
            found.alarmed += healthy_alarm
            found.healthy += 1
            continue
        # Alarms on the shared prefix are the twin's (its run holds the same checks up to the fault).
        hit = alarm is not None and run.point is not None and alarm < run.point
        found.caught.setdefault(run.scenario, []).append(hit)
        if hit and alarm is not None:
            found.hits.append((run, alarm))
    return found


def judge(runs: list[Run], classes: tuple[str, ...], signals: tuple[str, ...], score: str, k: float,
          p: int) -> dict[str, Any]:  # fmt: skip
    """One candidate on ``runs``: seeds caught per scenario, classes caught, median lead, healthy runs alarmed."""
    found = tally(runs, signals, score, k, p)
    caught, leads = found.caught, [run.point - alarm for run, alarm in found.hits if run.point is not None]
    alarmed, healthy = found.alarmed, found.healthy
    by_class = {c: all(sum(caught.get(s, [])) >= 5 for s in CLASSES[c]) for c in classes if c in CLASSES}
    return {
        "score": score, "k": k, "p": p, "signals": len(signals), "classes_caught": sum(by_class.values()),
        "by_class": by_class, "seeds_caught": {name: sum(v) for name, v in caught.items()},
        "runs": sum(len(v) for v in caught.values()), "runs_caught": sum(sum(v) for v in caught.values()),
        "median_lead": float(np.median(leads)) if leads else None, "healthy_alarmed": alarmed,
        "healthy_runs": healthy,
    }  # fmt: skip


def evaluate(
    runs: list[Run], classes: tuple[str, ...], candidates: dict[str, tuple[str, ...]] | None = None
) -> list[dict[str, Any]]:
    """Every candidate (default: the pre-registered combinations) at every score, ``k`` and ``p`` on ``runs``."""
    found = []
    chosen = combinations() if candidates is None else candidates
    for (name, signals), score, k, p in itertools.product(chosen.items(), SCORES, THRESHOLDS, PATIENCES):
        found.append({"combination": name, **judge(runs, classes, signals, score, k, p)})
    return found


def interval(successes: int, n: int, method: str = "exact") -> tuple[float, float]:
    """The 95 % interval of a binomial proportion: ``"exact"`` (Clopper-Pearson) or ``"wilson"``."""
    from scipy.stats import binomtest

    if n == 0:
        return math.nan, math.nan
    found = binomtest(successes, n).proportion_ci(confidence_level=0.95, method=method)
    return float(found.low), float(found.high)


def clopper_pearson(successes: int, n: int) -> tuple[float, float]:
    """The exact 95 % interval of a binomial proportion."""
    return interval(successes, n, "exact")


def summary(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """A candidate's row of a family table: catch rate over the faulted runs and healthy runs alarmed (Wilson
    intervals), median lead, classes caught, and which candidate it is."""
    if result is None:
        return None
    caught, runs = result["runs_caught"], result["runs"]
    alarmed, healthy = result["healthy_alarmed"], result["healthy_runs"]
    return {
        "candidate": {key: result[key] for key in ("combination", "score", "k", "p") if key in result},
        "classes_caught": result["classes_caught"], "by_class": result["by_class"],
        "seeds_caught": result["seeds_caught"],
        "runs_caught": caught, "runs": runs, "catch_interval": interval(caught, runs, "wilson"),
        "median_lead": result["median_lead"], "healthy_alarmed": alarmed, "healthy_runs": healthy,
        "healthy_interval": interval(alarmed, healthy, "wilson"),
    }  # fmt: skip


def family_row(pool: list[dict[str, Any]]) -> dict[str, Any]:
    """One family's (or anchor's) line: its best candidate at the pre-registered healthy budget (no healthy run
    alarmed), and the fewest healthy runs alarmed by any of its candidates that catches a class."""
    catching = [r for r in pool if r["classes_caught"] > 0]
    cheapest = min(catching, key=lambda r: (r["healthy_alarmed"], -r["classes_caught"], -r["runs_caught"]),
                   default=None)  # fmt: skip
    return {"at_zero": summary(best_within(pool, 0)), "cheapest_catch": summary(cheapest)}


def silence_checks(directory: Path, scenarios: list[str], seeds: tuple[int, ...]) -> dict[str, Any]:
    """The silence check (``silence.check``) re-run on the evaluation seeds' recordings, per scenario: the seeds that
    pass and whether the scenario does (>= 5 of 6)."""
    from silence import check

    out: dict[str, Any] = {}
    for name in scenarios:
        if name.startswith("trap_"):
            continue
        found = [check(directory / f"{name}-seed{seed}.npz") for seed in seeds]
        passed = sum(r["passed"] for r in found)
        out[name] = {"passed": passed, "seeds": len(found), "passes": passed >= 5, "per_seed": found}
    return out


def report(runs: list[Run], classes: tuple[str, ...], choosing: bool = True) -> dict[str, Any]:
    """The pre-registered report of one split: every candidate, the choice (made on the design split only:
    ``choosing=False`` for the held-out split, whose page reports the design split's choice), each family's and
    anchor's line at the same healthy budget (`family_row`), the loss-only rule, and per class the chosen
    candidate's seeds with exact intervals."""
    results = evaluate(runs, classes)
    chosen = choose(results) if choosing else None
    families = {
        family: family_row([r for r in results if r["combination"] in (family, f"{family}+sentinels")])
        for family in ("geometry", "spectrum", "drift")
    }
    families["sentinels"] = family_row(evaluate(runs, classes, {"sentinels": SENTINELS}))
    anchors = {name: family_row(evaluate(runs, classes, {name: (name,)})) for name in ANCHORS}
    signal, score, k, p = LOSS_RULE
    loss_rule = {"combination": signal, **judge(runs, classes, (signal,), score, k, p)}
    default = {"combination": "default", **judge(runs, classes, ("default",), score, k, p)}
    per_class = {}
    if chosen is not None:
        for c in classes:
            for name in CLASSES.get(c, ()):
                got = chosen["seeds_caught"].get(name, 0)
                per_class[name] = {"caught": got, "seeds": 6, "interval": clopper_pearson(got, 6)}
    return {"chosen": chosen, "families": families, "anchors": anchors, "loss_rule": summary(loss_rule),
            "default": summary(default),
            "per_scenario": per_class, "results": results}  # fmt: skip


def best_within(results: list[dict[str, Any]], budget: int) -> dict[str, Any] | None:
    """The best candidate alarming on at most ``budget`` healthy runs: most classes; then the pre-registered ties
    (more caught runs, larger median lead, fewer signals, larger ``k``, larger ``p``, score (ii))."""
    eligible = [r for r in results if r["healthy_alarmed"] <= budget]
    if not eligible:
        return None
    return min(eligible, key=lambda r: (-r["classes_caught"], -r["runs_caught"], -(r["median_lead"] or 0),
                                        r["signals"], -r["k"], -r["p"], r["score"] != "frozen"))  # fmt: skip


def choose(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pre-registered choice on the design split: no healthy alarm; most classes (at least one); then the
    ties."""
    best = best_within(results, 0)
    return best if best is not None and best["classes_caught"] > 0 else None


PREREGISTRATION = HERE / "PREREGISTERED.md"
STAGE_2 = "## Stage 2: the chosen silent path"


def _record(job: tuple[str, int, str]) -> str:
    from cases import SCENARIOS
    from record import record

    name, seed, directory = job
    record(name, seed, Path(directory), scenario=SCENARIOS[name])
    return f"{name} seed {seed}"


def record_missing(scenarios: list[str], directory: Path, jobs: int) -> None:
    """Record the evaluation seeds of ``scenarios`` that have no recording in ``directory`` yet."""
    import concurrent.futures

    todo = [(name, seed, str(directory)) for name in scenarios for seed in EVALUATION_SEEDS
            if not (directory / f"{name}-seed{seed}.npz").exists()]  # fmt: skip
    print(f"recording {len(todo)} (scenario, seed) pairs into {directory}", flush=True)
    if jobs == 1:
        for job in todo:
            print(_record(job), flush=True)
        return
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        for done in pool.map(_record, todo):
            print(done, flush=True)


def _commit() -> str:
    """The commit the evaluation runs at (with ``+dirty`` when the library or the suites it uses had changes)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=False).stdout.strip()

    root = HERE.parents[1]
    paths = [str(root / "topocallbacks"), str(HERE), str(HERE.parent / "collapse")]
    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", *paths) else "")


def write_markdown(payload: dict[str, Any], path: Path) -> None:
    """The split's results page (``silent_pages.page``) beside its JSON."""
    from silent_pages import page

    path.write_text(page(payload))


def parser_for(description: str | None, splits: dict[str, Any]) -> argparse.ArgumentParser:
    """The evaluation scripts' command line (this one's and round 2's): the split, where the recordings and results
    are, recording first, worker processes, rendering the stored results again."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=sorted(splits), default="design")
    parser.add_argument("--recordings", type=Path, default=RECORDINGS / "evaluation")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--record", action="store_true", help="record the missing evaluation seeds first")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the stored .json only")
    return parser


def round_main(argv: list[str] | None, doc: str | None, splits: dict[str, Any], stem: str, registration: Path,
               stage_2: str, evaluate: Any, markdown: Any) -> int:  # fmt: skip
    """A later round's command line (rounds 3 and 4): parse; ``--render`` rewrites the page from the stored JSON;
    the held-out split runs only once ``registration`` holds ``stage_2``; else ``evaluate(args)`` (which records
    first when asked) gives the payload, stored as ``<out>/<stem>_<split>.{json,md}`` with the split and commit."""
    parser = parser_for(doc, splits)
    args = parser.parse_args(argv)
    stored = args.out / f"{stem}_{args.split}.json"
    if args.render:
        stored.with_suffix(".md").write_text(markdown(json.loads(stored.read_text())))
        return 0
    if args.split == "held_out" and stage_2 not in registration.read_text():
        parser.error(f"the held-out split is recorded and evaluated only after its stage 2 ({registration.name})")
    payload = {"split": args.split, "commit": _commit(), **evaluate(args)}  # the commit before the work
    args.out.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(payload, indent=1, default=_plain) + "\n")
    stored.with_suffix(".md").write_text(markdown(json.loads(stored.read_text())))
    print(f"{stem}, {args.split}: chosen {payload.get('chosen')}")
    return 0


def _plain(value: Any) -> Any:
    """numpy scalars in the stored results as plain numbers."""
    return value.item() if hasattr(value, "item") else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = parser_for(__doc__, SPLITS)
    args = parser.parse_args(argv)
    if args.render:
        stored = args.out / f"silent_{args.split}.json"
        write_markdown(json.loads(stored.read_text()), stored.with_suffix(".md"))
        return 0
    classes, traps = SPLITS[args.split]
    scenarios = [s for c in classes for s in CLASSES.get(c, ())] + [TRAPS[t] for t in traps]
    if args.split == "held_out" and STAGE_2 not in PREREGISTRATION.read_text():
        parser.error("the held-out split is recorded and evaluated only after stage 2 of PREREGISTERED.md")
    commit = _commit()  # before the work: the code that runs
    if args.record:
        record_missing(scenarios, args.recordings, args.jobs)
    runs = load_runs(args.recordings, scenarios, EVALUATION_SEEDS)
    found = report(runs, classes, choosing=args.split == "design")  # the held-out split is never chosen on
    silence = silence_checks(args.recordings, scenarios, EVALUATION_SEEDS)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"split": args.split, "classes": list(classes), "traps": list(traps), "commit": commit,
               "silence": silence, **found}  # fmt: skip
    (args.out / f"silent_{args.split}.json").write_text(json.dumps(payload, indent=1) + "\n")
    write_markdown(payload, args.out / f"silent_{args.split}.md")
    print(f"silent {args.split}: {len(found['results'])} candidates; chosen {found['chosen']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
