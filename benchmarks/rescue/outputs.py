"""The rescue suite's outputs: one JSON record per run, the Markdown table with the targets, one PNG per scenario."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from cache import (
    cached_code,
    code_version,
    git,
    preregistration,
    runs_path,
    timing_path,
    trunk_code_path,
    trunk_summary_path,
)
from detectors import DETECTORS
from faults import ARCHITECTURES, FAULTS, Setup

RESCUE_MARGIN = 0.02  # rescued: the final metric is at most 2 % (relative) worse than the healthy twin's
NONE = "none+none"
#: The rescue issue's targets for the default rule, written before the runs.
TARGETS = {
    "transient": 0.8,  # rescued share of transient faults ...
    "transient_low": 0.7,  # ... with the 95 % interval's lower bound at least this
    "structural": 0.5,
    "healthy_change": -0.005,  # mean final-metric change of the healthy twins
    "healthy_acted_high": 0.10,  # upper bound of the 95 % interval of healthy twins acted on
    "healthy_runs": 30,
    "p": 0.05,  # paired against plain replay and the loss alone
    "healthy_rate": 1.0,  # the selection rule's: <= 1 intervention per 1,000 healthy steps
}
OURS = "ours_default+rollback"  # the library's default rule with action "rollback" at its defaults
LOSS_ONLY = "ours_loss_only+rollback"
REPLAY = "plain_replay+rollback"
Cell = tuple[str, int, list[str]]  # (setting, seed, rows)


def choose_default(rows: dict[str, dict[str, Any]]) -> tuple[str | None, str]:
    """The library's default rule, chosen by the suite, and why.

    Written after the suite's first results and unchanged since; the rows it chooses among and their actions were
    designed on those results (``HISTORY.md``), so its choice on them is a best-of figure (``audit.py``).

    Among our rows whose healthy twins meet the healthy targets (mean final-metric change >= -0.5 %, <= 1
    intervention per 1,000 steps), the one that rescues the most faulted runs (transient + structural); ties go to
    fewer healthy interventions. None when no row rescues a run within the healthy targets: then acting by default
    costs healthy runs more than it saves, and the default action would have to be ``warn``.
    """
    eligible = [
        key for key, row in rows.items()
        if key in DETECTORS and DETECTORS[key].family == "ours"
        and row["healthy_change"] >= TARGETS["healthy_change"] and row["healthy_rate"] <= TARGETS["healthy_rate"]
    ]  # fmt: skip
    rescued = {key: rows[key]["rescued"] for key in eligible}
    best = sorted(eligible, key=lambda key: (-rescued[key], rows[key]["healthy_rate"]))
    if not best or rescued[best[0]] == 0:
        why = ", ".join(f"{k} {rescued[k]}" for k in eligible) or "none"
        return None, f"no row of ours rescues a run within the healthy targets (eligible rows, rescued: {why})"
    key = best[0]
    row = rows[key]
    return key, (
        f"{key}: {rescued[key]} faulted runs rescued within the healthy targets (healthy change "
        f"{_pct(row['healthy_change'])}, {row['healthy_rate']:.2f} interventions per 1,000 steps)"
    )


def _finite(tree: Any) -> Any:
    """JSON-safe: non-finite floats (a diverged run's metric) become None."""
    if isinstance(tree, float):
        return tree if math.isfinite(tree) else None
    if isinstance(tree, dict):
        return {key: _finite(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_finite(value) for value in tree]
    return tree


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _count(events: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in events:
        counts[event["action"]] = counts.get(event["action"], 0) + 1
    return counts


def wall_clock_ratio(run: dict[str, Any], timing: dict[str, float] | None, setup: Setup) -> float | None:
    """A run's estimated wall-clock against its unprotected twin's (1.0: the same), from its counted costs.

    Runs are branched from trunks, so they are not timed end to end: the cost model prices the training steps the
    run took (replayed positions and recomputed steps included, fewer after a stop), a probe pass per check at
    which the detector needed features, a snapshot copy per snapshot (each measured once per setting by
    ``engine.measure_costs``) and the detector's own calls (timed in the run), against ``steps`` training steps.
    None for a run cached before the costs were recorded.
    """
    cost = run.get("cost")
    if timing is None or cost is None:
        return None
    step = timing["step_seconds"]
    seconds = (
        (cost["steps_trained"] + cost["steps_recomputed"]) * step
        + cost["probe_passes"] * timing["probe_seconds"]
        + cost["snapshots"] * timing["copy_seconds"]
        + cost["detector_seconds"]
    )
    return seconds / (setup.steps * step)


def build_records(
    cells: list[Cell], setup: Setup, directory: Path
) -> tuple[list[dict[str, Any]], dict[tuple[str, int, str], dict[str, Any]]]:
    """One record per run (every row, the unprotected ``none``, on every kind) and the raw runs by key."""
    records: list[dict[str, Any]] = []
    raw: dict[tuple[str, int, str], dict[str, Any]] = {}
    settings = dict.fromkeys(a for a, _, _ in cells)
    timings = {a: _load(timing_path(directory, a)) for a in settings if timing_path(directory, a).exists()}
    timing_code = {a: timings[a].get("code") for a in timings}
    for arch_name, seed, keys in cells:
        arch = ARCHITECTURES[arch_name]
        trunks = _load(trunk_summary_path(directory, arch_name, seed))
        healthy = trunks["healthy"]["final_metric"]
        unprotected_cost = {"detector_seconds": 0.0, "snapshots": 0, "probe_passes": 0, "steps_trained": setup.steps,
                            "positions_replayed": 0, "steps_recomputed": 0, "snapshot_bytes": 0}  # fmt: skip
        raw[(arch_name, seed, NONE)] = {
            kind: {"final_metric": t["final_metric"], "curve": t["curve"], "events": [], "stopped_at": None,
                   "updates_undone": 0, "final_updates": setup.steps, "branched_at": None, "warnings": 0,
                   "cost": unprotected_cost}
            for kind, t in trunks.items()
        }  # fmt: skip
        trunk_code = cached_code(trunk_code_path(directory, arch_name, seed))
        for key in [NONE, *keys]:
            code = trunk_code
            if key != NONE:
                payload = _load(runs_path(directory, arch_name, seed, key))
                raw[(arch_name, seed, key)], code = payload["runs"], payload.get("code")
            runs = raw[(arch_name, seed, key)]
            detector, action = key.split("+")
            twin = runs["healthy"]
            twin_change = arch.change(twin["final_metric"], healthy)
            twin_rate = 1000.0 * len(twin["events"]) / setup.steps
            for kind, run in runs.items():
                final = run["final_metric"]
                fault = kind != "healthy"
                rollbacks = [e for e in run["events"] if e["action"] == "rollback"]
                cost = run.get("cost")
                records.append({
                    "setting": arch_name,
                    "arm": key,
                    "scenario": f"{arch_name}_{kind}",
                    "architecture": arch_name,
                    "model": arch.model,
                    "fault": kind if fault else "none",
                    "seed": seed,
                    "detector": detector,
                    "action": action,
                    "metric": arch.metric,
                    "final_metric": final,
                    "healthy_twin_final_metric": healthy,
                    "unprotected_final_metric": trunks[kind]["final_metric"],
                    "change_vs_healthy": arch.change(final, healthy),
                    "change_vs_unprotected": arch.change(final, trunks[kind]["final_metric"]),
                    "rescued": (arch.change(final, healthy) >= -RESCUE_MARGIN) if fault else None,
                    "steps_lost": run["updates_undone"],
                    "rollback_steps_lost": [e.get("updates_undone", e.get("steps_lost")) for e in rollbacks],
                    "interventions": len(run["events"]),
                    "interventions_by_action": _count(run["events"]),
                    "intervention_steps": [
                        {"position": e["position"], "action": e["action"], "snapshot_step": e.get("snapshot_step")}
                        for e in run["events"]
                    ],
                    "first_intervention": run["events"][0]["position"] if run["events"] else None,
                    "stopped_at": run["stopped_at"],
                    "final_updates": run["final_updates"],
                    "warnings": run["warnings"],
                    "healthy_interventions_per_1000_steps": twin_rate,
                    "healthy_final_metric_change": twin_change,
                    "wall_clock_ratio": wall_clock_ratio(run, timings.get(arch_name), setup),
                    "snapshot_bytes": None if cost is None else cost["snapshot_bytes"],
                    "cost": cost,
                    "code": _code_fields(code),
                    "timing_code": _code_fields(timing_code.get(arch_name)),
                })  # fmt: skip
    return records, raw


def _code_fields(code: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if code is None else {k: code.get(k) for k in ("library", "suite", "commit", "dirty")}


def _codes(records: list[dict[str, Any]]) -> set[str]:
    """The codes (library and suite hashes) the records' runs and their cost timings were computed with."""
    return {
        "unrecorded" if code is None else f"library {code['library']}, suite {code['suite']}"
        for r in records
        for code in (r.get("code"), r.get("timing_code"))
    }


def mixed_code(records: list[dict[str, Any]]) -> list[str]:
    """The distinct codes the records (runs and cost timings) were computed with, when more than one; else []."""
    codes = _codes(records)
    return sorted(codes) if len(codes) > 1 else []


def stale_code(records: list[dict[str, Any]]) -> bool:
    """Whether any record (run or cost timing) was computed with other code than today's."""
    now = code_version()
    return _codes(records) != {f"library {now['library']}, suite {now['suite']}"}


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The suite's main table, one line per row (``summarise``'s rows): rescue.md's and the evidence page's."""
    lines = [
        "| detector | action | rescued transient | rescued structural | healthy twins acted on | healthy change "
        "(mean, 95 % interval; worst) | worse than unprotected (T / S) | steps lost | stopped | wall-clock | "
        "snapshots |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        low, high = row["healthy_change_ci"]
        ratio = f"x{row['wall_clock_ratio']:.2f} ({row['wall_clock_runs']})" if row["wall_clock_runs"] else "-"
        memory = f"{row['snapshot_mib']:.1f} MiB" if math.isfinite(row["snapshot_mib"]) else "-"
        lines.append(
            f"| {_row_name(key, row)} | "
            f"{_rate(*map(int, row['rescued_transient_count'].split('/')))} | "
            f"{_rate(*map(int, row['rescued_structural_count'].split('/')))} | "
            f"{_rate(row['healthy_acted'], row['healthy_runs'])} | "
            f"{_pct(row['healthy_change'])} ({_pct(low)} to {_pct(high)}; {_pct(row['healthy_worst'])}) | "
            f"{row['worse_transient_count']} / {row['worse_structural_count']} | "
            f"{row['steps_lost']:.1f} | {row['stopped']}/{row['runs']} | {ratio} | {memory} |"
        )
    return "\n".join(lines)


def _pct(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{100 * value:+.2f} %" if math.isfinite(value) else "-inf"


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) of a rate ``successes / n``: honest at 0/n and n/n."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _rate(successes: int, n: int) -> str:
    low, high = wilson(successes, n)
    return f"{successes}/{n} ({100 * successes / n:.0f} %; {100 * low:.0f}-{100 * high:.0f})" if n else "-"


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The mean and its two-sided Student-t interval; (mean, nan, nan) for fewer than two values."""
    from scipy.stats import t

    if not values:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = float(t.ppf(0.5 + confidence / 2, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def sign_test(only_a: int, only_b: int) -> float:
    """Two-sided exact sign test (McNemar's exact test) on the discordant pairs of two paired outcomes."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(records: list[dict[str, Any]], a: str, b: str) -> tuple[int, int, int, float]:
    """On the same faulted runs (architecture, fault, seed): rescued by both, by ``a`` only, by ``b`` only, p."""

    def outcomes(key: str) -> dict[tuple[str, str, int], bool]:
        detector, action = key.split("+")
        return {(r["architecture"], r["fault"], r["seed"]): bool(r["rescued"]) for r in records
                if r["detector"] == detector and r["action"] == action and r["fault"] != "none"}  # fmt: skip

    left, right = outcomes(a), outcomes(b)
    shared = sorted(set(left) & set(right))
    both = sum(left[k] and right[k] for k in shared)
    only_a = sum(left[k] and not right[k] for k in shared)
    only_b = sum(right[k] and not left[k] for k in shared)
    return both, only_a, only_b, sign_test(only_a, only_b)


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row (detector x action): rescued shares per fault, the healthy twins' cost, steps lost, the cost."""
    rows = {}
    for key in dict.fromkeys(r["arm"] for r in records):
        mine = [r for r in records if r["arm"] == key]
        detector, action = key.split("+")
        row: dict[str, Any] = {"detector": detector, "action": action}
        for fault in FAULTS:
            runs = [r for r in mine if r["fault"] == fault]
            saved = sum(bool(r["rescued"]) for r in runs)
            row[f"rescued_{fault}"] = saved / len(runs) if runs else math.nan
            row[f"rescued_{fault}_count"] = f"{saved}/{len(runs)}"
            row[f"change_{fault}"] = statistics.median(r["change_vs_healthy"] for r in runs) if runs else math.nan
            row[f"better_{fault}_count"] = f"{sum(r['change_vs_unprotected'] > 0 for r in runs)}/{len(runs)}"
            row[f"worse_{fault}_count"] = f"{sum(r['change_vs_unprotected'] < 0 for r in runs)}/{len(runs)}"
            row[f"rescued_{fault}_ci"] = wilson(saved, len(runs))
        healthy = [r for r in mine if r["fault"] == "none"]
        changes = [r["change_vs_healthy"] for r in healthy]
        row["healthy_change"], *row["healthy_change_ci"] = mean_interval(changes)
        row["healthy_worst"] = min(changes, default=math.nan)
        rates = [r["healthy_interventions_per_1000_steps"] for r in healthy]
        row["healthy_rate"] = statistics.mean(rates) if rates else math.nan
        acted = sum(r["interventions"] > 0 for r in healthy)
        row["healthy_acted"], row["healthy_runs"] = acted, len(healthy)
        row["healthy_acted_count"] = f"{acted}/{len(healthy)}"
        row["healthy_acted_ci"] = wilson(acted, len(healthy))
        faulted = [r for r in mine if r["fault"] != "none"]
        row["steps_lost"] = statistics.mean(r["steps_lost"] for r in faulted) if faulted else math.nan
        row["rescued"] = sum(bool(r["rescued"]) for r in faulted)
        row["stopped"] = sum(r["stopped_at"] is not None for r in faulted)
        row["runs"] = len(faulted)
        ratios = [r["wall_clock_ratio"] for r in mine if r["wall_clock_ratio"] is not None]
        row["wall_clock_ratio"], row["wall_clock_runs"] = statistics.fmean(ratios) if ratios else math.nan, len(ratios)
        sizes = [r["snapshot_bytes"] for r in mine if r["snapshot_bytes"] is not None]
        row["snapshot_mib"] = max(sizes) / 2**20 if sizes else math.nan
        row["settings"] = {}
        for setting in dict.fromkeys(r["setting"] for r in mine):
            here = {fault: [r for r in faulted if r["setting"] == setting and r["fault"] == fault] for fault in FAULTS}
            row["settings"][setting] = {f: f"{sum(bool(r['rescued']) for r in rs)}/{len(rs)}" for f, rs in here.items()}
        rows[key] = row
    return rows


def targets(
    rows: dict[str, dict[str, Any]], records: list[dict[str, Any]], key: str = OURS
) -> list[tuple[str, bool, str]]:
    """The rescue issue's targets for one row of ours (default: the default rule + rollback): (what, met, numbers)."""
    if key not in rows:
        return []
    ours = rows[key]
    t_low, _ = ours["rescued_transient_ci"]
    _, acted_high = ours["healthy_acted_ci"]
    result = [
        (f"rescues >= {100 * TARGETS['transient']:.0f} % of transient faults, the 95 % interval's lower bound >= "
         f"{100 * TARGETS['transient_low']:.0f} %",
         ours["rescued_transient"] >= TARGETS["transient"] and t_low >= TARGETS["transient_low"],
         f"{_rate(*map(int, ours['rescued_transient_count'].split('/')))}"),
        (f"rescues >= {100 * TARGETS['structural']:.0f} % of structural faults",
         ours["rescued_structural"] >= TARGETS["structural"],
         f"{_rate(*map(int, ours['rescued_structural_count'].split('/')))}"),
        (f"acts on no healthy twin in >= {TARGETS['healthy_runs']} (the interval's upper bound <= "
         f"{100 * TARGETS['healthy_acted_high']:.0f} %)",
         ours["healthy_acted"] == 0 and ours["healthy_runs"] >= TARGETS["healthy_runs"]
         and acted_high <= TARGETS["healthy_acted_high"],
         f"{_rate(ours['healthy_acted'], ours['healthy_runs'])}"),
        (f"healthy twins' final metric within {-100 * TARGETS['healthy_change']:.1f} % (mean)",
         ours["healthy_change"] >= TARGETS["healthy_change"],
         f"mean {_pct(ours['healthy_change'])} (95 % interval {_pct(ours['healthy_change_ci'][0])} to "
         f"{_pct(ours['healthy_change_ci'][1])}), worst {_pct(ours['healthy_worst'])}"),
    ]  # fmt: skip
    for other, what in ((REPLAY, "plain replay (what skipping the bad window adds)"), (LOSS_ONLY, "the loss alone")):
        if other in rows:
            _, only_ours, only_other, p = paired(records, key, other)
            result.append((f"rescues more than {what}, paired p < {TARGETS['p']:g}",
                           only_ours > only_other and p < TARGETS["p"],
                           f"{only_ours} runs only ours, {only_other} only {other}, p = {p:.2g}"))  # fmt: skip
    total = ours["rescued"]
    baselines = [k for k in rows if k in DETECTORS and DETECTORS[k].family == "baseline"]
    not_beaten = [k for k in baselines if total <= rows[k]["rescued"]]
    result.append((
        "rescues more faulted runs than every baseline",
        bool(baselines) and not not_beaten,
        "beats all" if not not_beaten else f"not more than {', '.join(not_beaten)}",
    ))  # fmt: skip
    return result


def _row_name(key: str, row: dict[str, Any]) -> str:
    if key == NONE:
        return "no intervention | -"
    bold = "**" if key == OURS else ""
    return f"{bold}{row['detector']}{bold} | {row['action']}"


def _settings_text(cells: list[Cell]) -> str:
    seeds: dict[str, list[int]] = {}
    for arch, seed, _ in cells:
        seeds.setdefault(arch, []).append(seed)
    return "; ".join(
        f"{ARCHITECTURES[a].model} ({a}, {ARCHITECTURES[a].data}, {len(s)} seeds: transient = "
        f"{ARCHITECTURES[a].transient}; structural = {ARCHITECTURES[a].structural})"
        for a, s in seeds.items()
    )


def write_markdown(
    path: Path, rows: dict[str, dict[str, Any]], records: list[dict[str, Any]], setup: Setup, cells: list[Cell],
    seconds: float | None, compute: float, rates: Path,
) -> None:  # fmt: skip
    archs = list(dict.fromkeys(a for a, _, _ in cells))
    lines = [
        "# Rescue suite: does acting on a warning save the faulted run, and what does it cost healthy runs?",
        "",
        f"Produced by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/run.py --jobs 2` (`make rescue`); see "
        "`benchmarks/rescue/README.md` for the protocol. "
        f"{len(archs)} settings: {_settings_text(cells)}. {setup.steps} data positions per run, fault at "
        f"position/update {setup.fault}, checks every {setup.check_every}. *Transient*: the batches of positions "
        f"[{setup.fault}, {setup.fault + setup.transient}) are bad (as named per setting) and the learning rate is "
        f"x{setup.spike:g} at them (keyed to the data position). *Structural*: from update {setup.fault} the "
        "learning rate ramps or jumps as named, keyed to the update count (a rollback replays it unless the rate "
        "was cut).",
        "",
        f"*Rescued*: the final standard metric (accuracy; held-out loss for the language models) is at most "
        f"{100 * RESCUE_MARGIN:.0f} % (relative) worse than the healthy twin's. Rates carry their 95 % Wilson "
        "interval. *Healthy change*: the healthy twin's final metric with the detector against without it (mean "
        "with its 95 % t interval, and the worst). *Steps lost*: updates undone by rollbacks (mean over the faulted "
        "runs). A stopped run's outcome is its last healthy snapshot when the library saved one, else its state at "
        "the stop. *Wall-clock*: the run's estimated time against its unprotected twin's (mean over the runs that "
        "recorded their costs, all three kinds: `outputs.wall_clock_ratio`); *snapshots*: the most memory its "
        "snapshots held.",
        "",
        table(rows),
    ]
    figure = Path(os.path.relpath(rates, path.parent)).as_posix()
    lines += ["", f"![Rescue rate per row and fault class, with 95 % Wilson intervals]({figure})"]
    chosen, why = choose_default(rows)
    for key in dict.fromkeys([OURS, chosen or OURS]):
        if key in DETECTORS:
            lines += ["", f"## Targets ({key}: {DETECTORS[key].description})", ""]
        for what, met, numbers in targets(rows, records, key):
            lines.append(f"- {'met' if met else '**not met**'}: {what}: {numbers}")
    lines += [
        "",
        "## The library's default rule",
        "",
        (choose_default.__doc__ or "").split("\n\n")[1].replace("\n    ", " ").strip(),
        "",
        f"Chosen: {why}." if chosen else f"Chosen: none, so the default action would be `warn`: {why}.",
        "" if chosen in (None, OURS) else f"**The suite chose {chosen}, not the library's default rule {OURS}.**",
    ]
    if OURS in rows:
        lines += [
            "",
            f"## Paired: {OURS} against every other row on the same faulted runs",
            "",
            "The same faulted runs (setting, fault, seed) rescued by both rows, by one of them only, and McNemar's "
            "exact test (the two-sided sign test on the runs where they disagree): a small p says the difference is "
            "more than the luck of which seeds were drawn.",
            "",
            f"| other row | both | {OURS} only | other only | p |",
            "|---|---|---|---|---|",
        ]
        for key in rows:
            if key != OURS:
                both, only_ours, only_other, p = paired(records, OURS, key)
                lines.append(f"| {key} | {both} | {only_ours} | {only_other} | {p:.2g} |")
    lines += ["", "## Per setting: faulted runs rescued (transient / structural)", ""]
    lines.append("| detector | action | " + " | ".join(archs) + " |")
    lines.append("|---|---|" + "---|" * len(archs))
    for key, row in rows.items():
        cells_md = [" / ".join(row["settings"].get(a, {}).get(f, "-") for f in FAULTS) for a in archs]
        lines.append(f"| {_row_name(key, row)} | " + " | ".join(cells_md) + " |")
    lines += ["", "## Per scenario: final metric change against the healthy twin (median over seeds; rescued runs)", ""]
    scenarios = [(a, f) for a in archs for f in FAULTS]
    lines.append("| detector | action | " + " | ".join(f"{a} {f}" for a, f in scenarios) + " |")
    lines.append("|---|---|" + "---|" * len(scenarios))
    for key, row in rows.items():
        cells_md = []
        for arch, fault in scenarios:
            runs = [r for r in records if r["arm"] == key and r["architecture"] == arch and r["fault"] == fault]
            if not runs:
                cells_md.append("-")
                continue
            median = statistics.median(r["change_vs_healthy"] for r in runs)
            cells_md.append(f"{_pct(median)} ({sum(r['rescued'] for r in runs)}/{len(runs)})")
        lines.append(f"| {_row_name(key, row)} | " + " | ".join(cells_md) + " |")
    lines += ["", "Healthy twins' and unprotected runs' final metrics (seed by seed):", ""]
    lines.append("| setting | metric | seed | healthy | transient | structural |")
    lines.append("|---|---|---|---|---|---|")
    for arch, seed, _ in cells:
        base = [r for r in records if r["arm"] == NONE and r["architecture"] == arch and r["seed"] == seed]
        by_fault = {r["fault"]: r["final_metric"] for r in base}
        lines.append(
            f"| {arch} | {ARCHITECTURES[arch].metric} | {seed} | {by_fault.get('none', math.nan):.4f} | "
            f"{by_fault.get('transient', math.nan):.4f} | {by_fault.get('structural', math.nan):.4f} |"
        )
    lines += ["", f"Compute: {compute / 60:.0f} min of single-thread jobs ({platform.machine()}; with `--jobs 2` "
                  "about half of it in wall time)"
              + ("." if seconds is None else f"; the producing command ran {seconds / 60:.1f} min (work found "
                 "in the cache is not counted).")]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def plot_rates(rows: dict[str, dict[str, Any]], path: Path) -> Path:
    """Rescue rate per row and fault class with its 95 % Wilson interval (the README's evidence figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(rows)
    figure, axis = plt.subplots(figsize=(8, 0.42 * len(keys) + 1.4))
    for offset, fault, color in ((-0.17, "transient", "tab:orange"), (0.17, "structural", "tab:purple")):
        for i, key in enumerate(keys):
            row = rows[key]
            rate, (low, high) = row[f"rescued_{fault}"], row[f"rescued_{fault}_ci"]
            axis.errorbar(100 * rate, i + offset, xerr=[[100 * (rate - low)], [100 * (high - rate)]], fmt="o",
                          color=color, ms=5, capsize=3, label=fault if i == 0 else None)  # fmt: skip
    axis.set_yticks(range(len(keys)))
    axis.set_yticklabels(["no intervention" if k == NONE else k for k in keys], fontsize=8)
    for tick, key in zip(axis.get_yticklabels(), keys, strict=True):
        tick.set_fontweight("bold" if key == OURS else "normal")
    axis.invert_yaxis()
    axis.axvline(100 * TARGETS["transient"], color="tab:orange", ls=":", lw=1)
    axis.axvline(100 * TARGETS["structural"], color="tab:purple", ls=":", lw=1)
    runs = max(int(rows[k]["rescued_transient_count"].split("/")[1]) for k in keys)
    axis.set(xlim=(-2, 102), xlabel="faulted runs rescued (%), 95 % Wilson interval",
             title=f"Rescue rate per row ({runs} faulted runs per fault class; dotted: the targets)")  # fmt: skip
    axis.title.set_fontsize(10)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def best_baseline(records: list[dict[str, Any]], arch: str, fault: str) -> str | None:
    """The baseline that rescued the most runs of (arch, fault), then the best median change."""
    best, best_score = None, None
    for key, spec in DETECTORS.items():
        if spec.family != "baseline":
            continue
        runs = [r for r in records if f"{r['detector']}+{r['action']}" == key and r["architecture"] == arch
                and r["fault"] == fault]  # fmt: skip
        if not runs:
            continue
        score = (sum(r["rescued"] for r in runs), statistics.median(r["change_vs_healthy"] for r in runs))
        if best_score is None or score > best_score:
            best, best_score = key, score
    return best


def plot(
    raw: dict[tuple[str, int, str], dict[str, Any]], records: list[dict[str, Any]], archs: list[str], seed: int,
    keys: list[str], setup: Setup, directory: Path, chosen: str | None = None,
) -> list[Path]:  # fmt: skip
    """One PNG per (architecture, fault): the metric curves of seed ``seed`` with interventions marked.

    The curves: no intervention, ours (the default rule, and ``chosen``, the suite's choice if another), the
    best baseline of the scenario.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for arch in archs:
        for fault in FAULTS:
            figure, axis = plt.subplots(figsize=(8, 4.5))
            healthy = raw[(arch, seed, NONE)]["healthy"]
            axis.plot(*zip(*healthy["curve"], strict=True), color="0.6", ls="--", label="healthy twin")
            shown = [(NONE, "tab:red", "no intervention")]
            if OURS in keys:
                shown.append((OURS, "tab:green", "ours: the default rule"))
            if chosen is not None and chosen != OURS and chosen in keys:
                shown.append((chosen, "tab:purple", f"ours, the suite's choice: {chosen}"))
            other = best_baseline(records, arch, fault)
            if other is not None:
                shown.append((other, "tab:blue", f"best baseline: {other}"))
            for key, color, label in shown:
                run = raw[(arch, seed, key)][fault]
                wide = key == NONE  # drawn wide underneath: a detector that never acted follows it exactly
                axis.plot(*zip(*run["curve"], strict=True), color=color, label=label, lw=4 if wide else 1.5,
                          alpha=0.45 if wide else 1.0)  # fmt: skip
                for event in run["events"]:
                    if event["action"] == "rollback":
                        axis.axvline(event["position"], color=color, ls=":", lw=1.2)
                        if event.get("snapshot_step") is not None:
                            axis.annotate("", xy=(event["snapshot_step"], 0.02), xytext=(event["position"], 0.02),
                                          xycoords=("data", "axes fraction"),
                                          arrowprops={"arrowstyle": "->", "color": color})  # fmt: skip
                if run["stopped_at"] is not None:
                    axis.plot([run["stopped_at"]], [run["final_metric"]], marker="x", ms=10, color=color)
                marks = [e["position"] for e in run["events"] if e["action"] in ("skip", "clip", "lower_lr")]
                if marks:
                    axis.plot(marks, [0.97] * len(marks), "|", color=color, ms=8,
                              transform=axis.get_xaxis_transform())  # fmt: skip
            axis.axvspan(setup.fault, setup.fault + (setup.transient if fault == "transient" else 0) or setup.fault,
                         color="tab:red", alpha=0.08)  # fmt: skip
            axis.axvline(setup.fault, color="tab:red", lw=0.8)
            metric = ARCHITECTURES[arch].metric
            axis.set(xlabel="data position", ylabel=metric, title=f"{arch} {fault} fault, seed {seed} "
                     "(dotted: rollbacks, arrows to their snapshot; x: stop; ticks: skips/clips/cuts)")  # fmt: skip
            axis.title.set_fontsize(9)
            if metric == "val_loss":  # the scale of the second half, not of the first steps' loss
                curves = [healthy["curve"]] + [raw[(arch, seed, k)][fault]["curve"] for k, _, _ in shown]
                finite = [v for curve in curves for p, v in curve
                          if p >= setup.fault // 2 and v is not None and math.isfinite(v)]  # fmt: skip
                if finite:
                    axis.set_ylim(min(finite) * 0.97, max(finite) * 1.03)
            axis.legend(fontsize=8)
            figure.tight_layout()
            path = directory / f"{arch}_{fault}.png"
            figure.savefig(path, dpi=110)
            plt.close(figure)
            written.append(path)
    return written


def _compute_seconds(cells: list[Cell], directory: Path) -> float:
    """The single-thread seconds of every cached job behind the outputs (trunks and detector runs)."""
    total = 0.0
    for arch, seed, keys in cells:
        total += sum(t["seconds"] for t in _load(trunk_summary_path(directory, arch, seed)).values())
        total += sum(_load(runs_path(directory, arch, seed, key))["seconds"] for key in keys)
    return total


def _library_version() -> str:
    """The repository's commit when the outputs were written (``+dirty``: topocallbacks/ had local changes)."""
    head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "topocallbacks")
    if head is None or dirty is None:
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_outputs(
    cells: list[Cell], setup: Setup, directory: Path, out: Path, *, plots: bool = True, seconds: float | None = None,
    rates: Path | None = None, allow_mixed: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Write ``rescue.json``, ``rescue.md`` and the PNGs into ``out``; returns the JSON payload.

    Raises ValueError when the runs were computed with different code (library or suite), unless ``allow_mixed``:
    then the payload's ``mixed_code`` lists the codes, and every record says which it ran.

    ``rates``: where the rescue-rate figure goes (default ``out/rescue/rates.png``; the full run writes the docs'
    ``docs/images/rescue_rates.png``, which the README and the evidence page show and ``rescue.md`` links).
    """
    rates = rates or out / "rescue" / "rates.png"
    records, raw = build_records(cells, setup, directory)
    mixed, stale = mixed_code(records), stale_code(records)
    if stale and not allow_mixed:
        raise ValueError(
            f"the cached runs were computed with other code than today's ({'; '.join(sorted(_codes(records)))}): "
            "rerun without --reuse-stale to recompute them, or pass --reuse-stale to write results that say so"
        )
    rows = summarise(records)
    keys = [key for key in rows if key != NONE]
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "library": _library_version(),
        "code": code_version(),
        "mixed_code": mixed,
        "stale_code": stale,  # True: --reuse-stale kept runs of other code than `code`
        "preregistration": preregistration(),
        "setup": {**setup.__dict__, "rescue_margin": RESCUE_MARGIN},
        "settings": {a: {"model": ARCHITECTURES[a].model, "data": ARCHITECTURES[a].data,
                         "metric": ARCHITECTURES[a].metric, "transient": ARCHITECTURES[a].transient,
                         "structural": ARCHITECTURES[a].structural, "seeds": [s for arch, s, _ in cells if arch == a]}
                     for a in dict.fromkeys(a for a, _, _ in cells)},
        "architectures": list(dict.fromkeys(a for a, _, _ in cells)),
        "detectors": {key: DETECTORS[key].description for key in keys},
        "summary": rows,
        "targets": [{"target": what, "met": met, "numbers": numbers}
                    for what, met, numbers in targets(rows, records)],
        "default": dict(zip(("key", "why"), choose_default(rows), strict=True)),
        "paired": {
            key: dict(zip(("both", "default_only", "other_only", "p"), paired(records, OURS, key), strict=True))
            for key in rows
            if OURS in rows and key != OURS
        },
        "records": records,
    }  # fmt: skip
    compute = _compute_seconds(cells, directory)
    payload["compute_seconds"] = compute
    (out / "rescue.json").write_text(json.dumps(_finite(payload), indent=1) + "\n")
    write_markdown(out / "rescue.md", rows, records, setup, cells, seconds, compute, rates)
    if plots:
        plot_rates(rows, rates)
        archs = list(dict.fromkeys(a for a, _, _ in cells))
        seed = min(s for _, s, _ in cells)
        plot(raw, records, archs, seed, keys, setup, out / "rescue", chosen=choose_default(rows)[0])
    return payload
