"""Streaming windows keep their meaning while the features drift (their scale grows 100x here, their shape changes).

The stream is generated here, from numpy's seeded generator, so that what it tests does not depend on how a
library's kernels round on a given CPU (a real network trained for 2,000 steps is chaotic: the same seed gives a
different trajectory under AVX2 and AVX-512, which moved these tests' figures from machine to machine). Every
property is asserted for several seeds.
"""

import numpy as np
import pytest

import topocallbacks.functional.collapse as collapse_module
import topocallbacks.transform as transform_module
from tests.cadence import AT_CADENCE
from topocallbacks import TopoMonitor
from topocallbacks.functional.collapse import DEGREE_BAND
from topocallbacks.transform import FeatureTransform

SEEDS = (0, 1, 2)


def drifting_stream(seed, steps=2000, points=32, dim=16, latent=4, clusters=6):
    """Clustered features whose radius grows 100x and whose centre moves, while the clusters tighten 2x.

    The clusters live in a ``latent``-dimensional subspace, as a network's features do in a few directions. The shape
    change (tighter clusters) is what turned a window with a fixed ε into one blob; the scale change is what isolated
    every point of a window kept in the first batch's frame.
    """
    rng = np.random.default_rng(seed)
    embed = rng.normal(size=(latent, dim))
    centres = 2.0 * rng.normal(size=(clusters, latent))
    drift = rng.normal(size=dim)
    stream = []
    for step in range(steps):
        t = step / (steps - 1)
        labels = rng.integers(clusters, size=points)
        spread = 0.6 * (1 - t) + 0.3 * t
        batch = (centres[labels] + spread * rng.normal(size=(points, latent))) @ embed
        batch += 0.01 * rng.normal(size=(points, dim))
        stream.append(100.0**t * (batch + 3.0 * t * drift))
    return stream


@pytest.fixture(scope="module", params=SEEDS)
def stream(request):
    return drifting_stream(request.param)


def radius(batch):
    return float(np.sqrt(np.mean(np.sum((batch - batch.mean(axis=0)) ** 2, axis=1))))


def replay(stream, check_every=100):
    monitor = TopoMonitor(mode="stream", check_every=check_every, **AT_CADENCE)
    # Steps from 1, as a trainer counts them after each update (a streaming window is first checked at step 100).
    records = [r for step, batch in enumerate(stream, start=1) if (r := monitor.observe(batch, step)) is not None]
    return monitor, records


def test_the_window_stays_informative_over_2000_steps_of_a_drifting_stream(stream):
    assert radius(stream[-1]) > 50 * radius(stream[0])  # the drift this is about
    monitor, records = replay(stream)
    assert len(records) == 20
    full = [r for r in records if r.n_points == r.window]
    assert len(full) >= 15
    low, high = DEGREE_BAND
    for record in full:
        assert 1 < record.report.betti0 < record.n_points  # neither one blob nor every point isolated
        assert low <= record.density * (record.n_points - 1) <= high
        assert record.decision.action.value == "none"  # a drifting healthy stream is not a collapse
    assert monitor.pipeline.transform.reframes_ >= 3
    # ε is recalibrated only when the window leaves the band: a few times in 20 checks, not at every check.
    assert monitor.pipeline.rescales_ <= 5


def test_without_a_new_epsilon_the_tightening_clusters_leave_the_band(stream, monkeypatch):
    # The frame follows the scale, but only a new ε follows the shape: with ε kept, a window leaves the band.
    monkeypatch.setattr("topocallbacks.pipeline.DEGREE_BAND", (0.0, float("inf")))
    monitor, records = replay(stream)
    assert monitor.pipeline.rescales_ == 0
    degrees = [r.density * (r.n_points - 1) for r in records if r.n_points == r.window]
    assert max(degrees) > DEGREE_BAND[1]


@pytest.mark.slow
def test_without_reframes_or_rescales_the_window_isolates_nearly_every_point(stream, monkeypatch):
    # What the window did before it followed the features: a frame and an ε fixed on the first batch, while the
    # features grow 100x.
    monkeypatch.setattr(transform_module, "REFRAME_FACTOR", float("inf"))
    monkeypatch.setattr(transform_module, "REFRAME_SHIFT", float("inf"))
    monkeypatch.setattr(collapse_module, "DEGREE_BAND", (0.0, float("inf")))
    monkeypatch.setattr("topocallbacks.pipeline.DEGREE_BAND", (0.0, float("inf")))
    monitor, records = replay(stream, check_every=10)
    assert monitor.pipeline.transform.reframes_ == 0
    assert monitor.pipeline.rescales_ == 0
    assert records[-1].report.betti0 > 0.9 * records[-1].n_points
    assert records[-1].density < 0.001


def test_a_reframe_re_expresses_old_points_exactly():
    rng = np.random.default_rng(0)
    transform = FeatureTransform(streaming=True, window=64)
    first = rng.normal(size=(32, 5))
    old = transform(first)
    drifted = [rng.normal(size=(32, 5)) * 10 + 3 for _ in range(20)]
    due = [transform.track(batch) for batch in drifted]
    assert any(due)
    scale, offset = transform.reframe()
    np.testing.assert_allclose(old * scale + offset, transform(first), rtol=1e-12, atol=1e-12)
    assert 0.05 < scale < 0.2  # the features are about 10x larger now


@pytest.mark.parametrize("factor", [1e155, 1e300, 1e-300])
def test_a_huge_or_tiny_but_finite_stream_is_the_same_stream(factor):
    stream = drifting_stream(0, steps=300)
    _, plain = replay(stream)
    _, scaled = replay([batch * factor for batch in stream])
    assert [r.report.betti0 for r in scaled] == [r.report.betti0 for r in plain]
    assert [r.decision.action for r in scaled] == [r.decision.action for r in plain]
