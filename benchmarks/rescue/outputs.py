"""The rescue suite's outputs: one JSON record per run, the Markdown table with the targets, one PNG per scenario."""

from __future__ import annotations

import json
import math
import platform
import statistics
from pathlib import Path
from typing import Any

from cache import runs_path, trunk_summary_path
from detectors import DETECTORS
from faults import ARCHITECTURES, FAULTS, Setup

RESCUE_MARGIN = 0.02  # rescued: the final metric is at most 2 % (relative) worse than the healthy twin's
NONE = "none+none"
TARGETS = {"transient": 0.8, "structural": 0.5, "healthy_change": -0.005, "healthy_rate": 1.0}
OURS = "ours_default+rollback"  # the library's default rule with action "rollback" at its defaults


def choose_default(rows: dict[str, dict[str, Any]]) -> tuple[str | None, str]:
    """The library's default rule, chosen by the suite, and why (a rule fixed before the results were seen).

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


def build_records(
    archs: list[str], seeds: list[int], keys: list[str], setup: Setup, directory: Path
) -> tuple[list[dict[str, Any]], dict[tuple[str, int, str], dict[str, Any]]]:
    """One record per run (every detector, the unprotected ``none``, on every kind) and the raw runs by key."""
    records: list[dict[str, Any]] = []
    raw: dict[tuple[str, int, str], dict[str, Any]] = {}
    for arch_name in archs:
        arch = ARCHITECTURES[arch_name]
        for seed in seeds:
            trunks = _load(trunk_summary_path(directory, arch_name, seed))
            healthy = trunks["healthy"]["final_metric"]
            raw[(arch_name, seed, NONE)] = {
                kind: {"final_metric": t["final_metric"], "curve": t["curve"], "events": [], "stopped_at": None,
                       "updates_undone": 0, "final_updates": setup.steps, "branched_at": None, "warnings": 0}
                for kind, t in trunks.items()
            }  # fmt: skip
            for key in [NONE, *keys]:
                if key != NONE:
                    raw[(arch_name, seed, key)] = _load(runs_path(directory, arch_name, seed, key))["runs"]
                runs = raw[(arch_name, seed, key)]
                detector, action = key.split("+")
                twin = runs["healthy"]
                twin_change = arch.change(twin["final_metric"], healthy)
                twin_rate = 1000.0 * len(twin["events"]) / setup.steps
                for kind, run in runs.items():
                    final = run["final_metric"]
                    fault = kind != "healthy"
                    rollbacks = [e for e in run["events"] if e["action"] == "rollback"]
                    records.append({
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
                        "first_intervention": run["events"][0]["position"] if run["events"] else None,
                        "stopped_at": run["stopped_at"],
                        "final_updates": run["final_updates"],
                        "warnings": run["warnings"],
                        "healthy_interventions_per_1000_steps": twin_rate,
                        "healthy_final_metric_change": twin_change,
                    })  # fmt: skip
    return records, raw


def _pct(value: float) -> str:
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


def summarise(records: list[dict[str, Any]], keys: list[str]) -> dict[str, dict[str, Any]]:
    """Per detector x action: rescued shares per fault, the healthy twin's cost, steps lost."""
    rows = {}
    for key in [NONE, *keys]:
        detector, action = key.split("+")
        mine = [r for r in records if r["detector"] == detector and r["action"] == action]
        row: dict[str, Any] = {"detector": detector, "action": action}
        for fault in FAULTS:
            runs = [r for r in mine if r["fault"] == fault]
            row[f"rescued_{fault}"] = sum(r["rescued"] for r in runs) / len(runs) if runs else math.nan
            row[f"rescued_{fault}_count"] = f"{sum(r['rescued'] for r in runs)}/{len(runs)}"
            row[f"change_{fault}"] = statistics.median(r["change_vs_healthy"] for r in runs) if runs else math.nan
            row[f"better_{fault}_count"] = f"{sum(r['change_vs_unprotected'] > 0 for r in runs)}/{len(runs)}"
            row[f"worse_{fault}_count"] = f"{sum(r['change_vs_unprotected'] < 0 for r in runs)}/{len(runs)}"
            row[f"rescued_{fault}_ci"] = wilson(sum(bool(r["rescued"]) for r in runs), len(runs))
        healthy = [r for r in mine if r["fault"] == "none"]
        row["healthy_change"] = statistics.mean(r["change_vs_healthy"] for r in healthy) if healthy else math.nan
        row["healthy_worst"] = min((r["change_vs_healthy"] for r in healthy), default=math.nan)
        rates = [r["healthy_interventions_per_1000_steps"] for r in healthy]
        row["healthy_rate"] = statistics.mean(rates) if rates else math.nan
        row["healthy_acted_count"] = f"{sum(r['interventions'] > 0 for r in healthy)}/{len(healthy)}"
        faulted = [r for r in mine if r["fault"] != "none"]
        row["steps_lost"] = statistics.mean(r["steps_lost"] for r in faulted) if faulted else math.nan
        row["rescued"] = sum(bool(r["rescued"]) for r in faulted)
        row["stopped"] = sum(r["stopped_at"] is not None for r in faulted)
        row["runs"] = len(faulted)
        rows[key] = row
    return rows


def targets(rows: dict[str, dict[str, Any]], key: str = OURS) -> list[tuple[str, bool, str]]:
    """The suite's targets for one row of ours (default: the default rule + rollback): (what, met, the numbers)."""
    if key not in rows:
        return []
    ours = rows[key]
    result = [
        ("rescues >= 80 % of transient faults", ours["rescued_transient"] >= TARGETS["transient"],
         f"{ours['rescued_transient_count']} ({100 * ours['rescued_transient']:.0f} %)"),
        ("rescues >= 50 % of structural faults", ours["rescued_structural"] >= TARGETS["structural"],
         f"{ours['rescued_structural_count']} ({100 * ours['rescued_structural']:.0f} %)"),
        ("healthy twin's final metric within 0.5 % (mean)", ours["healthy_change"] >= TARGETS["healthy_change"],
         f"mean {_pct(ours['healthy_change'])}, worst {_pct(ours['healthy_worst'])}"),
        ("<= 1 intervention per 1,000 healthy steps", ours["healthy_rate"] <= TARGETS["healthy_rate"],
         f"{ours['healthy_rate']:.2f} per 1,000 steps"),
    ]  # fmt: skip
    total = ours["rescued_transient"] + ours["rescued_structural"]
    baselines = [k for k in rows if k in DETECTORS and DETECTORS[k].family == "baseline"]
    beaten = [k for k in baselines if total > rows[k]["rescued_transient"] + rows[k]["rescued_structural"]]
    not_beaten = [k for k in baselines if k not in beaten]
    result.append((
        "rescues more faulted runs than every baseline",
        bool(baselines) and not not_beaten,
        "beats all" if not not_beaten else f"not more than {', '.join(not_beaten)}",
    ))  # fmt: skip
    return result


def write_markdown(
    path: Path, rows: dict[str, dict[str, Any]], records: list[dict[str, Any]], setup: Setup, seeds: list[int],
    archs: list[str], seconds: float | None, compute: float,
) -> None:  # fmt: skip
    lines = [
        "# Rescue suite: does acting on a warning save the faulted run, and what does it cost healthy runs?",
        "",
        f"Produced by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/run.py --jobs 2` (`make rescue`); see "
        "`benchmarks/rescue/run.py` for the protocol. "
        f"{len(archs)} architecture(s) ({', '.join(archs)}), seeds {', '.join(map(str, seeds))}; {setup.steps} data "
        f"positions per run, fault at position/update {setup.fault}, checks every {setup.check_every}. *Transient*: "
        f"batches of positions [{setup.fault}, {setup.fault + setup.transient}) corrupted (images: labels shuffled, "
        f"{100 * setup.noise_fraction:.0f} % of images replaced by N(0, {setup.noise_std:g}) noise; text: tokens "
        f"shuffled within each sequence) with the learning rate x{setup.spike:g}. *Structural*: from update "
        f"{setup.fault} the learning rate ramps x100 over {setup.ramp} updates (ResNet, GPT-2) or jumps to 1e-2 "
        "without warm-up (ViT), keyed to the update count (a rollback replays it unless the rate was cut).",
        "",
        f"*Rescued*: the final standard metric (accuracy; held-out loss for GPT-2) is at most "
        f"{100 * RESCUE_MARGIN:.0f} % (relative) worse than the healthy twin's. *Healthy change*: the healthy twin's "
        "final metric with the detector against without it (mean over runs; positive is better). *Steps lost*: "
        "updates undone by rollbacks (mean over the faulted runs). A stopped run's outcome is its last healthy "
        "snapshot when the library saved one, else its state at the stop.",
        "",
        "Rescued shares carry their 95 % Wilson interval. *Better / worse than unprotected*: faulted runs ending "
        "above / below the same run without the detector (transient / structural). *Healthy runs acted on*: healthy "
        "twins with at least one intervention.",
        "",
        "| detector | action | rescued transient | rescued structural | better than unprotected (T / S) | "
        "worse than unprotected (T / S) | healthy change (mean / worst) | healthy runs acted on | "
        "healthy interventions per 1,000 steps | steps lost | stopped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        name = "no intervention" if key == NONE else row["detector"]
        bold = "**" if key == OURS else ""
        lines.append(
            f"| {bold}{name}{bold} | {row['action'] if key != NONE else '-'} | "
            f"{_rate(*map(int, row['rescued_transient_count'].split('/')))} | "
            f"{_rate(*map(int, row['rescued_structural_count'].split('/')))} | "
            f"{row['better_transient_count']} / {row['better_structural_count']} | "
            f"{row['worse_transient_count']} / {row['worse_structural_count']} | "
            f"{_pct(row['healthy_change'])} / {_pct(row['healthy_worst'])} | {row['healthy_acted_count']} | "
            f"{row['healthy_rate']:.2f} | {row['steps_lost']:.1f} | {row['stopped']}/{row['runs']} |"
        )
    chosen, why = choose_default(rows)
    for key in dict.fromkeys([OURS, chosen or OURS]):
        lines += ["", f"## Targets ({key}: {DETECTORS[key].description})" if key in DETECTORS else "", ""]
        for what, met, numbers in targets(rows, key):
            lines.append(f"- {'met' if met else '**not met**'}: {what}: {numbers}")
    lines += [
        "",
        "## The library's default rule",
        "",
        choose_default.__doc__.split("\n\n")[1].replace("\n    ", " ").strip(),
        "",
        f"Chosen: {why}." if chosen else f"Chosen: none, so the default action would be `warn`: {why}.",
        "" if chosen in (None, OURS) else f"**The suite chose {chosen}, not the library's default rule {OURS}.**",
    ]
    if OURS in rows:
        lines += [
            "",
            f"## Paired: {OURS} against every other row on the same faulted runs",
            "",
            "The same faulted runs (architecture, fault, seed) rescued by both rows, by one of them only, and "
            "the two-sided exact sign test (McNemar) on the runs where they disagree: a small p says the "
            "difference is more than the luck of which seeds were drawn.",
            "",
            f"| other row | both | {OURS} only | other only | p |",
            "|---|---|---|---|---|",
        ]
        for key in rows:
            if key != OURS:
                both, only_ours, only_other, p = paired(records, OURS, key)
                lines.append(f"| {key} | {both} | {only_ours} | {only_other} | {p:.2g} |")
    lines += ["", "## Per scenario: final metric change against the healthy twin (median over seeds; rescued runs)", ""]
    scenarios = [(a, f) for a in archs for f in FAULTS]
    lines.append("| detector | action | " + " | ".join(f"{a} {f}" for a, f in scenarios) + " |")
    lines.append("|---|---|" + "---|" * len(scenarios))
    for key in rows:
        detector, action = key.split("+")
        cells = []
        for arch, fault in scenarios:
            runs = [r for r in records if r["detector"] == detector and r["action"] == action
                    and r["architecture"] == arch and r["fault"] == fault]  # fmt: skip
            if not runs:
                cells.append("-")
                continue
            median = statistics.median(r["change_vs_healthy"] for r in runs)
            cells.append(f"{_pct(median)} ({sum(r['rescued'] for r in runs)}/{len(runs)})")
        lines.append(f"| {'no intervention' if key == NONE else detector} | {action if key != NONE else '-'} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    lines += ["", "Healthy twins' and unprotected runs' final metrics (seed by seed):", ""]
    lines.append("| architecture | metric | seed | healthy | transient | structural |")
    lines.append("|---|---|---|---|---|---|")
    for arch in archs:
        for seed in seeds:
            base = [r for r in records if r["detector"] == "none" and r["architecture"] == arch and r["seed"] == seed]
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


def _compute_seconds(archs: list[str], seeds: list[int], keys: list[str], directory: Path) -> float:
    """The single-thread seconds of every cached job behind the outputs (trunks and detector runs)."""
    total = 0.0
    for arch in archs:
        for seed in seeds:
            total += sum(t["seconds"] for t in _load(trunk_summary_path(directory, arch, seed)).values())
            total += sum(_load(runs_path(directory, arch, seed, key))["seconds"] for key in keys)
    return total


def _library_version() -> str:
    """The repository's commit when the outputs were written (``+dirty``: topocallbacks/ had local changes)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "topocallbacks"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_outputs(
    archs: list[str], seeds: list[int], keys: list[str], setup: Setup, directory: Path, out: Path, *,
    plots: bool = True, seconds: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write ``rescue.json``, ``rescue.md`` and the PNGs into ``out``; returns the JSON payload."""
    records, raw = build_records(archs, seeds, keys, setup, directory)
    rows = summarise(records, keys)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "library": _library_version(),
        "setup": {**setup.__dict__, "rescue_margin": RESCUE_MARGIN},
        "architectures": archs,
        "seeds": seeds,
        "detectors": {key: DETECTORS[key].description for key in keys},
        "summary": rows,
        "targets": [{"target": what, "met": met, "numbers": numbers} for what, met, numbers in targets(rows)],
        "default": dict(zip(("key", "why"), choose_default(rows), strict=True)),
        "paired": {
            key: dict(zip(("both", "default_only", "other_only", "p"), paired(records, OURS, key), strict=True))
            for key in rows
            if OURS in rows and key != OURS
        },
        "records": records,
    }
    compute = _compute_seconds(archs, seeds, keys, directory)
    payload["compute_seconds"] = compute
    (out / "rescue.json").write_text(json.dumps(_finite(payload), indent=1) + "\n")
    write_markdown(out / "rescue.md", rows, records, setup, seeds, archs, seconds, compute)
    if plots:
        plot(raw, records, archs, min(seeds), keys, setup, out / "rescue", chosen=choose_default(rows)[0])
    return payload
