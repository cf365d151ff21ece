"""The absolute collapse sentinels: known answers, scale-freedom, and healthy shapes they must leave alone."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits

from tests.cadence import AT_CADENCE
from topocallbacks import TopoMonitor
from topocallbacks.functional.sentinels import (
    CONSTANT_SPREAD,
    ONE_DIRECTION_SHARE,
    TWO_CLUSTER_SHARE,
    relative_spread,
    sentinel_values,
    top_direction_share,
    two_cluster_share,
)


def holding(cloud, epsilon=None, scaled=None):
    cloud = np.asarray(cloud, dtype=np.float64)
    return sentinel_values([cloud], cloud, scaled, epsilon).holding


def digits_features(steps=300, seed=0):
    """A healthy digits MLP's hidden features (512 probe samples x 32), after ``steps`` of SGD."""
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    torch.manual_seed(seed)
    body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU())
    head = torch.nn.Linear(32, 10)
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    clouds = []
    for step in range(steps + 1):
        if step % 20 == 0:
            with torch.no_grad():
                clouds.append(body(x[:512]).double().numpy())
        batch = torch.randint(0, len(x), (64,), generator=generator)
        loss = torch.nn.functional.cross_entropy(head(body(x[batch])), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return clouds


@pytest.fixture(scope="module")
def healthy():
    return digits_features()


def test_known_answers():
    rng = np.random.default_rng(0)
    gaussian = rng.normal(size=(500, 6))
    assert relative_spread(np.full((10, 3), 7.0)) == 0.0
    assert relative_spread(np.zeros((10, 3))) == 0.0
    assert relative_spread(gaussian - gaussian.mean(axis=0)) == pytest.approx(1.0)
    assert top_direction_share(np.outer(rng.normal(size=50), rng.normal(size=6))) == pytest.approx(1.0)
    assert top_direction_share(gaussian) < 0.3
    assert two_cluster_share(np.r_[np.zeros(20), np.ones(30)]) == pytest.approx(1.0)
    assert two_cluster_share(rng.uniform(size=20000)) == pytest.approx(0.75, abs=0.01)
    assert two_cluster_share(rng.normal(size=20000)) == pytest.approx(2 / np.pi, abs=0.01)


@pytest.mark.parametrize("shape", [(40, 300), (300, 40), (64, 64), (2, 5)])
def test_the_direction_share_is_the_full_decompositions(shape):
    """Only the top eigenpair is computed: the same share and the same two-cluster split as numpy's full eigh."""
    rng = np.random.default_rng(sum(shape))
    n, d = shape
    cloud = rng.normal(size=(4, d))[rng.integers(0, 4, n)] + 0.3 * rng.normal(size=(n, d))
    centred = cloud - cloud.mean(axis=0)
    values, vectors = np.linalg.eigh(centred.T @ centred)
    expected_share = values[-1] / np.einsum("ij,ij->", centred, centred)
    coordinates = centred @ vectors[:, -1]  # the projections on the first principal direction (up to its sign)
    values_now = sentinel_values([cloud], cloud)
    assert values_now.top_share == pytest.approx(expected_share, rel=1e-10)
    assert values_now.two_clusters == pytest.approx(two_cluster_share(coordinates), rel=1e-9)


def test_the_three_collapses_and_a_healthy_cloud():
    rng = np.random.default_rng(1)
    cloud = rng.normal(size=(200, 16)) @ rng.normal(size=(16, 16))
    assert holding(cloud) == ()
    assert holding(np.zeros_like(cloud)) == ("constant",)
    assert holding(np.tile(cloud.mean(axis=0), (200, 1)) + 1e-9 * rng.normal(size=cloud.shape)) == ("constant",)
    direction = rng.normal(size=16)
    assert holding(np.outer(cloud @ direction, direction)) == ("one_direction",)
    tiny = 0.01 * rng.normal(size=(50, 4))
    assert holding(tiny, epsilon=1.0, scaled=tiny) == ("one_point",)
    assert holding(tiny, epsilon=0.001, scaled=tiny) == ()
    assert sentinel_values([cloud], cloud).describe() == ""
    assert "constant" in sentinel_values([cloud * 0], cloud * 0).describe()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([1e-300, 1e-150, 1e-10, 1.0, 3.7e12, 1e150, 1e300, 1.7e308 / 1e3]),
)
def test_the_sentinels_are_scale_free(seed, factor):
    cloud = np.random.default_rng(seed).normal(size=(40, 5)) * [1, 2, 3, 4, 5]
    base = sentinel_values([cloud], cloud)
    scaled = sentinel_values([cloud * factor], cloud * factor)
    assert scaled.spread == pytest.approx(base.spread, rel=1e-9)
    assert scaled.top_share == pytest.approx(base.top_share, rel=1e-9)
    assert scaled.two_clusters == pytest.approx(base.two_clusters, rel=1e-6)


def test_healthy_real_features_are_far_from_every_threshold(healthy):
    for cloud in healthy:
        values = sentinel_values([cloud], cloud)
        assert values.holding == ()
        assert values.spread > 100 * CONSTANT_SPREAD
        assert values.top_share < ONE_DIRECTION_SHARE - 0.2


def test_two_clusters_on_a_line_are_a_binary_classifiers_terminal_phase_not_a_collapse():
    rng = np.random.default_rng(2)
    direction = rng.normal(size=32)
    labels = rng.integers(2, size=300)
    # Two class means far apart on one line, a little spread around each: neural collapse of two classes.
    cloud = np.outer(np.where(labels, 1.0, -1.0), direction) + 0.02 * rng.normal(size=(300, 32))
    values = sentinel_values([cloud], cloud)
    assert values.top_share >= ONE_DIRECTION_SHARE
    assert values.two_clusters >= TWO_CLUSTER_SHARE
    assert values.holding == ()
    # The same line filled continuously (a layer squeezed to rank one) is a collapse.
    squeezed = np.outer(rng.normal(size=300), direction) + 0.02 * rng.normal(size=(300, 32))
    assert sentinel_values([squeezed], squeezed).holding == ("one_direction",)


@pytest.mark.parametrize("factor", [1e155, 1e300])
def test_healthy_features_times_a_huge_factor_are_not_a_collapse(healthy, factor):
    # A monitor with a healthy history, then the same healthy features x 1e155 (whose squares overflow float64)
    # or x 1e300: the same records, no action. It used to read them as a collapse and stop.
    plain, scaled = TopoMonitor(check_every=20, **AT_CADENCE), TopoMonitor(check_every=20, **AT_CADENCE)
    for i, cloud in enumerate(healthy):
        loss = 2.0 / (1 + i)
        a = plain.process(cloud, 20 * i, loss=loss)
        b = scaled.process(cloud * factor, 20 * i, loss=loss)
        assert not b.decision.fired
        assert not b.decision.flagged
        assert b.report.betti0 == a.report.betti0
        assert b.report.betti1 == a.report.betti1
        assert b.report.ci == pytest.approx(a.report.ci, rel=1e-9)
        assert (b.index_value is None) == (a.index_value is None)
        if a.index_value is not None:
            assert b.index_value == pytest.approx(a.index_value, rel=1e-6)
