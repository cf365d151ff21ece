"""benchmarks/silent/where_harm.py: its measures on features whose class structure is known, its interval, and the
evidence page's reading of the stored result (the watched features keep the classes while the accuracy falls)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "silent"))

import where_harm  # noqa: E402

STORED = ROOT / "benchmarks" / "results" / "silent_where_harm.json"


def clusters(separation: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(4), 50)
    centres = separation * np.eye(8)[:4]
    return centres[labels] + rng.normal(size=(200, 8)), labels


def test_both_measures_see_separated_classes_and_neither_sees_shuffled_labels():
    features, labels = clusters(separation=20.0)
    assert where_harm.knn_purity(features, labels) == 1.0
    assert where_harm.linear_probe(features, labels) == 1.0
    shuffled = np.random.default_rng(1).permutation(labels)
    assert where_harm.knn_purity(features, shuffled) < 0.4  # chance: 0.25
    assert where_harm.linear_probe(features, shuffled) < 0.4


def test_the_measures_fall_as_the_classes_merge():
    far, near = clusters(separation=6.0), clusters(separation=1.0)
    assert where_harm.knn_purity(*near) < where_harm.knn_purity(*far)
    assert where_harm.linear_probe(*near) < where_harm.linear_probe(*far)


def test_the_interval_is_the_t_interval_of_the_mean():
    found = where_harm.interval([0.1, -0.1, 0.3, 0.1])
    assert found["mean"] == pytest.approx(0.1)
    half = 3.182446305284263 * np.std([0.1, -0.1, 0.3, 0.1], ddof=1) / 2  # t(0.975, 3)
    assert (found["low"], found["high"]) == pytest.approx((0.1 - half, 0.1 + half))


def test_the_stored_differences_are_those_of_its_seeds_and_say_what_the_page_reads():
    payload = json.loads(STORED.read_text())
    assert set(payload["scenarios"]) == {"S3", "S7"}
    for found in payload["scenarios"].values():
        harmed = [s for s in found["seeds"] if s["point"] is not None]
        assert len(harmed) == 6
        for measure in where_harm.MEASURES:
            again = where_harm.interval([s["collapse"][measure] - s["healthy"][measure] for s in harmed])
            assert again == pytest.approx(found["differences"][measure])
        # The page's reading: the accuracy is worse beyond doubt, the watched features' class structure is not.
        assert found["differences"]["metric"]["high"] < 0
        for measure in ("knn_purity", "linear_probe"):
            assert found["differences"][measure]["low"] < 0 < found["differences"][measure]["high"]
    assert where_harm.markdown(payload).count("\n") == 2 + 3 * len(payload["scenarios"])
