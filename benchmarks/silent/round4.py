"""Round 4 of the silent suite (``benchmarks/silent/ROUND4.md``): the embedding is the product.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round4.py --split design --record --jobs 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round4.py --split held_out --record --jobs 2

Records the split's evaluation seeds (``recordings/evaluation/``), checks each faulted scenario's silence (with room:
admitted, its harm being the watched embedding's pair accuracy), replays round 2's candidates, the anchors, the
loss-only rule, the default as shipped (both cadences) and round 2's silent path as a user turns it on, and on the
design split chooses by ROUND4.md's rule. Writes ``benchmarks/results/silent_r4_<split>.{json,md}``.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import round2 as r2  # noqa: E402
import round3 as r3  # noqa: E402
import silent_evaluate as r1  # noqa: E402

CLASSES = {"D1": ("simclr_negatives_fade",), "D2": ("simsiam_stopgrad_fade",), "H1": ("vicreg_variance_fade",),
           "H2": ("simsiam_predictor_fade",)}  # fmt: skip
TRAPS = {"T5": "trap_simclr_to_supcon", "T6": "trap_temperature_anneal"}
SPLITS = {"design": (("D1", "D2"), ("T5",)), "held_out": (("H1", "H2"), ("T6",))}
#: The rules replayed as they act: round 3's, and round 2's silent path as a user turns it on (``silent_path=True``).
REPLAYED = (*r3.REPLAYED, "opt_in_silent")
ROUND4 = HERE / "ROUND4.md"
STAGE_2 = "## Stage 2: the choice (round 4)"


def scenarios_of(split: str) -> tuple[str, ...]:
    """The faulted scenarios of a split, in its classes' order."""
    return tuple(name for c in SPLITS[split][0] for name in CLASSES[c])


def recording(directory: Path, name: str, seed: int) -> Path:
    return directory / f"{name}-seed{seed}.npz"


def admitted(directory: Path, name: str) -> dict[str, Any]:
    """ROUND4.md's admission: the silence check with room on >= 5 of the 6 evaluation seeds (the harm, pair accuracy
    of the watched embedding, is in what the monitor watches by construction)."""
    from silence import check

    checks = [check(recording(directory, name, seed)) for seed in r1.EVALUATION_SEEDS]
    return {"silence_passed": sum(c["passed"] for c in checks) >= 5, "seeds": checks}


def opt_in_replay(frames: np.ndarray, steps: np.ndarray, values: dict[str, np.ndarray]) -> np.ndarray:
    """Where the default with round 2's silent path turned on (``silent_path=True``) decided by that path."""
    from topocallbacks.settings import MonitorSettings

    return r1.default_replay(frames, steps, values, MonitorSettings().merged({"silent_path": True}))[1]


def alarms(run: r1.Run, signal: str, score: str, k: float, p: int) -> np.ndarray:
    """Round 3's alarms, with the opt-in silent path's replay (where it decided)."""
    if signal == "opt_in_silent":
        return np.nan_to_num(run.values[signal], nan=0.0) >= 1.0
    return r3.alarms(run, signal, score, k, p)


def load_runs(directory: Path, split: str) -> list[r1.Run]:
    """The split's runs with every signal at the watched embedding (round 3's), and the opt-in silent path."""

    def values_of(data: Any, kind: str, steps: np.ndarray) -> dict[str, np.ndarray]:
        values = r3.run_values(data, kind, steps, "features")
        values["opt_in_silent"] = opt_in_replay(data[f"{kind}/features"], steps, values)
        return values

    names = [*scenarios_of(split), *(TRAPS[t] for t in SPLITS[split][1])]
    runs = []
    for name, seed in itertools.product(names, r1.EVALUATION_SEEDS):
        with np.load(recording(directory, name, seed)) as data:
            runs += r3.runs_of(data, name, seed, functools.partial(values_of, data))
    return runs


def with_intervals(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """A result row with the exact 95 % intervals of its catch rate (faulted runs) and healthy-alarm rate."""
    if row is None:
        return None
    caught, healthy = r1.interval(row["runs_caught"], row["runs"]), r1.interval(row["healthy_alarmed"],
                                                                              row["healthy_runs"])  # fmt: skip
    return {**row, "caught_interval": caught, "alarmed_interval": healthy}


def report(directory: Path, split: str) -> dict[str, Any]:
    """Admission, every candidate and anchor at the features, the replayed rules (both cadences) and the choice."""
    scenarios = scenarios_of(split)
    admission = {name: admitted(directory, name) for name in scenarios}
    here = tuple(name for name in scenarios if admission[name]["silence_passed"])
    runs = load_runs(directory, split)
    found = r3.place_report(runs, here, split == "design", "features")
    shipped = r2.shipped_cadence_runs(runs, lambda run: recording(directory, run.scenario, run.seed))
    found["shipped"] = {name: r2.replayed(shipped, here, name, r3.alarms) for name in REPLAYED[1:3]}
    found["opt_in_silent"] = r2.replayed(runs, here, "opt_in_silent", alarms)
    found["at_zero"] = {name: with_intervals(row) for name, row in found["at_zero"].items()}
    found["best"] = with_intervals(found["best"])
    for name in REPLAYED:
        if name in found:
            found[name] = with_intervals(found[name])
    return {"admission": admission, "admitted": list(here), **found, "chosen": found["best"]}


def markdown(payload: dict[str, Any]) -> str:
    """The split's page: admission with each seed's 5 % point, the choice, then every rule and family."""
    lines = [f"Round 4, split **{payload['split']}** (scenarios {', '.join(payload['scenarios'])}; traps "
             f"{', '.join(payload['traps'])}); evaluation seeds 0-5; evaluated at commit `{payload['commit'][:12]}`.",
             "", "Admission (ROUND4.md: the silence check with room on >= 5 of 6 seeds):", "",
             "| scenario | 5 % point per seed (checks after the fault) | seeds passing | admitted |",
             "|---|---|---|---|"]  # fmt: skip
    for name, found in payload["admission"].items():
        points = ", ".join(
            "none" if c["five_percent_point"] is None else f"{c['five_percent_point']} ({c['checks_before_harm']})"
            for c in found["seeds"]
        )
        passing = sum(c["passed"] for c in found["seeds"])
        lines.append(f"| {name} | {points} | {passing}/6 | {'yes' if found['silence_passed'] else 'no'} |")
    chosen = payload["chosen"]
    if payload["split"] == "design":
        what = "nothing" if chosen is None else (f"`{chosen['combination']}`, score {chosen['score']}, "
                                                 f"k {chosen['k']:g}, p {chosen['p']}")  # fmt: skip
        lines += ["", f"Chosen: {what}."]
    rows = [("the default (every 10 steps)", payload["default"]),
            ("the default, shipped cadence", payload["shipped"]["default"]),
            ("round 2's silent path turned on (`silent_path=True`)", payload["opt_in_silent"]),
            ("loss-only rule", payload["loss_rule"]),
            *([("best at zero healthy alarms", payload["best"])] if payload.get("best") else []),
            *payload["at_zero"].items()]  # fmt: skip
    lines += ["", "| signal | candidate | seeds caught / caught silently (of 6), per admitted scenario | scenarios "
              "caught | median lead (steps) | healthy runs alarmed | faulted runs caught (95 % interval) |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, found in rows:
        rate = "-"
        if found is not None and found["runs"]:
            low, high = found["caught_interval"]
            rate = f"{found['runs_caught']}/{found['runs']} ({low:.2f}-{high:.2f})"
        lines.append(f"{r2.row(name, found)} {rate} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return r1.round_main(argv, __doc__, SPLITS, "silent_r4", ROUND4, STAGE_2, evaluate, markdown)


def evaluate(args: Any) -> dict[str, Any]:
    """Record the split's missing evaluation seeds when asked, then report."""
    scenarios, traps = scenarios_of(args.split), [TRAPS[t] for t in SPLITS[args.split][1]]
    if args.record:
        r1.record_missing([*scenarios, *traps], args.recordings, args.jobs)
    return {"scenarios": list(scenarios), "traps": traps, **report(args.recordings, args.split)}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
