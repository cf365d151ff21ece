"""An audit of the rescue suite's stored results: the design runs apart from the rest, per setting, clustered intervals.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/audit.py   # reads results/rescue.json, trains nothing

For the library's default row and its controls (the loss alone, plain replay, the standard metric, no
intervention): faulted runs rescued per fault class on the *design runs* (the (setting, seed) pairs of the suite's
first results, on which ``rollback_skip``, ``choose_default`` and the chosen rule's rows were written; see
``HISTORY.md``), on the *held-out* runs (every other pair) and on the two settings added after the choice, each with
its Wilson 95 % interval (``outputs.wilson``) and a cluster bootstrap 95 % interval (settings resampled, then seeds
within each setting); the paired test against each control on the same runs; a per-setting table; and
``outputs.choose_default`` recomputed from the records (all runs, and each split alone) beside the stored choice.
Writes ``benchmarks/results/rescue_audit.json`` and ``rescue_audit.md``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from outputs import LOSS_ONLY, NONE, OURS, REPLAY, choose_default, sign_test, summarise, wilson  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: The design runs: the suite's first results (b287023, 2026-11-23: resnet, vit, gpt x seeds 0, 1, 2, both faults)
#: were its only stored runs when rollback_skip was added (52ece00, 939207b), choose_default written (9635d7b), its
#: first choice made (f93b18d) and the rows patience2 and index_and_loss added and chosen (f6c8be3). Seeds 3-6 first
#: appear in 4b0d2f3 (after the rule became the library default in 2ade96a), llama and minilm in a708428.
DESIGN: frozenset[tuple[str, int]] = frozenset((s, seed) for s in ("resnet", "vit", "gpt") for seed in (0, 1, 2))
ADDED = ("llama", "minilm")  # the settings added after the choice (a708428)
METRIC = "metric+rollback_cut"  # the standard-metric baseline
ROLES = {"default": OURS, "loss_only": LOSS_ONLY, "plain_replay": REPLAY, "metric": METRIC, "unprotected": NONE}
FAULTS = ("transient", "structural", "faulted")  # "faulted": both classes together
SPLITS = ("all", "design", "held_out", "added_settings")
RESAMPLES = 10_000
SEED = 35  # the bootstrap's RNG seed (the number)
DIGITS = 6


def in_split(record: dict[str, Any], split: str) -> bool:
    """Whether a record's (setting, seed) belongs to ``split``."""
    design = (record["setting"], record["seed"]) in DESIGN
    return {"all": True, "design": design, "held_out": not design, "added_settings": record["setting"] in ADDED}[split]


def faulted(records: list[dict[str, Any]], arm: str, split: str, fault: str) -> list[dict[str, Any]]:
    """The faulted runs of one row in one split and fault class (``faulted``: both classes)."""
    kinds = ("transient", "structural") if fault == "faulted" else (fault,)
    return [r for r in records if r["arm"] == arm and r["fault"] in kinds and in_split(r, split)]


def clusters(runs: list[dict[str, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per setting (in first-seen order): rescued runs and runs per seed, the seeds in ascending order."""
    out = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        seeds = sorted({r["seed"] for r in runs if r["setting"] == setting})
        mine = [[r for r in runs if r["setting"] == setting and r["seed"] == s] for s in seeds]
        out.append((np.array([sum(bool(r["rescued"]) for r in rs) for rs in mine]), np.array([len(rs) for rs in mine])))
    return out


def cluster_bootstrap(
    groups: list[tuple[np.ndarray, np.ndarray]], resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[float, float]:
    """A percentile 95 % interval of the pooled rate: settings drawn with replacement, then seeds within each.

    A fresh generator per call: every row and fault class with the same cluster shapes sees the same draws.
    """
    rng = np.random.default_rng(seed)
    sizes = np.array([len(s) for s, _ in groups])
    width = int(sizes.max())
    saved, runs = np.zeros((len(groups), width)), np.zeros((len(groups), width))
    for i, (s, n) in enumerate(groups):
        saved[i, : len(s)], runs[i, : len(n)] = s, n
    picked = rng.integers(0, len(groups), size=(resamples, len(groups)))
    counts = sizes[picked][..., None]
    seeds = rng.integers(0, counts, size=(resamples, len(groups), width))
    keep = np.arange(width) < counts
    rescued = (saved[picked[..., None], seeds] * keep).sum(axis=(1, 2))
    total = (runs[picked[..., None], seeds] * keep).sum(axis=(1, 2))
    low, high = np.quantile(rescued / total, [0.025, 0.975])
    return float(low), float(high)


def cell(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rescued, runs, the rate, its Wilson and its cluster bootstrap intervals."""
    saved, n = sum(bool(r["rescued"]) for r in runs), len(runs)
    return {
        "rescued": saved,
        "runs": n,
        "rate": round(saved / n, DIGITS),
        "wilson": [round(v, DIGITS) for v in wilson(saved, n)],
        "bootstrap": [round(v, DIGITS) for v in cluster_bootstrap(clusters(runs))],
    }


def count(runs: list[dict[str, Any]]) -> str:
    """``rescued/runs``."""
    return f"{sum(bool(r['rescued']) for r in runs)}/{len(runs)}"


def paired_on(records: list[dict[str, Any]], split: str, other: str) -> dict[str, Any]:
    """The default against ``other`` on the same faulted runs of ``split``: both, one only, the other only, p."""

    def outcome(arm: str) -> dict[tuple[str, str, int], bool]:
        return {
            (r["setting"], r["fault"], r["seed"]): bool(r["rescued"]) for r in faulted(records, arm, split, "faulted")
        }

    mine, theirs = outcome(OURS), outcome(other)
    shared = sorted(set(mine) & set(theirs))
    only_a = sum(mine[k] and not theirs[k] for k in shared)
    only_b = sum(theirs[k] and not mine[k] for k in shared)
    both = sum(mine[k] and theirs[k] for k in shared)
    return {"both": both, "default_only": only_a, "other_only": only_b, "p": round(sign_test(only_a, only_b), DIGITS)}


def choice(records: list[dict[str, Any]], split: str) -> dict[str, Any]:
    """``outputs.choose_default`` on the records of one split (faulted runs and healthy twins), and its ties.

    A tie: a row that ``choose_default`` would pick instead if it were listed first (the rule's sort is stable).
    """
    rows = summarise([r for r in records if in_split(r, split)])
    key = choose_default(rows)[0]
    tied = [k for k in rows if key is not None and k != key and choose_default({k: rows[k], key: rows[key]})[0] == k]
    return {"key": key, "tied": tied}


def audit(data: dict[str, Any]) -> dict[str, Any]:
    """The audit of one ``rescue.json`` payload (JSON-ready: lists, rounded floats)."""
    records = data["records"]
    settings = list(data["architectures"])
    return {
        "source": "benchmarks/results/rescue.json",
        "library": data["library"],
        "design": sorted([s, seed] for s, seed in DESIGN),
        "added_settings": list(ADDED),
        "rows": dict(ROLES),
        "bootstrap": {"resamples": RESAMPLES, "seed": SEED, "interval": "percentile 2.5-97.5"},
        "rescues": {
            arm: {split: {fault: cell(faulted(records, arm, split, fault)) for fault in FAULTS} for split in SPLITS}
            for arm in ROLES.values()
        },
        "per_setting": {
            arm: {
                s: {f: count([r for r in faulted(records, arm, "all", f) if r["setting"] == s]) for f in FAULTS[:2]}
                for s in settings
            }
            for arm in ROLES.values()
        },
        "paired": {
            split: {arm: paired_on(records, split, arm) for arm in ROLES.values() if arm != OURS} for split in SPLITS
        },
        "choice": {"stored": data["default"]["key"], **{split: choice(records, split) for split in SPLITS}},
    }


def _interval(pair: list[float]) -> str:
    return f"{100 * pair[0]:.0f}-{100 * pair[1]:.0f}"


def markdown(result: dict[str, Any]) -> str:
    """The audit as a page (every number from ``result``)."""
    design = ", ".join(f"{s} {seed}" for s, seed in result["design"])
    lines = [
        "# Rescue suite audit: design runs against held-out runs",
        "",
        f"Produced by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/audit.py` from `{result['source']}` "
        f"(library {result['library']}); no run is trained. *Design runs*: the (setting, seed) pairs of the suite's "
        f"first results, on which the default rule and its actions were chosen ({design}; see "
        "`benchmarks/rescue/HISTORY.md`). *Held-out*: every other pair. *Added settings*: "
        f"{' and '.join(result['added_settings'])}, added after the choice (a subset of the held-out runs). Each cell: "
        f"rescued/runs (rate; Wilson 95 % interval; cluster bootstrap 95 % interval: settings drawn with replacement, "
        f"then seeds within each, {result['bootstrap']['resamples']:,} resamples, seed {result['bootstrap']['seed']}).",
        "",
        "| row | split | transient | structural | both faults |",
        "|---|---|---|---|---|",
    ]
    for role, arm in result["rows"].items():
        for split in SPLITS:
            cells = [result["rescues"][arm][split][f] for f in FAULTS]
            text = [
                f"{c['rescued']}/{c['runs']} ({100 * c['rate']:.0f} %; {_interval(c['wilson'])}; "
                f"{_interval(c['bootstrap'])})"
                for c in cells
            ]
            lines.append(f"| {role} (`{arm}`) | {split.replace('_', ' ')} | " + " | ".join(text) + " |")
    lines += [
        "",
        f"## Paired: the default (`{OURS}`) against each row on the same faulted runs",
        "",
        "Runs rescued by both, by the default only, by the other only; McNemar's exact p (`outputs.sign_test`).",
        "",
        "| other row | " + " | ".join(s.replace("_", " ") for s in SPLITS) + " |",
        "|---|" + "---|" * len(SPLITS),
    ]
    for arm in result["paired"]["all"]:
        cells = [result["paired"][s][arm] for s in SPLITS]
        lines.append(
            f"| `{arm}` | "
            + " | ".join(f"{c['both']} / {c['default_only']} / {c['other_only']}, p = {c['p']:.2g}" for c in cells)
            + " |"
        )
    settings = list(next(iter(result["per_setting"].values())))
    lines += ["", "## Per setting: faulted runs rescued (transient / structural)", ""]
    lines += ["| row | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for role, arm in result["rows"].items():
        here = result["per_setting"][arm]
        lines.append(
            f"| {role} | " + " | ".join(f"{here[s]['transient']} / {here[s]['structural']}" for s in settings) + " |"
        )
    chosen = result["choice"]
    lines += [
        "",
        "## `choose_default` recomputed from the records",
        "",
        f"Stored in rescue.json: `{chosen['stored']}`. Recomputed: "
        + "; ".join(
            f"{s.replace('_', ' ')} runs: `{chosen[s]['key']}`"
            + (
                f" (tied with {', '.join(f'`{k}`' for k in chosen[s]['tied'])}: the first listed wins)"
                if chosen[s]["tied"]
                else ""
            )
            for s in SPLITS
        )
        + f". The stored choice {'matches' if chosen['all']['key'] == chosen['stored'] else '**differs from**'} the "
        "recomputed one on all runs.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    result = audit(json.loads((RESULTS / "rescue.json").read_text()))
    (RESULTS / "rescue_audit.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "rescue_audit.md").write_text(markdown(result))
    print(f"wrote {RESULTS / 'rescue_audit.json'} and {RESULTS / 'rescue_audit.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
