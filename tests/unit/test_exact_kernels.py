"""The faster kernels of a check give what the reference computations give: GUDHI, scipy, a linear assignment."""

import gudhi
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import clouds_with_epsilon, looped_clouds, point_clouds
from topocallbacks import InputError
from topocallbacks import functional as F
from topocallbacks.functional._distances import epsilon_edges, pairwise_distances, power_of_two_scale
from topocallbacks.functional._jit import rips_edges_kernel
from topocallbacks.functional.collapse import mst_edge_lengths
from topocallbacks.functional.indices import _assignment_cost, _common_birth_cost
from topocallbacks.functional.topology import (
    _collapse_until_stable,
    _persistence_diagrams,
    _ripser_bars,
    _simplex_tree_bars,
    _upper_edges,
    betti_numbers_of_graph,
    strong_collapse_core,
)


def gudhi_graph_betti(n, rows, cols):
    """β0, β1 of a graph's flag complex straight from GUDHI: full 2-skeleton, no reduction."""
    tree = gudhi.SimplexTree()
    for v in range(n):
        tree.insert([v])
    for u, v in zip(rows.tolist(), cols.tolist(), strict=True):
        tree.insert([u, v])
    tree.expansion(2)
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=True)
    betti = tree.betti_numbers()
    return betti[0], betti[1] if len(betti) > 1 else 0


@st.composite
def dense_graphs(draw):
    n = draw(st.integers(3, 22))
    density = draw(st.floats(0.2, 1.0))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, cols = np.triu_indices(n, 1)
    keep = rng.uniform(size=rows.size) < density
    return n, rows[keep].astype(np.intp), cols[keep].astype(np.intp)


@given(dense_graphs())
def test_removing_dominated_vertices_keeps_the_betti_numbers(graph):
    n, rows, cols = graph
    expected = gudhi_graph_betti(n, rows, cols)
    smaller = strong_collapse_core(n, rows, cols)
    assert smaller[0] <= n
    assert gudhi_graph_betti(*smaller) == expected
    assert tuple(betti_numbers_of_graph(n, rows, cols)) == expected


def test_a_complete_graph_is_one_vertex_and_a_collapsed_cloud_is_cheap():
    rows, cols = np.triu_indices(400, 1)
    assert strong_collapse_core(400, rows, cols)[0] == 1
    collapsed = 1.0 + 1e-6 * np.random.default_rng(0).normal(size=(600, 8))
    assert F.betti_numbers(collapsed, epsilon=1.0) == (1, 0)


@given(clouds_with_epsilon(max_points=30))
def test_betti_numbers_with_the_reduction_match_gudhi_rips(data):
    cloud, epsilon = data
    rows, cols = epsilon_edges(cloud, epsilon)
    assert tuple(F.betti_numbers(cloud, epsilon)) == gudhi_graph_betti(cloud.shape[0], rows, cols)


@st.composite
def any_graphs(draw):
    """Graphs of every density, sometimes several components and cycles (dominated vertices or none)."""
    n = draw(st.integers(1, 40))
    density = draw(st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, cols = np.triu_indices(n, 1)
    keep = rng.uniform(size=rows.size) < density
    if draw(st.booleans()) and n >= 4:  # a chordless cycle through some vertices: nothing dominated on it
        k = draw(st.integers(4, n))
        ring = rng.permutation(n)[:k]
        pairs = {(min(a, b), max(a, b)) for a, b in zip(ring, np.roll(ring, 1), strict=True)}
        keep |= np.array([(int(a), int(b)) in pairs for a, b in zip(rows, cols, strict=True)], dtype=bool)
    return n, rows[keep].astype(np.intp), cols[keep].astype(np.intp)


def dominated_vertex(n, rows, cols):
    """Some vertex whose closed neighbourhood lies in a neighbour's, by brute force (None when there is none)."""
    closed = np.eye(n, dtype=bool)
    closed[rows, cols] = closed[cols, rows] = True
    for v in range(n):
        for u in np.flatnonzero(closed[v]):
            if u != v and not (closed[v] & ~closed[u]).any():
                return v
    return None


@given(graph=any_graphs())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_strong_collapse_core_keeps_the_betti_numbers_and_dominates_nothing(kernels, graph):
    n, rows, cols = graph
    expected = gudhi_graph_betti(n, rows, cols)
    core = strong_collapse_core(n, rows, cols)
    assert 1 <= core[0] <= n
    assert core[1].size == core[2].size
    assert np.all(core[1] < core[2])
    assert gudhi_graph_betti(*core) == expected
    assert dominated_vertex(*core) is None  # collapsed until stable: a core
    assert tuple(betti_numbers_of_graph(n, rows, cols)) == expected


def test_strong_collapse_of_known_graphs(kernels):
    rows, cols = np.triu_indices(300, 1)  # complete: one vertex
    assert strong_collapse_core(300, rows, cols)[0] == 1
    ring = np.arange(12)  # a 12-cycle: no vertex dominated, a loop
    rows, cols = np.minimum(ring, (ring + 1) % 12), np.maximum(ring, (ring + 1) % 12)
    core = strong_collapse_core(12, rows, cols)
    assert core[0] == 12
    assert core[1].size == 12
    assert betti_numbers_of_graph(12, rows, cols) == (1, 1)
    path = np.arange(9)  # a path and three isolated vertices: four points
    assert strong_collapse_core(12, path[:-1], path[1:])[0] == 4
    assert betti_numbers_of_graph(12, path[:-1], path[1:]) == (4, 0)
    assert strong_collapse_core(0, np.zeros(0, np.intp), np.zeros(0, np.intp))[0] == 0


def test_betti_numbers_of_real_features_match_gudhi_at_every_density(kernels):
    rng = np.random.default_rng(3)
    centres = rng.normal(scale=2.0, size=(6, 16))
    cloud = centres[rng.integers(0, 6, 300)] + rng.normal(size=(300, 16)) * rng.uniform(0.3, 1.2, (300, 1))
    distances = pairwise_distances(cloud)[np.triu_indices(300, 1)]
    for quantile in (0.002, 0.02, 0.1, 0.3, 0.6):
        rows, cols = epsilon_edges(cloud, float(np.quantile(distances, quantile)))
        assert tuple(betti_numbers_of_graph(300, rows, cols)) == gudhi_graph_betti(300, rows, cols)


def kruskal(distances):
    """The sorted edge lengths of a minimum spanning tree, by Kruskal with union-find (the reference)."""
    n = len(distances)
    parent = list(range(n))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rows, cols = np.triu_indices(n, 1)
    taken = []
    for k in np.argsort(distances[rows, cols], kind="stable"):
        a, b = root(int(rows[k])), root(int(cols[k]))
        if a != b:
            parent[a] = b
            taken.append(distances[rows[k], cols[k]])
    return np.sort(np.asarray(taken, dtype=np.float64))


@given(point_clouds(min_points=2, max_points=40, max_dim=5))
def test_prim_gives_the_minimum_spanning_tree_lengths(cloud):
    distances = pairwise_distances(cloud)
    ours = np.sort(mst_edge_lengths(distances))
    np.testing.assert_array_equal(ours, kruskal(distances))


@given(point_clouds(min_points=3, max_points=30, max_dim=4))
def test_one_collapse_pass_gives_the_diagrams_of_collapsing_until_stable(cloud):
    threshold = F.longest_mst_edge(cloud)
    ours = _persistence_diagrams(cloud, 1, threshold)
    scale = power_of_two_scale(cloud, *(() if threshold is None else (threshold,)))  # as the kernel scales
    limit = np.inf if threshold is None else threshold * scale
    tree = gudhi.RipsComplex(points=cloud * scale, max_edge_length=limit).create_simplex_tree(max_dimension=1)
    _collapse_until_stable(tree)
    tree.expansion(2)
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=True)
    for dim in (0, 1):
        reference = np.asarray(tree.persistence_intervals_in_dimension(dim)).reshape(-1, 2) / scale
        order = np.lexsort((reference[:, 1], reference[:, 0]))
        np.testing.assert_allclose(ours[dim], reference[order], rtol=1e-12)


@given(point_clouds(min_points=2, max_points=40, max_dim=5))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_compiled_prim_gives_the_same_lengths_in_the_same_order(monkeypatch, cloud):
    pytest.importorskip("numba")
    distances = pairwise_distances(cloud)
    monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "0")
    reference = mst_edge_lengths(distances)
    monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "1")
    np.testing.assert_array_equal(mst_edge_lengths(distances), reference)


@given(graph=any_graphs())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_compiled_edge_list_is_numpys(monkeypatch, graph):
    pytest.importorskip("numba")
    n, rows, cols = graph
    adjacency = np.zeros((n, n), dtype=bool)
    adjacency[rows, cols] = adjacency[cols, rows] = True
    monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "0")
    reference = _upper_edges(adjacency)
    monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "1")
    found = _upper_edges(adjacency)
    for ours, expected in zip(found, reference, strict=True):
        assert ours.dtype == np.intp
        np.testing.assert_array_equal(ours, expected)


@given(st.one_of(point_clouds(min_points=2, max_points=40, max_dim=5), looped_clouds(max_points=40)))
def test_the_longest_mst_edge_over_squared_distances_is_the_one_over_distances(cloud):
    longest = float(mst_edge_lengths(pairwise_distances(cloud)).max(initial=0.0))
    assert F.longest_mst_edge(cloud) == (None if longest == 0.0 else longest * (1.0 + 1e-9))  # to the last bit


def sorted_bars(bars):
    return [b[np.lexsort((b[:, 1], b[:, 0]))] for b in bars]


def assert_ripser_gives_the_simplex_tree_bars(cloud, threshold):
    scale = power_of_two_scale(cloud, *(() if threshold is None else (threshold,)))
    limit = np.inf if threshold is None else threshold * scale
    for dims in (0, 1):
        ripser_bars = _ripser_bars(cloud * scale, dims, limit)
        assert ripser_bars is not None
        for ours, reference in zip(
            sorted_bars(ripser_bars), sorted_bars(_simplex_tree_bars(cloud * scale, dims, limit)), strict=True
        ):
            np.testing.assert_array_equal(ours, reference)  # the same numbers, to the last bit


@given(st.one_of(point_clouds(min_points=2, max_points=40, max_dim=5), looped_clouds(max_points=40)), st.data())
def test_ripser_gives_the_simplex_tree_bars_to_the_last_bit(cloud, data):
    pytest.importorskip("numba")
    longest = F.longest_mst_edge(cloud)
    choice = data.draw(st.sampled_from(["none", "mst", "half"]))
    threshold = None if choice == "none" or longest is None else longest * (0.5 if choice == "half" else 1.0)
    assert_ripser_gives_the_simplex_tree_bars(cloud, threshold)


def test_ripser_gives_the_simplex_tree_bars_of_healthy_and_collapsed_features():
    pytest.importorskip("numba")
    rng = np.random.default_rng(5)
    healthy = rng.normal(size=(256, 64)) * rng.uniform(0.2, 1.0, 64)
    centres = healthy[np.arange(256) % 4]
    for cloud in (healthy, centres + 1e-3 * (healthy - centres), np.repeat(healthy[:64], 4, axis=0)):
        assert_ripser_gives_the_simplex_tree_bars(cloud, F.longest_mst_edge(cloud))


@given(point_clouds(min_points=2, max_points=30, max_dim=6), st.floats(0.0, 1.2))
def test_the_rips_edges_have_gudhis_lengths_to_the_last_bit(cloud, quantile):
    kernel = rips_edges_kernel()
    if kernel is None:
        pytest.skip("numba is not installed")
    distances = pairwise_distances(cloud)[np.triu_indices(cloud.shape[0], 1)]
    limit = float(np.quantile(distances, min(quantile, 1.0))) * (1.0 + max(quantile - 1.0, 0.0))
    tree = gudhi.RipsComplex(points=cloud, max_edge_length=limit).create_simplex_tree(max_dimension=1)
    expected = sorted((s[0], s[1], f) for s, f in tree.get_skeleton(1) if len(s) == 2)
    rows, cols, lengths = kernel(cloud, limit)
    assert sorted(zip(rows.tolist(), cols.tolist(), lengths.tolist(), strict=True)) == expected


def test_the_rips_edges_of_a_probe_sized_cloud_have_gudhis_lengths_to_the_last_bit():
    kernel = rips_edges_kernel()
    if kernel is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    cloud = rng.normal(size=(256, 64)) * rng.uniform(0.2, 1.0, 64)  # rows long enough for every vector width
    limit = float(np.quantile(pairwise_distances(cloud)[np.triu_indices(256, 1)], 0.3))
    tree = gudhi.RipsComplex(points=cloud, max_edge_length=limit).create_simplex_tree(max_dimension=1)
    expected = sorted((s[0], s[1], f) for s, f in tree.get_skeleton(1) if len(s) == 2)
    rows, cols, lengths = kernel(cloud, limit)
    assert sorted(zip(rows.tolist(), cols.tolist(), lengths.tolist(), strict=True)) == expected


lengths = st.lists(st.floats(0.0, 50.0, allow_nan=False), max_size=40)


@given(lengths, lengths, st.sampled_from([1.0, 2.0, 3.5]))
def test_the_h0_programme_finds_the_optimal_matching(x, y, order):
    a = np.c_[np.zeros(len(x)), x].reshape(-1, 2)
    b = np.c_[np.zeros(len(y)), y].reshape(-1, 2)
    expected = _assignment_cost(a, b, order) if len(x) + len(y) else 0.0
    assert _common_birth_cost(np.sort(np.asarray(x)), np.sort(np.asarray(y)), order) == pytest.approx(
        expected, rel=1e-9, abs=1e-12
    )


bars = st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 5.0)), max_size=30)


@given(bars, bars)
def test_the_distance_of_any_diagrams_is_the_optimal_matching(first, second):
    a = np.array([(birth, birth + length) for birth, length in first]).reshape(-1, 2)
    b = np.array([(birth, birth + length) for birth, length in second]).reshape(-1, 2)
    expected = _assignment_cost(a, b, 1.0) if len(a) + len(b) else 0.0
    assert F.diagram_distance(a, b) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_large_orders_neither_overflow_nor_underflow():
    a, b = [[0.0, 1e200], [0.0, 3e-200]], [[0.0, 2e200]]
    assert F.diagram_distance(a, b, order=100) == pytest.approx(1e200, rel=1e-6)
    small = [[0.0, 0.4], [0.0, 0.3]], [[0.0, 0.45]]
    assert F.diagram_distance(*small, order=60) > 0.1  # (0.3/2)^60 underflows without the rescaling
    with pytest.raises(InputError, match=r"`order` must be a finite number in \[1, 100\], got 2000"):
        F.diagram_distance(a, b, order=2000)


@given(x=lengths, y=lengths)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_compiled_h0_programme_gives_the_same_cost_to_the_last_bit(monkeypatch, x, y):
    pytest.importorskip("numba")
    x, y = np.sort(np.asarray(x, dtype=np.float64)), np.sort(np.asarray(y, dtype=np.float64))
    monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "0")
    reference = _common_birth_cost(x, y, 1.0)
    monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "1")
    assert _common_birth_cost(x, y, 1.0) == reference
