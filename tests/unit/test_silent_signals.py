"""The silent suite's candidate signals on clouds whose geometry is known (benchmarks/silent/silent_signals.py)."""

import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

silent_signals = benchmark_module("silent_signals", "silent")


def blobs(centres, n=512, std=0.05, seed=0):
    """Point i in mode ``i mod len(centres)`` (the same inputs at every check), with fresh noise per ``seed``."""
    rng = np.random.default_rng(seed)
    centres = np.asarray(centres, dtype=float)
    pick = np.arange(n) % len(centres)
    return centres[pick] + std * rng.normal(size=(n, centres.shape[1]))


EIGHT = [[2.0 * c - 3.0, 2.0 * r - 1.0] for r in range(2) for c in range(4)]


def test_the_mode_counter_counts_separated_clusters_and_ignores_stragglers(silent_signals):
    cloud = blobs(EIGHT)
    assert silent_signals.modes(cloud, epsilon=0.5) == 8
    assert silent_signals.modes(blobs(EIGHT[:4]), epsilon=0.5) == 4
    with_stragglers = np.vstack([cloud, [[10.0, 10.0], [-10.0, 10.0]]])  # two lone points: not modes
    assert silent_signals.modes(with_stragglers, epsilon=0.5) == 8


def test_geometry_values_on_known_clouds(silent_signals):
    rng = np.random.default_rng(1)
    iso = rng.normal(size=(2000, 16))
    assert silent_signals.norm_std(iso) == pytest.approx(1.0, abs=0.05)
    assert silent_signals.anisotropy(iso) == pytest.approx(1 / 16, abs=0.02)
    assert abs(silent_signals.mean_cosine(iso)) < 0.01
    cone = 5.0 + 0.1 * rng.normal(size=(500, 16))  # every row near the same direction
    assert silent_signals.mean_cosine(cone) > 0.99
    assert silent_signals.norm_std(cone) < 0.1
    line = np.outer(rng.normal(size=500), rng.normal(size=16))
    assert silent_signals.anisotropy(line) == pytest.approx(1.0)
    assert silent_signals.linear_cka(iso, 3.0 * iso @ np.linalg.qr(rng.normal(size=(16, 16)))[0]) == pytest.approx(1.0)
    assert silent_signals.linear_cka(iso, rng.normal(size=(2000, 16))) < 0.05


def test_a_run_that_shrinks_loses_modes_and_drifts_is_seen_by_every_family_and_the_shrink_sentinel(silent_signals):
    healthy = [blobs(EIGHT, seed=s) for s in range(12)]
    collapsed = [0.05 * blobs(EIGHT[:4], seed=100 + s) for s in range(3)]
    frames = np.stack(healthy + collapsed)
    first, state = silent_signals.feature_signals(frames[:12])
    rest, _ = silent_signals.feature_signals(frames[12:], state)
    values = {name: np.concatenate([first[name], rest[name]]) for name in first}
    assert all(math.isnan(v) for v in values["modes"][:9])  # no reference before the warm-up's last check
    assert values["modes"][9] == 8
    assert values["modes"][11] == 8
    assert values["modes"][12] == 4  # four modes left (shrunk, still apart at the fixed ε)
    assert values["spread"][11] == pytest.approx(1.0, abs=0.05)
    assert values["spread"][12] < 0.1
    assert values["shrink"][12] == 1.0
    assert values["shrink"][11] == 0.0
    assert values["cka_drift"][12] > values["cka_drift"][11]
    assert values["diagram_drift_ref"][12] > values["diagram_drift_ref"][11]
    assert values["rankme"][12] < values["rankme"][11]  # half the modes: the spread collapses to a line


def test_a_diverged_check_is_nan_everywhere(silent_signals):
    frames = np.stack([blobs(EIGHT, seed=s) for s in range(11)])
    frames[10, 0, 0] = np.nan
    values, _ = silent_signals.feature_signals(frames)
    assert all(math.isnan(v[10]) for v in values.values())


def test_lidar_counts_the_directions_that_separate_samples_from_their_views(silent_signals):
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(128, 8))  # 128 samples spread over 8 dimensions
    views = centres[:, None, :] + 0.05 * rng.normal(size=(128, 4, 8))
    assert silent_signals.lidar(views) > 6.0  # close to the 8 directions the samples differ in
    flat = np.zeros((128, 8))
    flat[:, 0] = rng.normal(size=128)  # the samples differ in one direction only
    assert silent_signals.lidar(flat[:, None, :] + 0.05 * rng.normal(size=(128, 4, 8))) < 1.5
    assert math.isnan(silent_signals.lidar(np.full((4, 2, 3), np.nan)))


def test_training_signals_are_the_means_since_the_previous_check(silent_signals):
    steps = np.array([0, 2, 5])
    loss = np.arange(6, dtype=float)
    found = silent_signals.training_signals(steps, loss, 2 * loss)
    assert math.isnan(found["loss"][0])
    assert found["loss"][1:].tolist() == [0.5, 3.0]
    assert found["grad_norm"][1:].tolist() == [1.0, 6.0]
