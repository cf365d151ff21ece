"""Where the absolute collapse sentinels' thresholds come from: their values on healthy runs, and on collapses.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sentinels.py      # needs the collapse recordings (make collapse)

Every check of every recording of the collapse-evidence suite (``benchmarks/collapse/recordings/``: six scenarios x
six seeds, each a healthy twin and a collapse run, the probe features at every check) goes through the monitor's
own transform and :func:`topocallbacks.functional.sentinels.sentinel_values`, exactly as a probe check does. Beside
them, classifiers trained into their *terminal phase* (training accuracy 100 % for thousands of steps, the regime
where neural collapse pulls each class to one point, healthy by every standard): an MLP on the 10 digit classes,
one on two of them, and one on two classes with a 2-unit feature layer. A sentinel's threshold must sit beyond
every healthy value with a wide margin; the collapse runs show what the sentinels do catch.

Writes ``benchmarks/results/sentinels.json`` and ``sentinels.md``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "collapse"))

from record import RECORDINGS, recordings  # noqa: E402

from topocallbacks.functional.sentinels import (  # noqa: E402
    CONSTANT_SPREAD,
    ONE_DIRECTION_SHARE,
    TWO_CLUSTER_SHARE,
    sentinel_values,
)
from topocallbacks.settings import TransformSettings  # noqa: E402
from topocallbacks.transform import FeatureTransform  # noqa: E402

RESULTS = HERE / "results"


def cloud_values(features: np.ndarray) -> tuple[float, float, float, tuple[str, ...]]:
    """(relative spread, top share, two-cluster share, sentinels holding) of a probe cloud, as a probe check sees it."""
    transform = FeatureTransform(TransformSettings())
    cloud = np.asarray(features, dtype=np.float64)
    projected = transform.project(cloud)
    values = sentinel_values([projected], projected)
    return values.spread, values.top_share, values.two_clusters, values.holding


def sentinel_rows() -> dict[str, list[dict]]:
    """Per (scenario, kind): one row per run with the per-check sentinel values."""
    rows: dict[str, list[dict]] = {}
    for path in recordings(RECORDINGS):
        data = np.load(path)
        scenario, fault = str(data["scenario"]), int(data["fault_step"])
        for kind in ("healthy", "collapse"):
            steps = data[f"{kind}/check_steps"]
            values = [cloud_values(f) for f in data[f"{kind}/features"]]
            rows.setdefault(f"{scenario}/{kind}", []).append(
                {
                    "seed": int(data["seed"]),
                    "fault_step": fault,
                    "steps": steps.tolist(),
                    "spread": [v[0] for v in values],
                    "top_share": [v[1] for v in values],
                    "two_clusters": [v[2] for v in values],
                    "holding": [list(v[3]) for v in values],
                }
            )
    return rows


def terminal_phase(classes: tuple[int, ...], width: int, steps: int = 4000, seed: int = 0) -> dict:
    """A digits MLP trained far past 100 % training accuracy; the sentinels of its feature layer along the way."""
    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(seed)
    data = load_digits()
    keep = np.isin(data.target, classes)
    x = torch.tensor(data.data[keep] / 16.0, dtype=torch.float32)
    y = torch.tensor(np.searchsorted(classes, data.target[keep]))
    body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, width))
    head = torch.nn.Linear(width, len(classes))
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.05, momentum=0.9, weight_decay=5e-4)
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, list] = {key: [] for key in ("steps", "accuracy", "spread", "top_share", "two_clusters", "holding")}
    for step in range(steps + 1):
        if step % 250 == 0:
            with torch.no_grad():
                features = body(x)
                accuracy = float((head(features).argmax(1) == y).float().mean())
            spread, share, clusters, holding = cloud_values(features.double().numpy())
            out["steps"].append(step)
            out["accuracy"].append(accuracy)
            out["spread"].append(spread)
            out["top_share"].append(share)
            out["two_clusters"].append(clusters)
            out["holding"].append(list(holding))
        batch = torch.randint(0, len(x), (64,), generator=generator)
        loss = torch.nn.functional.cross_entropy(head(body(x[batch])), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return out


def summarise(runs: list[dict], after_fault: bool = False) -> dict:
    spreads, shares, lines, holding = [], [], [], []
    for run in runs:
        for i, step in enumerate(run["steps"]):
            if after_fault and step <= run["fault_step"]:
                continue
            spreads.append(run["spread"][i])
            holding.append(run["holding"][i])
            if run["top_share"][i] >= ONE_DIRECTION_SHARE:
                lines.append(run["two_clusters"][i])
            if run["two_clusters"][i] < TWO_CLUSTER_SHARE:  # two clusters on a line are left alone by design
                shares.append(run["top_share"][i])
    return {
        "checks": len(spreads),
        "min_spread": min(spreads),
        "max_top_share": max(shares, default=None),
        "min_two_clusters_on_a_line": min(lines) if lines else None,
        "flagged_constant": sum("constant" in h for h in holding),
        "flagged_one_direction": sum("one_direction" in h for h in holding),
    }


def main() -> int:
    if not recordings(RECORDINGS):
        print(f"no recordings in {RECORDINGS}: run `make collapse` (or benchmarks/collapse/record.py) first")
        return 1
    rows = sentinel_rows()
    terminal = {
        "digits, 10 classes, 32-d features": terminal_phase(tuple(range(10)), 32),
        "digits, 2 classes (0 and 1), 32-d features": terminal_phase((0, 1), 32),
        "digits, 2 classes (3 and 8), 2-d features": terminal_phase((3, 8), 2),
    }
    table = []
    for key in sorted(rows):
        scenario, kind = key.split("/")
        summary = summarise(rows[key], after_fault=kind == "collapse")
        table.append({"scenario": scenario, "kind": kind, "runs": len(rows[key]), **summary})
    for name, run in terminal.items():
        fake = [{**run, "fault_step": -1}]
        table.append({"scenario": name, "kind": "terminal phase", "runs": 1, **summarise(fake)})
    healthy = [row for row in table if row["kind"] != "collapse"]
    on_lines = [row["min_two_clusters_on_a_line"] for row in healthy if row["min_two_clusters_on_a_line"] is not None]
    margin = {
        "healthy_min_spread": min(row["min_spread"] for row in healthy),
        "healthy_max_top_share": max(row["max_top_share"] for row in healthy if row["max_top_share"] is not None),
        "healthy_min_two_clusters_on_a_line": min(on_lines, default=None),
        "healthy_checks": sum(row["checks"] for row in healthy),
        "healthy_flagged": sum(row["flagged_constant"] + row["flagged_one_direction"] for row in healthy),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sentinels.json").write_text(
        json.dumps({"thresholds": {"constant_spread": CONSTANT_SPREAD, "one_direction_share": ONE_DIRECTION_SHARE},
                    "margin": margin, "table": table, "terminal": terminal, "recordings": rows}, indent=1)
    )  # fmt: skip
    lines = [
        "# Sentinels: their values on healthy runs and collapses",
        "",
        "Produced by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sentinels.py` from the collapse-evidence "
        "suite's recordings (probe features at every check; collapse runs after their fault only) and three "
        "classifiers trained 4,000 steps into their terminal phase. Thresholds: constant when the relative spread "
        f"is <= {CONSTANT_SPREAD:g}; one direction when the top principal share is >= {ONE_DIRECTION_SHARE} and "
        f"two clusters along that direction explain < {TWO_CLUSTER_SHARE} of its variance (two tight clusters on a "
        "line are a binary classifier's terminal phase).",
        "",
        "| scenario | kind | runs | checks | smallest spread | largest top share (not two clusters) | two-cluster "
        "share on a line (smallest) | flagged constant | flagged one direction |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        on_line = row["min_two_clusters_on_a_line"]
        lines.append(
            f"| {row['scenario']} | {row['kind']} | {row['runs']} | {row['checks']} | {row['min_spread']:.3g} | "
            f"{'-' if row['max_top_share'] is None else format(row['max_top_share'], '.4f')} | "
            f"{'-' if on_line is None else f'{on_line:.3f}'} | "
            f"{row['flagged_constant']} | {row['flagged_one_direction']} |"
        )
    spread_margin = margin["healthy_min_spread"] / CONSTANT_SPREAD
    share_gap = (1 - margin["healthy_max_top_share"]) / (1 - ONE_DIRECTION_SHARE)
    lines += [
        "",
        f"Healthy checks ({margin['healthy_checks']}, terminal phases included): the smallest relative spread is "
        f"{margin['healthy_min_spread']:.3g} ({spread_margin:,.0f}x the constant threshold); the largest top "
        f"share, where the points are not two clusters on a line, is {margin['healthy_max_top_share']:.4f} (its "
        f"distance to 1 is {share_gap:.1f}x the threshold's); healthy checks on a line (binary terminal phases) have "
        f"a two-cluster share of at least {margin['healthy_min_two_clusters_on_a_line'] or float('nan'):.3f} (the "
        f"threshold: {TWO_CLUSTER_SHARE}); healthy checks flagged: {margin['healthy_flagged']}.",
        "",
        "Terminal phases (step: training accuracy / top share / two-cluster share along that direction):",
        "",
    ]
    for name, run in terminal.items():
        pairs = ", ".join(
            f"{step}: {acc:.2f} / {share:.4f} / {two:.3f}"
            for step, acc, share, two in zip(
                run["steps"], run["accuracy"], run["top_share"], run["two_clusters"], strict=True
            )
            if step % 1000 == 0
        )
        lines.append(f"- {name}: {pairs}")
    (RESULTS / "sentinels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if math.isfinite(margin["healthy_min_spread"]) else 1


if __name__ == "__main__":
    sys.exit(main())
