"""Round 4 of the silent suite (``benchmarks/silent/ROUND4.md``): the embedding is the product.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round4.py --split design --record --jobs 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round4.py --split held_out --record --jobs 2

Records the split's evaluation seeds (``recordings/evaluation/``), checks each faulted scenario's silence (with room:
admitted, its harm being the watched embedding's pair accuracy), replays round 2's candidates, the anchors, the
loss-only rule, the default as shipped (both cadences) and round 2's silent path as a user turns it on, and on the
design split chooses by ROUND4.md's rule. Writes ``benchmarks/results/silent_r4_<split>.{json,md}``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
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
from silent_signals import COMPUTED_FAMILIES, NEIGHBOURS  # noqa: E402

CLASSES = {"D1": ("simclr_negatives_fade",), "D2": ("simsiam_stopgrad_fade",), "H1": ("vicreg_variance_fade",),
           "H2": ("simsiam_predictor_fade",)}  # fmt: skip
TRAPS = {"T5": "trap_simclr_to_supcon", "T6": "trap_temperature_anneal"}
SPLITS = {"design": (("D1", "D2"), ("T5",)), "held_out": (("H1", "H2"), ("T6",))}
#: The rules replayed as they act: round 3's, and round 2's silent path as a user turns it on (``silent_path=True``).
REPLAYED = (*r3.REPLAYED, "opt_in_silent")
ROUND4 = HERE / "ROUND4.md"
STAGE_2 = "## Stage 2: the choice (round 4)"


@dataclasses.dataclass(frozen=True)
class Layout:
    """A round of embedding scenarios (rounds 4 and 5): its number, classes, traps and splits (a split: its classes'
    ids and its traps' ids). Its results are ``silent_r<number>_<split>.{json,md}``."""

    number: int
    classes: dict[str, tuple[str, ...]]
    traps: dict[str, str]
    splits: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
    #: New candidate families of the round beside round 2's (round 6: ``{"neighbours": NEIGHBOURS}``).
    extra: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def stem(self) -> str:
        return f"silent_r{self.number}"

    def scenarios_of(self, split: str) -> tuple[str, ...]:
        """The faulted scenarios of a split, in its classes' order."""
        return tuple(name for c in self.splits[split][0] for name in self.classes[c])

    def names_of(self, split: str) -> list[str]:
        """Every scenario of a split: the faulted ones, then the traps."""
        return [*self.scenarios_of(split), *(self.traps[t] for t in self.splits[split][1])]


LAYOUT = Layout(4, CLASSES, TRAPS, SPLITS)
scenarios_of, names_of = LAYOUT.scenarios_of, LAYOUT.names_of


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


def load_runs(directory: Path, split: str, layout: Layout = LAYOUT) -> list[r1.Run]:
    """The split's runs with every signal at the watched embedding (round 3's), and the opt-in silent path."""

    def values_of(data: Any, kind: str, steps: np.ndarray) -> dict[str, np.ndarray]:
        values = r3.run_values(data, kind, steps, "features")
        values["opt_in_silent"] = opt_in_replay(data[f"{kind}/features"], steps, values)
        for family in layout.extra:
            values.update(COMPUTED_FAMILIES[family](data[f"{kind}/features"]))
        return values

    runs = []
    for name, seed in itertools.product(layout.names_of(split), r1.EVALUATION_SEEDS):
        with np.load(recording(directory, name, seed)) as data:
            runs += r3.runs_of(data, name, seed, functools.partial(values_of, data))
    return runs


def report(directory: Path, split: str, layout: Layout = LAYOUT) -> dict[str, Any]:
    """Admission, every candidate and anchor at the features, the replayed rules (both cadences) and the choice."""
    out, _ = report_runs(directory, split, layout)
    return out


def report_runs(directory: Path, split: str, layout: Layout) -> tuple[dict[str, Any], list[r1.Run]]:
    """`report`, and the split's runs with the admitted scenarios (for a later round's extra rows)."""
    scenarios = layout.scenarios_of(split)
    admission = {name: admitted(directory, name) for name in scenarios}
    here = tuple(name for name in scenarios if admission[name]["silence_passed"])
    runs = load_runs(directory, split, layout)
    found = r3.place_report(runs, here, split == "design", "features", layout.extra)
    shipped = r2.shipped_cadence_runs(runs, lambda run: recording(directory, run.scenario, run.seed))
    found["shipped"] = {name: r2.replayed(shipped, here, name, r3.alarms) for name in REPLAYED[1:3]}
    found["opt_in_silent"] = r2.replayed(runs, here, "opt_in_silent", alarms)
    out = {"admission": admission, "admitted": list(here), **found, "chosen": found["best"],
           "recording_seconds": recording_seconds(directory, split, layout)}  # fmt: skip
    design = out if split == "design" else json.loads((r1.RESULTS / f"{layout.stem}_design.json").read_text())
    if split == "held_out":  # the two-sided loss anchor at its setting with no design alarm (ROUND4.md's target)
        out["loss_anchor"] = judged(runs, here, design["at_zero"].get("loss_two_sided"))
    if design["chosen"] is not None:  # the design's choice, and which of its signals fired first where it caught
        out["design_choice"] = judged(runs, here, design["chosen"])
        out["first_signals"] = first_signals(runs, design["chosen"])
    if split == "held_out":
        out["targets"] = targets(out, design)
    return out, runs


def recording_seconds(directory: Path, split: str, layout: Layout = LAYOUT) -> dict[str, float]:
    """Each scenario's recording time (seconds, summed over its evaluation seeds; both branches of a seed are one
    recording), as the recorder measured it (``jobs`` processes shared the machine's cores)."""
    found = {}
    for name in layout.names_of(split):
        total = 0.0
        for seed in r1.EVALUATION_SEEDS:
            with np.load(recording(directory, name, seed)) as data:
                total += float(data["seconds"])
        found[name] = round(total, 1)
    return found


def judged(runs: list[r1.Run], scenarios: tuple[str, ...], row: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored candidate row (combination, score, k, p) judged again on ``runs``."""
    if row is None:
        return None
    signals = FAMILY_SIGNALS[row["combination"]]
    return {"combination": row["combination"], **r2.judge(runs, scenarios, signals, row["score"], row["k"],
                                                          row["p"], alarms)}  # fmt: skip


#: Every combination's signals (round 6's family's too), and the anchors' (one each).
FAMILY_SIGNALS = {**r1.combinations(), **r3.with_family("neighbours", NEIGHBOURS),
                  **{name: (name,) for name in r1.ANCHORS}}  # fmt: skip


def first_signals(runs: list[r1.Run], row: dict[str, Any]) -> dict[str, dict[str, int]]:
    """For each faulted scenario, how often each of the chosen combination's signals alarmed at its first alarm
    after the fault, on the runs it caught (a signal the topology computes, ``modes``, counts apart)."""
    signals = FAMILY_SIGNALS[row["combination"]]
    found: dict[str, dict[str, int]] = {}
    for run in runs:
        if run.kind != "collapse" or run.point is None:
            continue
        hits = {s: alarms(run, s, row["score"], row["k"], row["p"]) & (run.steps > run.fault) for s in signals}
        fired = [i for i in range(run.steps.size) if any(h[i] for h in hits.values())]
        if not fired or run.steps[fired[0]] >= run.point:
            continue
        counts = found.setdefault(run.scenario, {})
        for signal, hit in hits.items():
            counts[signal] = counts.get(signal, 0) + int(hit[fired[0]])
    return found


def targets(held_out: dict[str, Any], design: dict[str, Any]) -> dict[str, Any]:
    """ROUND4.md's targets on the held-out split: the design's choice catches every admitted held-out scenario, few
    healthy runs alarmed (held out; both splits), and the loss alone (its rule; the two-sided loss anchor at its
    zero-design-alarm setting) catches at most one admitted held-out scenario."""
    admitted = held_out["admitted"]
    choice, before = held_out.get("design_choice"), design.get("design_choice")
    anchor = held_out.get("loss_anchor") or {"scenarios_caught": []}
    loss_caught = sorted(set(held_out["loss_rule"]["scenarios_caught"]) | set(anchor["scenarios_caught"]))
    healthy = None if choice is None else choice["healthy_alarmed"]
    both = None if choice is None or before is None else choice["healthy_alarmed"] + before["healthy_alarmed"]
    runs = None if choice is None or before is None else choice["healthy_runs"] + before["healthy_runs"]
    return {
        "catches_admitted": choice is not None and bool(admitted) and set(admitted) <= set(choice["scenarios_caught"]),
        "healthy_held_out": healthy, "healthy_held_out_met": healthy is not None and healthy <= 1,
        "healthy_both": both, "healthy_both_runs": runs, "healthy_both_met": both is not None and both <= 1,
        "loss_caught": loss_caught, "loss_met": len(loss_caught) <= 1,
    }  # fmt: skip


def markdown(payload: dict[str, Any]) -> str:
    """The split's page: admission with each seed's 5 % point, the choice, then every rule and family."""
    number = payload.get("round", 4)
    lines = [f"Round {number}, split **{payload['split']}** (scenarios {', '.join(payload['scenarios'])}; traps "
             f"{', '.join(payload['traps'])}); evaluation seeds 0-5; evaluated at commit `{payload['commit'][:12]}`.",
             "", f"Admission (ROUND{number}.md: the silence check with room on >= 5 of 6 seeds):", "",
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
    rows = [*([("the design's choice", payload["design_choice"])] if payload.get("design_choice") else []),
            *([("two-sided loss at its zero-design-alarm setting", payload["loss_anchor"])]
              if payload.get("loss_anchor") else []),
            ("the default (every 10 steps)", payload["default"]),
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
        if found is not None and found["runs"]:  # the exact 95 % interval of the faulted runs caught
            low, high = r1.interval(found["runs_caught"], found["runs"])
            rate = f"{found['runs_caught']}/{found['runs']} ({low:.2f}-{high:.2f})"
        lines.append(f"{r2.row(name, found)} {rate} |")
    if payload.get("first_signals"):
        lines += ["", "Which of the design choice's signals alarmed at its first alarm, on the faulted runs it caught "
                  "(`modes` is the topological one: Betti-0 at a fixed scale, clusters of >= 1 % of the probe):", "",
                  "| scenario | " + " | ".join(FAMILY_SIGNALS[payload["design_choice"]["combination"]]) + " |",
                  "|---|" + "---|" * len(FAMILY_SIGNALS[payload["design_choice"]["combination"]])]  # fmt: skip
        for name, counts in payload["first_signals"].items():
            lines.append(f"| {name} | " + " | ".join(str(n) for n in counts.values()) + " |")
    if payload.get("recording_seconds"):
        times = ", ".join(f"{name} {seconds / 60:.0f} min" for name, seconds in payload["recording_seconds"].items())
        lines += [
            "",
            f"Recording time, 6 seeds each (the recorder's wall-clock; two processes on two cores, not alone on the "
            f"machine): {times}.",
        ]
    if "targets" in payload:
        lines += ["", f"Targets (ROUND{number}.md, held-out split):", "", "| target | result | |", "|---|---|---|",
                  *(f"| {what} | {result} | {'met' if met else '**missed**'} |" for what, result, met in
                    target_rows(payload))]  # fmt: skip
    return "\n".join(lines) + "\n"


def report_with_earlier(directory: Path, split: str, layout: Layout, earlier: int, key: str) -> dict[str, Any]:
    """A later round's report of the split (`report_runs`), and on its held-out split round ``earlier``'s stored
    choice judged on it, under ``key``."""
    out, runs = report_runs(directory, split, layout)
    out["round"] = layout.number
    if split == "held_out":
        design = json.loads((r1.RESULTS / f"silent_r{earlier}_design.json").read_text())
        out[key] = judged(runs, tuple(out["admitted"]), design["chosen"])
    return out


def markdown_with_earlier(payload: dict[str, Any], key: str, what: str) -> str:
    """`markdown`'s page, and after it the paragraph of the earlier round's choice (``what``) judged on the split."""
    text = markdown(payload)
    found = payload.get(key)
    if found is None:
        return text
    low, high = r1.interval(found["runs_caught"], found["runs"]) if found["runs"] else (0.0, 1.0)
    return text + (f"\n{what} on this split: " + ", ".join(f"{name} {n}/6" for name, n in found["seeds_caught"].items())
                   + f"; faulted runs caught {found['runs_caught']}/{found['runs']} ({low:.2f}-{high:.2f}); healthy "
                   f"runs alarmed {found['healthy_alarmed']}/{found['healthy_runs']}.\n")  # fmt: skip


def target_rows(payload: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The held-out targets as (what, result, met) rows."""
    t = payload["targets"]
    choice = payload.get("design_choice") or {}
    caught = ", ".join(choice.get("scenarios_caught", [])) or "none"
    return [
        ("the design's choice catches every admitted held-out scenario",
         f"{caught} caught of {', '.join(payload['admitted']) or 'none admitted'}", t["catches_admitted"]),
        ("healthy runs alarmed, held out (<= 1)", f"{t['healthy_held_out']}/{choice.get('healthy_runs', '-')}",
         t["healthy_held_out_met"]),
        ("healthy runs alarmed, both splits (<= 1)", f"{t['healthy_both']}/{t['healthy_both_runs']}",
         t["healthy_both_met"]),
        ("the loss alone catches <= 1 admitted held-out scenario", ", ".join(t["loss_caught"]) or "none",
         t["loss_met"]),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return r1.round_main(argv, __doc__, SPLITS, "silent_r4", ROUND4, STAGE_2, evaluate, markdown)


def evaluate(args: Any) -> dict[str, Any]:
    """Record the split's missing evaluation seeds when asked, then report."""
    return evaluate_layout(args, LAYOUT, report)


def evaluate_layout(args: Any, layout: Layout, reported: Any) -> dict[str, Any]:
    """Record a round's split's missing evaluation seeds when asked, then ``reported(directory, split)``."""
    scenarios, traps = layout.scenarios_of(args.split), [layout.traps[t] for t in layout.splits[args.split][1]]
    if args.record:
        r1.record_missing([*scenarios, *traps], args.recordings, args.jobs)
    return {"scenarios": list(scenarios), "traps": traps, **reported(args.recordings, args.split)}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
