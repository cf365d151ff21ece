"""Issue 35, item 4: the pre-registered held-out evaluation of the frozen rule (``benchmarks/PREREGISTERED.md``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/heldout.py --jobs 2

66 fresh (setting, seed) pairs (``faults.HELDOUT_SEEDS``: new seeds of the five settings and the new GRU byte LM),
each with one transient and one structural fault of a shape the actions were not designed against
(``faults.SHAPES``, assigned by the seed's position: ``faults.heldout_setup``), and their healthy twins; the rows
are the frozen rule with ``rollback``, the same actions on the loss alone, the standard metric with a rollback and a
cut, plain replay and no detector. The runs go through the suite's cache and harness (one cache directory per shape
pair); the analysis is the pre-registered one (:func:`analyse`): rescue rates over *harmed* runs only (the
unprotected twin ends > 2 % worse than the healthy one) with Wilson and cluster-bootstrap intervals, per setting and
per shape, runs that end below their unprotected twin, healthy twins acted on and their mean change, paired McNemar
tests, and each target judged by its row's criterion. Outputs: ``benchmarks/results/rescue_heldout.{json,md}``,
which name the commit of the pre-registration's stage 2 and the code of every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from audit import cluster_bootstrap, clusters  # noqa: E402
from cache import CACHE, cache_dir, code_version, preregistration  # noqa: E402
from faults import ARCHITECTURES, HELDOUT_SEEDS, Setup, heldout_setup  # noqa: E402
from outputs import (  # noqa: E402
    NONE,
    RESCUE_MARGIN,
    _finite,
    _library_version,
    _pct,
    build_records,
    mean_interval,
    mixed_code,
    sign_test,
    stale_code,
    wilson,
)

RESULTS = HERE.parents[1] / "benchmarks" / "results"
FROZEN = "ours_default+rollback"
#: The pre-registered rows, in the order the pages show them (``none+none`` is added by the harness).
ROWS = (FROZEN, "ours_loss_only+rollback", "metric+rollback_cut", "plain_replay+rollback")
COMPARED = ROWS[1:]
FAULT_CLASSES = ("transient", "structural")
#: The pre-registered targets (PREREGISTERED.md, "Targets and the decision rule").
TARGETS = {"transient": (0.70, 0.55), "structural": (0.40, 0.25), "healthy_acted": 1, "healthy_change_low": -0.005,
           "p": 0.05}  # fmt: skip


def groups(archs: list[str] | None = None) -> list[tuple[Setup, list[tuple[str, int, list[str]]]]]:
    """The held-out cells grouped by their setup (shape pair): ``[(setup, [(setting, seed, rows)])]``."""
    by_setup: dict[Setup, list[tuple[str, int, list[str]]]] = {}
    for arch, seeds in HELDOUT_SEEDS.items():
        if archs is not None and arch not in archs:
            continue
        for position, seed in enumerate(seeds):
            by_setup.setdefault(heldout_setup(position), []).append((arch, seed, list(ROWS)))
    return list(by_setup.items())


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def harmed(record: dict[str, Any]) -> bool:
    """A faulted run whose unprotected twin ends more than 2 % (relative) worse than its healthy twin."""
    return record["unprotected_change"] < -RESCUE_MARGIN


def below(record: dict[str, Any]) -> bool:
    """Whether a run ends worse than its unprotected twin (non-finite is worse than any finite; both: not below)."""
    mine, theirs = finite(record["final_metric"]), finite(record["unprotected_final_metric"])
    if not mine:
        return theirs
    return theirs and record["change_vs_unprotected"] < 0


def rate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rescued of ``runs`` with the Wilson and the cluster-bootstrap 95 % intervals (None for no runs)."""
    saved, n = sum(bool(r["rescued"]) for r in runs), len(runs)
    if n == 0:
        return {"rescued": 0, "runs": 0, "rate": None, "wilson": None, "bootstrap": None}
    return {"rescued": saved, "runs": n, "rate": saved / n, "wilson": list(wilson(saved, n)),
            "bootstrap": list(cluster_bootstrap(clusters(runs)))}  # fmt: skip


def mcnemar(records: list[dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    """Row ``a`` against row ``b`` on the same harmed runs: rescued by both, by ``a`` only, by ``b`` only, exact p."""

    def outcome(arm: str) -> dict[tuple[str, int, str], bool]:
        return {(r["setting"], r["seed"], r["fault"]): bool(r["rescued"]) for r in records
                if r["arm"] == arm and r["fault"] != "none" and harmed(r)}  # fmt: skip

    mine, theirs = outcome(a), outcome(b)
    shared = sorted(set(mine) & set(theirs))
    only_a = sum(mine[k] and not theirs[k] for k in shared)
    only_b = sum(theirs[k] and not mine[k] for k in shared)
    both = sum(mine[k] and theirs[k] for k in shared)
    return {"both": both, "only_a": only_a, "only_b": only_b, "p": sign_test(only_a, only_b)}


def analyse(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The pre-registered analysis of the held-out records (every row, the targets of the frozen rule)."""
    rows: dict[str, Any] = {}
    for arm in (*ROWS, NONE):
        mine = [r for r in records if r["arm"] == arm]
        row: dict[str, Any] = {}
        for fault in FAULT_CLASSES:
            runs = [r for r in mine if r["fault"] == fault]
            hit = [r for r in runs if harmed(r)]
            row[fault] = rate(hit)
            row[f"{fault}_not_harmed"] = len(runs) - len(hit)
            row[f"{fault}_settings"] = {s: rate([r for r in hit if r["setting"] == s])
                                        for s in dict.fromkeys(r["setting"] for r in runs)}  # fmt: skip
            row[f"{fault}_shapes"] = {
                shape: {**rate([r for r in hit if r["shape"] == shape]),
                        "not_harmed": sum(not harmed(r) for r in runs if r["shape"] == shape)}
                for shape in dict.fromkeys(r["shape"] for r in runs)
            }  # fmt: skip
        faulted = [r for r in mine if r["fault"] != "none"]
        row["below_unprotected"] = sum(below(r) for r in faulted)
        healthy = [r for r in mine if r["fault"] == "none"]
        row["healthy_acted"] = sum(r["interventions"] > 0 for r in healthy)
        row["healthy_runs"] = len(healthy)
        row["healthy_warned"] = sum(r["warnings"] > 0 for r in healthy)
        changes = [r["change_vs_healthy"] for r in healthy]
        row["healthy_change"], *row["healthy_change_ci"] = mean_interval(changes) if changes else (math.nan,) * 3
        rows[arm] = row
    paired = {other: mcnemar(records, FROZEN, other) for other in (*COMPARED, NONE)}
    return {"rows": rows, "paired": paired, "targets": judge(rows[FROZEN], paired)}


def judge(row: dict[str, Any], paired: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pre-registered target: what, met (by its row's criterion), the numbers."""
    out = []
    for fault in FAULT_CLASSES:
        cell, (point, low) = row[fault], TARGETS[fault]
        met = cell["rate"] is not None and cell["rate"] >= point and cell["bootstrap"][0] >= low
        out.append({"target": f"{fault} rescues >= {point:.0%} of harmed runs (cluster bootstrap lower bound >= "
                              f"{low:.0%})", "met": bool(met), "numbers": _cell_text(cell)})  # fmt: skip
    out.append({"target": "never below the unprotected twin", "met": row["below_unprotected"] == 0,
                "numbers": f"{row['below_unprotected']} faulted runs below it"})  # fmt: skip
    out.append({"target": f"healthy twins acted on <= {TARGETS['healthy_acted']} of {row['healthy_runs']}",
                "met": row["healthy_acted"] <= TARGETS["healthy_acted"],
                "numbers": f"{row['healthy_acted']}/{row['healthy_runs']} acted on"})  # fmt: skip
    low = row["healthy_change_ci"][0]
    out.append({"target": "healthy twins' mean change: the 95 % t interval's lower bound >= -0.5 %",
                "met": finite(low) and low >= TARGETS["healthy_change_low"],
                "numbers": f"mean {_pct(row['healthy_change'])} (95 % interval {_pct(low)} to "
                           f"{_pct(row['healthy_change_ci'][1])})"})  # fmt: skip
    for other in COMPARED:
        p = paired[other]
        out.append({"target": f"more rescues than {other}, McNemar p < {TARGETS['p']}",
                    "met": p["only_a"] > p["only_b"] and p["p"] < TARGETS["p"],
                    "numbers": f"{p['only_a']} harmed runs rescued only by the rule, {p['only_b']} only by {other}, "
                               f"p = {p['p']:.3g} (uncorrected for the three comparisons)"})  # fmt: skip
    return out


def _cell_text(cell: dict[str, Any]) -> str:
    if cell["rate"] is None:
        return "no harmed runs"
    w, b = cell["wilson"], cell["bootstrap"]
    return (f"{cell['rescued']}/{cell['runs']} = {_pct(cell['rate'])} (Wilson {_pct(w[0])} to {_pct(w[1])}; "
            f"cluster bootstrap {_pct(b[0])} to {_pct(b[1])})")  # fmt: skip


def records_of(archs: list[str] | None, cache: Path) -> list[dict[str, Any]]:
    """Every held-out record, each with its fault's shape and its unprotected twin's change."""
    records = []
    for setup, cells in groups(archs):
        found, _ = build_records(cells, setup, cache_dir(cache, setup))
        for record in found:
            kind = record["fault"]
            record["shape"] = None if kind == "none" else getattr(setup, f"{kind}_shape")
            # The unprotected twin's change against the healthy twin: "harmed" when below -2 %.
            arch = ARCHITECTURES[record["setting"]]
            record["unprotected_change"] = arch.change(
                record["unprotected_final_metric"], record["healthy_twin_final_metric"]
            )
        records += found
    return records


def rows_table(result: dict[str, Any]) -> list[str]:
    """Every row's rescues, runs below their unprotected twin and healthy twins acted on."""
    lines = [
        "| row | transient rescued | structural rescued | below the unprotected twin | healthy acted on | "
        "healthy mean change |",
        "|---|---|---|---|---|---|",
    ]
    for arm, row in result["rows"].items():
        lines.append(
            f"| `{arm}` | {_cell_text(row['transient'])} | {_cell_text(row['structural'])} | "
            f"{row['below_unprotected']} | {row['healthy_acted']}/{row['healthy_runs']} | "
            f"{_pct(row['healthy_change'])} |"
        )
    return lines


def targets_table(result: dict[str, Any]) -> list[str]:
    """Each target of the frozen rule, met or not, with its numbers."""
    rows = [f"| {t['target']} | {'yes' if t['met'] else '**no**'} | {t['numbers']} |" for t in result["targets"]]
    return ["| target | met | numbers |", "|---|---|---|", *rows]


def far_below(records: list[dict[str, Any]], arm: str = FROZEN) -> dict[str, Any]:
    """The faulted runs of ``arm`` that end more than 2 % below their unprotected twin: how many, how many of them
    were harmed, the most common shape among them and its count, and the worst change."""
    runs = [r for r in records if r["arm"] == arm and r["fault"] != "none" and below(r)
            and (not finite(r["change_vs_unprotected"]) or r["change_vs_unprotected"] < -RESCUE_MARGIN)]  # fmt: skip
    shapes: dict[str, int] = {}
    for r in runs:
        key = f"{r['fault']} `{r['shape']}`"
        shapes[key] = shapes.get(key, 0) + 1
    top = max(shapes.items(), key=lambda kv: kv[1], default=(None, 0))
    worst = min((r["change_vs_unprotected"] for r in runs if finite(r["change_vs_unprotected"])), default=math.nan)
    return {"runs": len(runs), "harmed": sum(harmed(r) for r in runs), "shape": top[0], "shape_runs": top[1],
            "stopped": sum(r["stopped_at"] is not None for r in runs), "worst": worst}  # fmt: skip


def _short(cell: dict[str, Any]) -> str:
    low, high = cell["wilson"]
    return f"{cell['rescued']}/{cell['runs']} ({100 * cell['rate']:.0f} %, {100 * low:.0f}-{100 * high:.0f})"


def summary(payload: dict[str, Any]) -> str:
    """The held-out result in a paragraph (the README's status and the evidence page), from the stored results."""
    rows, paired = payload["rows"], payload["paired"]
    mine, loss = rows[FROZEN], rows["ours_loss_only+rollback"]
    versus = paired["ours_loss_only+rollback"]
    far = far_below(payload["records"])
    met = [t for t in payload["targets"] if t["met"]]
    return (
        f"On the pre-registered held-out runs (the rule frozen in a commit before the first of them: 66 fresh pairs, "
        f"a GRU byte LM no design run used, nine fault shapes the actions were not designed against) the default "
        f"rule rescued {_short(mine['transient'])} harmed transient runs and {_short(mine['structural'])} harmed "
        f"structural ones, and acted on {mine['healthy_acted']}/{mine['healthy_runs']} healthy twins; the same "
        f"actions on the training loss alone rescued {_short(loss['transient'])} and {_short(loss['structural'])} "
        f"({versus['only_a']} harmed runs rescued only by the default, {versus['only_b']} only by the loss, "
        f"p = {versus['p']:.2g}). {far['runs']} faulted runs ended more than 2 % below their unprotected twin (worst "
        f"{100 * far['worst']:.0f} %; {far['shape_runs']} of them the {far['shape']} shape; {far['stopped']} stopped). "
        f"Targets met: {len(met)} of {len(payload['targets'])} ({'; '.join(t['target'] for t in met)})."
    )


def markdown(result: dict[str, Any], payload: dict[str, Any]) -> str:
    stage = (payload["preregistration"] or {}).get("commit")
    lines = [
        "# Held-out evaluation of the frozen rule (issue 35; pre-registered in `benchmarks/PREREGISTERED.md`)",
        "",
        f"Generated by `benchmarks/rescue/heldout.py` from `rescue_heldout.json`. Pre-registration at commit {stage}; "
        f"code: library {payload['code']['library']}, suite {payload['code']['suite']} (commit "
        f"{payload['code']['commit']}). Rates count harmed runs only (the unprotected twin ends > 2 % worse than "
        "the healthy one); intervals: Wilson, and the cluster bootstrap (settings, then seeds; 10,000 resamples).",
        "",
        *rows_table(result),
        "",
        "## Targets of the frozen rule",
        "",
        *targets_table(result),
    ]
    frozen = result["rows"][FROZEN]
    for fault in FAULT_CLASSES:
        lines += ["", f"## The frozen rule per setting and per shape: {fault}", "", "| group | rescued | not harmed |",
                  "|---|---|---|"]  # fmt: skip
        for setting, cell in frozen[f"{fault}_settings"].items():
            lines.append(f"| {setting} | {_cell_text(cell)} | |")
        for shape, cell in frozen[f"{fault}_shapes"].items():
            lines.append(f"| `{shape}` | {_cell_text(cell)} | {cell['not_harmed']} |")
    return "\n".join(lines) + "\n"


def rule_sha256() -> dict[str, str]:
    """The SHA-256 of the settings the runs used, as PREREGISTERED.md's stage 2 records them: the monitor's settings
    (``MonitorSettings().as_dict()``, which leave the policy to the index's default rule) and the rule in effect."""
    import dataclasses
    import hashlib

    from topocallbacks.settings import MonitorSettings

    settings = MonitorSettings()

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()

    return {"monitor_settings": digest(settings.as_dict()), "rule": digest(dataclasses.asdict(settings.rule))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    parser.add_argument("--arch", nargs="*", default=None, help="only these settings (a partial run; not the "
                        "pre-registered evaluation)")  # fmt: skip
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--force", action="store_true", help="recompute cached trunks and runs")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    from run import compute

    for setup, cells in groups(args.arch):
        print(f"heldout: shapes {setup.transient_shape} / {setup.structural_shape}", flush=True)
        compute(cells, setup, cache_dir(args.cache, setup), args.jobs, args.force)
    records = records_of(args.arch, args.cache)
    if stale_code(records) or mixed_code(records):
        raise SystemExit("heldout: the cached runs mix code; rerun with --force")
    result = analyse(records)
    payload = {
        "library": _library_version(),
        "code": code_version(),
        "preregistration": preregistration(),
        "rule_sha256": rule_sha256(),
        "partial": args.arch is not None,
        **result,
        "records": records,
    }
    name = "rescue_heldout" if args.arch is None else "rescue_heldout_partial"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(_finite(payload), indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result, payload))
    print(f"wrote {args.out / name}.json and .md")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
