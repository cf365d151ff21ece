"""Where the harm of the silent suite's classifier scenarios lives: in the watched features, or in the head after them?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/where_harm.py            # about a minute, from recordings
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/where_harm.py --render   # the .md from the stored .json

Two scenarios harm a classifier trained on Fashion-MNIST and watch its penultimate features on a probe of 512 held-out
images with known labels: S3 ``watermark_shortcut`` (design split) and S7 ``classes_dropped`` (round 2's held-out
split, which no signal caught). Their harm metric is the classifier's own accuracy, which counts its head (the last
linear layer) as well as the features the monitor watches. This reads the recorded evaluation seeds at each faulted
run's 5 % point (the first of two checks more than 5 % worse than the twin, ``silence.harm_point``) and asks whether
the *watched features* have lost the class structure there, faulted against twin, by two measures that use the probe's
labels (a monitor has none): the kNN purity (the share of each probe point's 10 nearest neighbours, by cosine, of its
own class) and a linear probe (a logistic regression on the standardised features, fitted on one half of the probe and
scored on the other, both ways). If the faulted features keep the classes as well as the twin's while the accuracy
falls, the fault is in the head: a monitor of those features cannot see it whatever its signal, and the scenario does
not test what the suite is for. Paired differences (faulted - twin) over the seeds, with 95 % t-intervals. Writes
``benchmarks/results/silent_where_harm.{json,md}``. Needs the recordings (``round2.py --record-only``) and
Fashion-MNIST (for the probe's labels).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import silent_evaluate as r1  # noqa: E402
from silence import RECORDINGS, harm_point  # noqa: E402

#: The classifier scenarios whose probe has labels, by class of the suite: (scenario, split of round 2).
SCENARIOS = {"S3": ("watermark_shortcut", "design"), "S7": ("classes_dropped", "held_out")}
NEIGHBOURS = 10
MEASURES = ("metric", "knn_purity", "linear_probe")


def knn_purity(features: np.ndarray, labels: np.ndarray, k: int = NEIGHBOURS) -> float:
    """The mean share of each point's ``k`` nearest neighbours (cosine similarity, itself excluded) of its own label.

    Examples:
        >>> x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> knn_purity(x, np.array([0, 0, 1, 1]), k=1), knn_purity(x, np.array([0, 1, 0, 1]), k=1)
        (1.0, 0.0)
    """
    x = np.asarray(features, dtype=np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    similarity = x @ x.T
    np.fill_diagonal(similarity, -np.inf)
    nearest = np.argsort(-similarity, axis=1, kind="stable")[:, :k]
    return float((labels[nearest] == labels[:, None]).mean())


def linear_probe(features: np.ndarray, labels: np.ndarray) -> float:
    """The accuracy of a logistic regression on the standardised features, fitted on the even points and scored on
    the odd ones and the other way round (the mean of the two)."""
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(features, dtype=np.float64)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    halves = (slice(0, None, 2), slice(1, None, 2))
    scores = []
    for fit, score in (halves, halves[::-1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a few seeds stop at max_iter; the accuracy is what is compared
            model = LogisticRegression(max_iter=2000).fit(x[fit], labels[fit])
        scores.append(model.score(x[score], labels[score]))
    return float(np.mean(scores))


def interval(differences: list[float]) -> dict[str, float]:
    """The mean of paired differences with its 95 % t-interval.

    Examples:
        >>> found = interval([1.0, 2.0, 3.0])
        >>> found["mean"], round(found["low"], 3), round(found["high"], 3)
        (2.0, -0.484, 4.484)
    """
    values = np.asarray(differences, dtype=np.float64)
    mean = float(values.mean())
    half = float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values)}


def at_harm(path: Path, labels: np.ndarray) -> dict[str, Any]:
    """One recording's measures, faulted and twin, at the faulted run's 5 % point."""
    with np.load(path) as data:
        steps = data["collapse/check_steps"]
        point = harm_point(steps, data["collapse/metric"], data["healthy/metric"], int(data["fault_step"]),
                           bool(data["higher_is_better"]))  # fmt: skip
        if point is None:
            return {"seed": int(data["seed"]), "point": None}
        index = int(np.flatnonzero(steps == point)[0])
        found: dict[str, Any] = {"seed": int(data["seed"]), "point": point, "fault": int(data["fault_step"])}
        for kind in ("collapse", "healthy"):
            features = data[f"{kind}/features"][index].astype(np.float64)
            found[kind] = {
                "metric": float(data[f"{kind}/metric"][index]),
                "knn_purity": knn_purity(features, labels),
                "linear_probe": linear_probe(features, labels),
            }
    return found


def evaluate(recordings: Path, labels: np.ndarray) -> dict[str, Any]:
    """Every seed of each scenario, and the paired differences of each measure."""
    out: dict[str, Any] = {}
    for name, (scenario, split) in SCENARIOS.items():
        seeds = [at_harm(recordings / f"{scenario}-seed{seed}.npz", labels) for seed in r1.EVALUATION_SEEDS]
        harmed = [s for s in seeds if s["point"] is not None]
        differences = {m: interval([s["collapse"][m] - s["healthy"][m] for s in harmed]) for m in MEASURES}
        out[name] = {"scenario": scenario, "split": split, "seeds": seeds, "differences": differences}
    return out


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def markdown(payload: dict[str, Any]) -> str:
    """The stored result as a table: per scenario, each measure's twin and faulted means and the paired difference."""
    lines = [
        "| class | scenario (split of round 2) | seeds harmed | measure at the 5 % point | twin | faulted | "
        "faulted - twin (95 % interval) |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"metric": "the harm metric (the classifier's accuracy)", "knn_purity": "kNN purity of the watched "
             "features (k 10)", "linear_probe": "linear probe of the watched features"}  # fmt: skip
    for name, found in payload["scenarios"].items():
        harmed = [s for s in found["seeds"] if s["point"] is not None]
        for measure in MEASURES:
            d = found["differences"][measure]
            twin = np.mean([s["healthy"][measure] for s in harmed])
            faulted = np.mean([s["collapse"][measure] for s in harmed])
            lines.append(f"| {name} | {found['scenario']} ({found['split'].replace('_', '-')}) | "
                         f"{len(harmed)} of {len(found['seeds'])} | {names[measure]} | {twin:.3f} | {faulted:.3f} | "
                         f"{_signed(d['mean'])} ({_signed(d['low'])} to {_signed(d['high'])}) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recordings", type=Path, default=RECORDINGS / "evaluation")
    parser.add_argument("--out", type=Path, default=r1.RESULTS)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the stored .json only")
    args = parser.parse_args(argv)
    stored = args.out / "silent_where_harm.json"
    if not args.render:
        from cases import PROBE_SIZE, held_out_images

        labels = held_out_images()[1][:PROBE_SIZE].numpy()
        payload = {"commit": r1._commit(), "neighbours": NEIGHBOURS, "scenarios": evaluate(args.recordings, labels)}
        stored.write_text(json.dumps(payload, indent=1) + "\n")
    stored.with_suffix(".md").write_text(markdown(json.loads(stored.read_text())))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
