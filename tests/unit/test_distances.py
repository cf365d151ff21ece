import numpy as np
import pytest
from scipy.spatial.distance import cdist

from topocallbacks.functional import _distances
from topocallbacks.functional._distances import (
    epsilon_adjacency,
    epsilon_block,
    epsilon_graph,
    pairwise_distances,
    power_of_two_scale,
)


def direct_adjacency(points, epsilon):
    """The GUDHI/scipy decision: sqrt(sum of squared differences) <= ε, pair by pair."""
    adjacency = cdist(points, points) <= epsilon
    np.fill_diagonal(adjacency, False)
    return adjacency


@pytest.mark.parametrize("offset", [0.0, 1.0, 1e6, -3e9])
@pytest.mark.parametrize("seed", range(3))
def test_adjacency_equals_the_direct_decision_for_every_pair_at_borderline_scales(kernels, seed, offset):
    rng = np.random.default_rng(seed)
    points = rng.normal(size=(120, 7)) + offset
    distances = cdist(points, points)[np.triu_indices(120, 1)]
    # ε exactly equal to existing distances: the hardest case for the Gram trick.
    for epsilon in distances[rng.choice(distances.size, 8, replace=False)]:
        np.testing.assert_array_equal(epsilon_adjacency(points, float(epsilon)), direct_adjacency(points, epsilon))
        np.testing.assert_array_equal(
            epsilon_adjacency(points, float(np.nextafter(epsilon, 0))),
            direct_adjacency(points, np.nextafter(epsilon, 0)),
        )


@pytest.mark.parametrize("block_rows", [32, 50, 119])
def test_the_blocked_pass_decides_every_pair_directly_and_lists_the_upper_edges(kernels, monkeypatch, block_rows):
    """Several row blocks, the last one short: each block is decided against the columns from its first row on and
    the lower part mirrored; every pair still gets the direct decision, and the edges are the upper triangle's."""
    monkeypatch.setattr(_distances, "ADJACENCY_BLOCK_ROWS", block_rows)
    rng = np.random.default_rng(block_rows)
    points = rng.normal(size=(120, 5)) + 3.0
    points[60:70] = points[:10]  # identical points in different blocks: distance 0
    distances = cdist(points, points)[np.triu_indices(120, 1)]
    for epsilon in [*distances[rng.choice(distances.size, 5, replace=False)], 1e-12]:
        adjacency, rows, cols = epsilon_graph(points, float(epsilon))
        np.testing.assert_array_equal(adjacency, direct_adjacency(points, epsilon))
        expected_rows, expected_cols = np.nonzero(np.triu(adjacency, 1))
        np.testing.assert_array_equal(rows, expected_rows)
        np.testing.assert_array_equal(cols, expected_cols)


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_block_decides_every_pair_as_numpy_does(monkeypatch, seed):
    pytest.importorskip("numba")
    rng = np.random.default_rng(seed)
    left, right = rng.normal(size=(60, 9)), rng.normal(size=(90, 9))
    right[:20] = left[:20]  # identical points: distance 0
    distances = cdist(left, right).ravel()
    for epsilon in [*distances[rng.choice(distances.size, 6, replace=False)], 1e-12, 100.0]:
        monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "0")
        reference = epsilon_block(left, right, float(epsilon))
        monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "1")
        np.testing.assert_array_equal(epsilon_block(left, right, float(epsilon)), reference)


def test_adjacency_is_symmetric_without_loops():
    points = np.random.default_rng(0).normal(size=(50, 3))
    adjacency = epsilon_adjacency(points, 1.0)
    assert adjacency.dtype == bool
    np.testing.assert_array_equal(adjacency, adjacency.T)
    assert not adjacency.diagonal().any()


def test_pairwise_distances_are_accurate_and_overflow_safe():
    points = np.random.default_rng(1).normal(size=(40, 5))
    np.testing.assert_allclose(pairwise_distances(points), cdist(points, points), atol=1e-12)
    np.testing.assert_allclose(pairwise_distances(points * 1e300) / 1e300, cdist(points, points), atol=1e-12)


def test_power_of_two_scale():
    assert power_of_two_scale(np.array([[3.0]])) == 0.25
    assert power_of_two_scale(np.zeros((2, 2))) == 1.0
    assert power_of_two_scale(np.array([[1e-320]])) == 2.0**1000
    assert power_of_two_scale(np.array([[1.0]]), 5.0) == 0.125
