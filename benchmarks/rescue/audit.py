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
import textwrap
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
#: How the pages name the splits ("held_out" is the key of the runs outside the design runs, kept for the JSON).
LABELS = {"all": "all", "design": "design", "held_out": "outside design", "added_settings": "added settings"}
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


def replay_first_version(records: list[dict[str, Any]], first: dict[str, Any]) -> dict[str, Any]:
    """Plain replay as first run (its policy still cut the rate from the second rollback), against the default."""
    old = [{**r, "arm": "plain_replay_v1"} for r in first["records"]]
    return {
        "source": first["source"],
        "superseded_by": first["superseded_by"],
        **{fault: cell(faulted(old, "plain_replay_v1", "all", fault)) for fault in FAULTS},
        "paired": paired_on([*records, *old], "all", "plain_replay_v1"),
    }


def audit(data: dict[str, Any], first_replay: dict[str, Any]) -> dict[str, Any]:
    """The audit of one ``rescue.json`` payload and plain replay's first version (JSON-ready: lists, rounded floats)."""
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
        "plain_replay_v1": replay_first_version(records, first_replay),
        "targets": [{"target": t["target"], "met": t["met"]} for t in data["targets"]],
        "default_healthy": {
            key: data["summary"][OURS][key]
            for key in (
                "healthy_change",
                "healthy_change_ci",
                "healthy_acted_count",
                "worse_transient_count",
                "worse_structural_count",
            )
        },
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
        "`benchmarks/rescue/HISTORY.md`). *Outside design*: every other pair (seen since the choice; not held out in "
        "the pre-registration's sense). *Added settings*: "
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
            lines.append(f"| {role} (`{arm}`) | {LABELS[split]} | " + " | ".join(text) + " |")
    lines += [
        "",
        f"## Paired: the default (`{OURS}`) against each row on the same faulted runs",
        "",
        "Runs rescued by both, by the default only, by the other only; McNemar's exact p (`outputs.sign_test`).",
        "",
        "| other row | " + " | ".join(LABELS[s] for s in SPLITS) + " |",
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
            f"{LABELS[s]} runs: `{chosen[s]['key']}`"
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
    v1 = result["plain_replay_v1"]
    lines += [
        "",
        "## Plain replay as first run (superseded)",
        "",
        f"From {v1['source']}; superseded by {v1['superseded_by']}. Transient {_rate(v1['transient'], True)}, "
        f"structural {_rate(v1['structural'], True)}; paired against the default: {v1['paired']['both']} / "
        f"{v1['paired']['default_only']} / {v1['paired']['other_only']}, p = {v1['paired']['p']:.2g}.",
    ]
    return "\n".join(lines) + "\n"


def _rate(c: dict[str, Any], bootstrap: bool = False) -> str:
    """``rescued/runs (rate %, Wilson interval[, cluster bootstrap interval])``."""
    extra = f"; clustered {_interval(c['bootstrap'])}" if bootstrap else ""
    return f"{c['rescued']}/{c['runs']} ({100 * c['rate']:.0f} %, {_interval(c['wilson'])}{extra})"


def evidence(result: dict[str, Any]) -> str:
    """The evidence page's account of how the default was chosen and what it does held out (every number generated)."""
    rows = result["rows"]
    ours, loss, replay, metric = (
        result["rescues"][rows[k]] for k in ("default", "loss_only", "plain_replay", "metric")
    )
    held, v1 = result["paired"]["held_out"][rows["plain_replay"]], result["plain_replay_v1"]
    now, then = result["paired"]["all"][rows["plain_replay"]], v1["paired"]
    per = result["per_setting"][rows["default"]]
    tied = ", ".join(f"`{k}`" for k in result["choice"]["all"]["tied"])
    tie = f", tied with {tied} (the same outcome on every run; the first listed wins)" if tied else ""
    rate_in, rate_out = ours["design"]["faulted"]["rate"], ours["held_out"]["faulted"]["rate"]
    fewer = "fewer" if rate_out < rate_in else "as many" if rate_out == rate_in else "more"
    wilson, clustered = ours["all"]["transient"]["wilson"], ours["all"]["transient"]["bootstrap"]
    wider = "wider" if clustered[1] - clustered[0] > wilson[1] - wilson[0] else "no wider"
    added, added_metric = _rate(ours["added_settings"]["faulted"]), _rate(metric["added_settings"]["faulted"])
    bullets = [
        "**How the default was chosen, and on which runs** (`benchmarks/rescue/HISTORY.md`, read from the git "
        "history). The rule and its actions were designed on the suite's first results, 9 (setting, seed) pairs "
        "(ResNet, ViT and GPT-2, seeds 0-2: the *design runs*): the rollback's skip was added in answer to them, the "
        "selection rule `outputs.choose_default` was written after them and first chose the gradient-norm row, and "
        "it chose today's rule once two rows (`patience2`, `index_and_loss`) had been added after those results were "
        "seen. The selection rule's body never changed; its candidates and the actions did, all on the same runs. So "
        f"the design runs' {_rate(ours['design']['faulted'])} is in-sample: the rule and its actions were tuned on "
        "those runs. Recomputed from the records, `choose_default` still picks "
        f"`{result['choice']['all']['key']}`{tie}.",
        f"**Outside the design runs, the default rescues {fewer}** (as a share of the runs). On the faulted runs "
        "outside the design runs (seen since, so not held out in the pre-registration's sense) it "
        f"rescues {_rate(ours['held_out']['faulted'])}: transient {_rate(ours['held_out']['transient'], True)}, "
        f"structural {_rate(ours['held_out']['structural'])}. The loss alone rescues "
        f"{_rate(loss['held_out']['faulted'])}, the standard metric {_rate(metric['held_out']['faulted'])}, plain "
        f"replay {_rate(replay['held_out']['faulted'])[:-1]}; paired: {held['default_only']} runs rescued only by the "
        f"default, {held['other_only']} only by replay, p = {held['p']:.2g}). On the two settings added after the "
        f"choice (LLaMA-shaped LM, MiniLM) the default rescues {added}, the standard metric {added_metric}. The "
        f"design runs carry {ours['design']['faulted']['rescued']} of the default's "
        f"{ours['all']['faulted']['rescued']} rescues.",
        f"**Rescues cluster by setting** (ResNet transient {per['resnet']['transient']}, LLaMA transient "
        f"{per['llama']['transient']} and structural {per['llama']['structural']}), and the Wilson intervals treat "
        "runs as independent. A cluster bootstrap (settings drawn with replacement, then seeds within each) is "
        f"{wider}: the default's transient {_rate(ours['all']['transient'], True)}. With 3 or 5 settings it is crude; "
        "`benchmarks/results/rescue_audit.md` has every row, split and setting.",
        "**Plain replay, in two versions.** As first run (a708428) the control's policy still cut the rate from its "
        f"second rollback on: it rescued transient {_rate(v1['transient'])} and structural {_rate(v1['structural'])}, "
        f"and, paired, {then['default_only']} runs were rescued only by the default and {then['other_only']} only by "
        f"replay (p = {then['p']:.2g}): the target, more rescues than plain replay, was **not met**. The control's "
        "written definition has no cut; its actuator was made to ignore the "
        f"cuts (4d27964) and the row recomputed: transient {_rate(replay['all']['transient'])}, structural "
        f"{_rate(replay['all']['structural'])}; paired, {now['default_only']} runs to {now['other_only']} (p = "
        f"{now['p']:.2g}). Training is deterministic, so replaying the same batches from the same state meets the "
        "same fault again: what the second version shows is that skipping the bad window beats stopping at its "
        "start, not that rolling back is no luck. The first version shows what the default lacks: rolling back, "
        f"replaying the data and compounding the cut rescued {v1['structural']['rescued']} structural faults where "
        f"the default rescues {ours['all']['structural']['rescued']}.",
    ]
    return "\n".join(
        textwrap.fill(b, 116, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False) for b in bullets
    )


def _against(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``as many as``, ``more than`` or ``fewer than``: rescues of ``a`` against ``b`` (cells of the same runs)."""
    return (
        "as many as" if a["rescued"] == b["rescued"] else "more than" if a["rescued"] > b["rescued"] else "fewer than"
    )


def readme(result: dict[str, Any]) -> str:
    """The README's status on the rescue suite (every number and comparison generated), a quoted paragraph."""
    rows = result["rows"]
    ours, loss, metric = (result["rescues"][rows[k]] for k in ("default", "loss_only", "metric"))
    healthy, v1, targets = result["default_healthy"], result["plain_replay_v1"], result["targets"]
    then, vs_loss = v1["paired"], result["paired"]["all"][rows["loss_only"]]
    below = healthy["worse_transient_count"].split("/")[0] == healthy["worse_structural_count"].split("/")[0] == "0"
    low = healthy["healthy_change_ci"][0]
    outside, loss_out, metric_out = (
        ours["held_out"]["faulted"],
        loss["held_out"]["faulted"],
        metric["held_out"]["faulted"],
    )
    # The stored texts (written before issue 35) call plain replay "the control for luck", which it is not: training
    # is deterministic, a replay meets the same fault again.
    texts = {t["target"]: t["target"].replace(" (the control for luck)", " as redefined") for t in targets}
    met = [texts[t["target"]] for t in targets if t["met"]]
    missed = [texts[t["target"]] for t in targets if not t["met"]]
    caveats = []
    if low < -0.005 and any("within 0.5 %" in t for t in met):
        caveats.append(f"the healthy change is met on its point estimate only: its interval reaches {100 * low:.2f} %")
    if then["p"] >= 0.05 and any("plain replay" in t for t in met):
        caveats.append(
            f"against plain replay's first version, which still cut the rate, it was {then['default_only']} runs to "
            f"{then['other_only']} (p = {then['p']:.2g})"
        )
    topology = (
        "so **the topology adds no measurable rescues over the loss channel**"
        if vs_loss["p"] >= 0.05
        else "so the topology adds rescues over the loss channel"
    )
    text = (
        "Acting helps more than warning, though less than this page once said. In the [rescue suite]"
        "(docs/evidence.md#does-acting-save-the-run-the-rescue-suite) "
        f"({len(result['per_setting'][rows['default']])} settings, a MiniLM fine-tune and a LLaMA-shaped LM among "
        f"them, {ours['all']['transient']['runs']} paired runs per fault class), the library's default rule as it "
        "was until the pre-registered choice of its rollback order (roll back when the index and the training loss "
        "jump together, with a compounding rate cut and skipped updates) "
        f"rescued {_rate(ours['all']['transient'])} transient faults and {_rate(ours['all']['structural'])} "
        f"structural ones, left {'none' if below else 'some'} below its unprotected twin and acted on "
        f"{healthy['healthy_acted_count']} healthy runs. Those figures include the "
        f"{ours['design']['faulted']['runs']} faulted runs the rule and its actions were designed on, which carry "
        f"{ours['design']['faulted']['rescued']} of its {ours['all']['faulted']['rescued']} rescues; **outside them "
        f"it rescues {_rate(outside)}** (transient {_rate(ours['held_out']['transient'])}), "
        f"{_against(outside, loss_out)} "
        f"the training loss alone with the same actions ({loss_out['rescued']}/{loss_out['runs']}) and "
        f"{_against(outside, metric_out)} the standard metric as a detector ({metric_out['rescued']}/"
        f"{metric_out['runs']}; [how the rule was chosen](benchmarks/rescue/HISTORY.md)). Targets met, as the suite "
        f"judges them: {'; '.join(met) or 'none'}"
        + (f" ({'; '.join(caveats)})" if caveats else "")
        + f". **Not met**: {'; '.join(missed) or 'none'}. With the loss alone the same actions rescue "
        f"{loss['all']['faulted']['rescued']} of {loss['all']['faulted']['runs']} against the default's "
        f"{ours['all']['faulted']['rescued']} (paired p = {vs_loss['p']:.2g}), {topology}."
    )
    return textwrap.fill(
        text, 116, initial_indent="> ", subsequent_indent="> ", break_on_hyphens=False, break_long_words=False
    )


def main() -> int:
    first = json.loads((RESULTS / "rescue_plain_replay_v1.json").read_text())
    result = audit(json.loads((RESULTS / "rescue.json").read_text()), first)
    (RESULTS / "rescue_audit.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "rescue_audit.md").write_text(markdown(result))
    print(f"wrote {RESULTS / 'rescue_audit.json'} and {RESULTS / 'rescue_audit.md'} (the pages: benchmarks/pages.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
