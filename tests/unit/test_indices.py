import math

import gudhi
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_topology import circle, gudhi_betti_from_scratch
from topocallbacks.exceptions import InputError, NonFiniteError
from topocallbacks.functional import persistence_diagrams
from topocallbacks.functional.indices import BettiCurve, betti_curve, diagram_distance, total_persistence


def gudhi_quantile_scales(points, quantiles):
    distances = np.array([[np.linalg.norm(a - b) for b in points] for a in points])[np.triu_indices(len(points), 1)]
    scales = np.quantile(distances, quantiles)
    return np.where(scales > 0, scales, distances[distances > 0].min())


@pytest.mark.parametrize("seed", range(4))
def test_betti_curve_matches_gudhi_from_scratch_at_every_quantile(seed):
    points = np.random.default_rng(seed).normal(size=(60, 3))
    quantiles = (0.02, 0.05, 0.1, 0.2, 0.3)
    curve = betti_curve(points, quantiles)
    scales = gudhi_quantile_scales(points, quantiles)
    np.testing.assert_allclose(curve.epsilons, scales, rtol=1e-9)
    # The scales are quantiles of the distances themselves: check at a hair above each (GUDHI includes an edge
    # whose length equals the threshold, so does betti_numbers).
    for eps, b0, b1 in zip(curve.epsilons, curve.betti0, curve.betti1, strict=True):
        assert (b0, b1) == gudhi_betti_from_scratch(points, eps * (1 + 1e-12))


def test_betti_curve_of_a_circle_sees_the_loop_and_two_clusters_stay_two():
    curve = betti_curve(circle(30), quantiles=(0.08, 0.12))
    # Of the 435 chords, the shortest 30 are sides and the next 30 skip one point: at the 8 % and 12 % quantiles
    # every side and some skips are edges, and the complex is still a circle (Adamaszek & Adams: k/n < 1/3).
    assert curve.betti0.tolist() == [1, 1]
    assert curve.betti1.tolist() == [1, 1]
    rng = np.random.default_rng(0)
    clusters = np.concatenate([rng.normal(size=(40, 2)) * 0.01, rng.normal(size=(40, 2)) * 0.01 + 5])
    assert betti_curve(clusters, quantiles=(0.3, 0.45)).betti0.tolist() == [2, 2]


@given(scale=st.floats(1e-6, 1e6), seed=st.integers(0, 2**16))
def test_betti_curve_is_scale_free(scale, seed):
    points = np.random.default_rng(seed).normal(size=(40, 4))
    base, scaled = betti_curve(points), betti_curve(points * scale)
    assert base.betti0.tolist() == scaled.betti0.tolist()
    assert base.betti1.tolist() == scaled.betti1.tolist()
    assert math.isclose(base.component_area, scaled.component_area)


def test_betti_curve_areas_and_full_collapse():
    collapsed = betti_curve(np.ones((50, 3)))
    assert isinstance(collapsed, BettiCurve)
    assert collapsed.betti0.tolist() == [1] * 5
    assert collapsed.betti1.tolist() == [0] * 5
    assert collapsed.component_area == pytest.approx(1 / 50)
    assert collapsed.loop_area == 0.0
    spread = betti_curve(np.random.default_rng(0).normal(size=(512, 32)))
    # The documented value for an isotropic Gaussian (n = 512, d = 32): beta0 = 133, 75, 18, 4, 2.
    assert spread.betti0.tolist() == [133, 75, 18, 4, 2]
    assert spread.component_area == pytest.approx(232 / 5 / 512)
    assert spread.loop_area == pytest.approx(spread.betti1.mean() / 512)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantiles": ()}, "`quantiles` must be a non-empty increasing sequence, got ()"),
        ({"quantiles": (0.2, 0.1)}, "`quantiles` must be a non-empty increasing sequence, got (0.2, 0.1)"),
        ({"quantiles": (0.0,)}, "`quantiles` must be a finite number in (0, 1], got 0.0"),
        ({"quantiles": (1.5,)}, "`quantiles` must be a finite number in (0, 1], got 1.5"),
        ({"max_points": 1}, "`max_points` must be"),
    ],
)
def test_betti_curve_rejects_bad_arguments_by_name(kwargs, message):
    with pytest.raises(InputError) as error:
        betti_curve(np.zeros((5, 2)), **kwargs)
    assert message in str(error.value)


def test_betti_curve_rejects_non_finite_points():
    points = np.zeros((5, 2))
    points[3, 1] = np.nan
    with pytest.raises(NonFiniteError, match="NaN"):
        betti_curve(points)


def test_total_persistence_known_values_and_scale_freedom():
    assert total_persistence([]) == 0.0
    assert total_persistence([[0.0, 1.0], [0.5, 2.5], [0.0, math.inf]]) == 3.0
    assert total_persistence([[0.0, 1.0], [0.5, 2.5]], order=2) == 5.0
    points = np.random.default_rng(0).normal(size=(80, 3))
    h0, _ = persistence_diagrams(points, max_points=80)
    h0_scaled, _ = persistence_diagrams(points * 7.0, max_points=80)
    assert total_persistence(h0, scale=1.0) == pytest.approx(total_persistence(h0_scaled, scale=7.0))
    # H0 total persistence is the length of the minimum spanning tree (GUDHI's own filtration values).
    tree = gudhi.RipsComplex(points=points).create_simplex_tree(max_dimension=1)
    tree.compute_persistence()
    finite = [d - b for b, d in tree.persistence_intervals_in_dimension(0) if math.isfinite(d)]
    assert total_persistence(h0) == pytest.approx(sum(finite))
    with pytest.raises(InputError, match="`order` must be a finite number in"):
        total_persistence([[0.0, 1.0]], order=0)
    with pytest.raises(InputError, match="`scale` must be a finite number in"):
        total_persistence([[0.0, 1.0]], scale=-1.0)


def test_diagram_distance_known_values():
    assert diagram_distance([[0.0, 1.0]], [[0.0, 1.0], [0.0, math.inf]]) == 0.0  # infinite bars ignored
    assert diagram_distance([[0.0, 1.0]], [[0.0, 2.0]]) == pytest.approx(1.0)
    # A lone bar is matched to the diagonal: L-infinity distance half its length.
    assert diagram_distance([[0.0, 2.0]], []) == pytest.approx(1.0)
    assert diagram_distance([[0.0, 2.0], [0.0, 4.0]], [], order=2) == pytest.approx(math.sqrt(1 + 4))
    rng = np.random.default_rng(3)
    a, b = rng.uniform(0, 1, size=(20, 2)).cumsum(1), rng.uniform(0, 1, size=(15, 2)).cumsum(1)
    assert diagram_distance(a, b) == pytest.approx(diagram_distance(b, a))
    assert diagram_distance(a, b) == pytest.approx(gudhi.hera.wasserstein_distance(a, b, order=1, internal_p=np.inf))
    with pytest.raises(InputError, match="`order` must be a finite number in"):
        diagram_distance(a, b, order=0.5)
    with pytest.raises(InputError, match="dies before it is born"):
        diagram_distance([[1.0, 0.0]], b)


def test_diagram_distance_of_diagrams_equal_up_to_rounding_is_tiny_and_fast():
    # GUDHI's Hera loops forever on this pair (many H0 bars born at 0, equal up to rounding); consecutive checks of
    # a monitor produce exactly such pairs when the features barely move.
    rng = np.random.default_rng(0)
    a = np.sort(rng.uniform(0, 1, size=(199, 2)), axis=1)
    a[:, 0] = 0
    assert diagram_distance(a, a * (1 + 1e-15)) == pytest.approx(0.0, abs=1e-12)
    assert diagram_distance(a, a) == 0.0
    assert diagram_distance([], []) == 0.0


def test_diagram_distance_matches_a_brute_force_matching():
    import itertools

    rng = np.random.default_rng(5)
    a = np.sort(rng.uniform(0, 1, size=(3, 2)), axis=1)
    b = np.sort(rng.uniform(0, 1, size=(2, 2)), axis=1)
    # Every partial matching of a to b; unmatched bars go to the diagonal.
    best = math.inf
    for k in range(0, 3):
        for left in itertools.permutations(range(3), k):
            for right in itertools.permutations(range(2), k):
                cost = sum(np.max(np.abs(a[i] - b[j])) ** 2 for i, j in zip(left, right, strict=True))
                cost += sum(((a[i, 1] - a[i, 0]) / 2) ** 2 for i in range(3) if i not in left)
                cost += sum(((b[j, 1] - b[j, 0]) / 2) ** 2 for j in range(2) if j not in right)
                best = min(best, cost)
    assert diagram_distance(a, b, order=2) == pytest.approx(math.sqrt(best))


def test_gradient_norm_is_the_norm_clip_grad_norm_sees():
    import torch

    from topocallbacks.functional import gradient_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert gradient_norm(model.parameters()) == 0.0  # no gradients yet
    model(torch.randn(8, 5)).pow(2).sum().backward()
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")))
    assert gradient_norm(model.parameters()) == pytest.approx(expected, rel=1e-6)


def test_total_persistence_beyond_float64_is_a_clear_error_not_inf():
    assert total_persistence([[0.0, 1e100], [0.0, 1e100]], order=2) == pytest.approx(2e200)
    with pytest.raises(InputError, match=r"overflows float64: the longest bar is 1e\+200 at `order`=2; pass `scale`"):
        total_persistence([[0.0, 1e200], [0.0, 1e200]], order=2)
    assert total_persistence([[0.0, 1e200], [0.0, 1e200]], order=2, scale=1e200) == 2.0


@pytest.mark.parametrize(
    ("diagram", "message"),
    [
        ("abc", r"`diagram` must be an array of \(birth, death\) rows, got a str: 'abc'"),
        ([["a", "b"]], r"`diagram` must be an array of \(birth, death\) rows of numbers, got \[\['a', 'b'\]\]"),
    ],
)
def test_a_diagram_of_text_is_a_clear_error(diagram, message):
    with pytest.raises(InputError, match=message):
        diagram_distance(diagram, [[0.0, 1.0]])
    with pytest.raises(InputError, match=message):
        total_persistence(diagram)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ([None], "got NoneType None at position 0"),
        ([3], "got int 3 at position 0"),
        (["x"], "got str 'x' at position 0"),
        (3, "must be an iterable of tensors, got int"),
    ],
)
def test_gradient_norm_names_a_bad_parameter(parameters, message):
    from topocallbacks.functional import gradient_norm

    with pytest.raises(InputError, match=message):
        gradient_norm(parameters)
