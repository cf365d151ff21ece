import math
import pickle

import gudhi
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.strategies import clouds_with_epsilon, diagrams, margin, rotations
from topocallbacks import functional as F
from topocallbacks.exceptions import InputError, NonFiniteError


def gudhi_betti_from_scratch(points, epsilon):
    """The reference: GUDHI's full Rips 2-skeleton at ε, no collapse, GUDHI's own distances."""
    tree = gudhi.RipsComplex(points=points, max_edge_length=epsilon).create_simplex_tree(max_dimension=2)
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=True)
    betti = tree.betti_numbers()
    return betti[0], betti[1] if len(betti) > 1 else 0


def circle(n, radius=1.0):
    angles = 2 * np.pi * np.arange(n) / n
    return radius * np.stack([np.cos(angles), np.sin(angles)], axis=1)


def chord(n, k):
    """Distance between points k steps apart on a unit circle of n evenly spaced points."""
    return 2 * math.sin(math.pi * k / n)


# --- known answers -------------------------------------------------------------------------------------------


@given(n=st.integers(6, 48), position=st.floats(0.01, 0.99))
def test_circle_has_one_loop_between_the_side_and_the_third_of_the_circle(n, position):
    # Adamaszek & Adams (2017): VR of n evenly spaced circle points joined up to k steps apart is a circle
    # while k/n < 1/3. So beta = (1, 1) for chord(n, 1) <= eps < chord(n, k_max + 1), k_max = ceil(n/3) - 1.
    k_max = math.ceil(n / 3) - 1
    low, high = chord(n, 1), chord(n, k_max + 1)
    epsilon = low + position * (high - low)
    assert F.betti_numbers(circle(n), epsilon) == (1, 1)


def test_circle_below_its_side_length_is_n_points_and_above_the_diameter_is_contractible():
    assert F.betti_numbers(circle(30), 0.99 * chord(30, 1)) == (30, 0)
    assert F.betti_numbers(circle(30), 2.01) == (1, 0)


@given(separation=st.floats(10.0, 1e6), seed=st.integers(0, 1000))
def test_two_far_clusters_have_two_components(separation, seed):
    rng = np.random.default_rng(seed)
    cluster = rng.uniform(-1, 1, size=(15, 3))
    cloud = np.vstack([cluster, cluster[::-1] + separation])
    # Diameter of a cluster is below 2 * sqrt(3) < 3.5; the clusters are at least 10 - 3.5 apart.
    assert F.betti_numbers(cloud, 3.5).b0 == 2


@pytest.mark.parametrize("side", [2, 3, 5, 8])
def test_square_grid_loops_fill_in_once_diagonals_join(side):
    x, y = np.meshgrid(np.arange(side, dtype=float), np.arange(side, dtype=float))
    grid = np.stack([x.ravel(), y.ravel()], axis=1)
    # Sides only: every unit square is an empty 4-cycle.
    assert F.betti_numbers(grid, 1.2) == (1, (side - 1) ** 2)
    # With the diagonals every square is two filled triangles.
    assert F.betti_numbers(grid, 1.5) == (1, 0)


def test_identical_points_are_one_component_at_any_scale():
    cloud = np.full((50, 7), 3.25)
    for epsilon in (1e-300, 1e-6, 1.0, 1e300):
        assert F.betti_numbers(cloud, epsilon) == (1, 0)


def test_isolated_points_and_a_single_edge():
    assert F.betti_numbers([[0.0], [10.0], [20.0]], 1.0) == (3, 0)
    assert F.betti_numbers([[0.0], [1.0]], 1.0) == (1, 0)  # distance == ε is an edge
    assert F.betti_numbers([[0.0], [1.0]], np.nextafter(1.0, 0.0)) == (2, 0)


def test_result_is_a_named_tuple_of_ints():
    result = F.betti_numbers(circle(12), 0.6)
    b0, b1 = result
    assert (result.b0, result.b1) == (b0, b1) == (1, 1)
    assert all(type(value) is int for value in result)
    assert pickle.loads(pickle.dumps(result)) == result


# --- against GUDHI from scratch, and ripser ----------------------------------------------------------------


@given(clouds_with_epsilon(max_points=22, max_dim=3))
def test_agrees_with_gudhi_full_rips_from_scratch(cloud_and_epsilon):
    cloud, epsilon = cloud_and_epsilon
    assume(margin(cloud, epsilon) > 1e-9)
    assert F.betti_numbers(cloud, epsilon) == gudhi_betti_from_scratch(cloud, epsilon)


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_gudhi_on_larger_structured_clouds(seed):
    rng = np.random.default_rng(seed)
    # Noisy circles and clusters in 3-D: loops appear at ε around the noise level.
    parts = [circle(40, radius=r) + rng.normal(scale=0.05, size=(40, 2)) + rng.uniform(-8, 8, 2) for r in (1, 2)]
    cloud = np.hstack([np.vstack(parts), rng.normal(scale=0.05, size=(80, 1))])
    for epsilon in (0.2, 0.35, 0.6, 1.0):
        assert F.betti_numbers(cloud, epsilon) == gudhi_betti_from_scratch(cloud, epsilon)


ripser = pytest.importorskip("ripser", reason="ripser is an optional second reference")


@pytest.mark.filterwarnings("ignore:The input:UserWarning")  # ripser's shape guesses on tiny clouds
@given(clouds_with_epsilon(max_points=20, max_dim=3))
def test_agrees_with_ripser(cloud_and_epsilon):
    cloud, epsilon = cloud_and_epsilon
    # ripser works in single precision: every decision must be clear at float32 resolution of the coordinates.
    assume(margin(cloud, epsilon) > 1e-4)
    assume(margin(cloud, epsilon) * epsilon > 1e-4 * float(np.max(np.abs(cloud))))
    assume(epsilon > 1e-30 and np.all(np.abs(cloud[cloud != 0]) > 1e-30))
    diagrams_ = ripser.ripser(cloud, maxdim=1, thresh=epsilon)["dgms"]
    expected = tuple(int(np.isinf(d[:, 1]).sum()) for d in diagrams_)
    assert F.betti_numbers(cloud, epsilon) == expected


# --- invariances ------------------------------------------------------------------------------------------


@given(clouds_with_epsilon(max_points=20), st.integers(0, 2**32 - 1))
def test_permutation_invariance(cloud_and_epsilon, seed):
    cloud, epsilon = cloud_and_epsilon
    permuted = cloud[np.random.default_rng(seed).permutation(len(cloud))]
    assert F.betti_numbers(permuted, epsilon) == F.betti_numbers(cloud, epsilon)


@given(clouds_with_epsilon(max_points=18, max_dim=3), st.data())
def test_rigid_motion_invariance(cloud_and_epsilon, data):
    cloud, epsilon = cloud_and_epsilon
    # A rotation moves each coordinate by rounding error relative to the largest one: stay clear of borderline
    # pairs at that resolution (a 1e-139 gap between points at 1.0 cannot survive any rotation).
    assume(margin(cloud, epsilon) * epsilon > 1e-9 * float(np.max(np.abs(cloud))))
    rotation = data.draw(rotations(cloud.shape[1]))
    # A translation in units of the cloud's size: shifting a cloud of diameter 1e-50 by 1.0 would erase it.
    shift = data.draw(st.lists(st.floats(-100, 100), min_size=cloud.shape[1], max_size=cloud.shape[1]))
    size = max(float(np.ptp(cloud)), epsilon)
    moved = cloud @ rotation.T + np.asarray(shift) * size
    assert F.betti_numbers(moved, epsilon) == F.betti_numbers(cloud, epsilon)


@given(clouds_with_epsilon(max_points=18), st.integers(-900, 900))
def test_scaling_by_a_power_of_two_is_exactly_covariant(cloud_and_epsilon, exponent):
    cloud, epsilon = cloud_and_epsilon
    factor = 2.0**exponent
    # Avoid subnormal coordinates, the only place where scaling by 2**k is inexact.
    nonzero = np.abs(cloud[cloud != 0])
    assume(nonzero.size == 0 or nonzero.min() * factor > 1e-290)
    assert F.betti_numbers(cloud * factor, epsilon * factor) == F.betti_numbers(cloud, epsilon)


@given(clouds_with_epsilon(max_points=18), st.floats(1e-3, 1e3))
def test_scaling_covariance(cloud_and_epsilon, factor):
    cloud, epsilon = cloud_and_epsilon
    assume(margin(cloud, epsilon) > 1e-9)
    assert F.betti_numbers(cloud * factor, epsilon * factor) == F.betti_numbers(cloud, epsilon)


@given(clouds_with_epsilon(max_points=18), st.floats(1e-12, 1e12).filter(lambda s: s != 1.0))
def test_monotone_components(cloud_and_epsilon, bigger):
    cloud, epsilon = cloud_and_epsilon
    # β0 never increases with ε.
    small, large = sorted([epsilon, epsilon * bigger])
    assert F.betti_numbers(cloud, large).b0 <= F.betti_numbers(cloud, small).b0


def test_huge_and_tiny_coordinates_give_finite_exact_answers():
    base = circle(16)
    assert F.betti_numbers(np.full((3, 1), 2.2e-313), 1e-320) == (1, 0)  # subnormal coordinates
    for scale in (1e-200, 1e200, 1e300):
        assert F.betti_numbers(base * scale, 0.5 * scale) == (1, 1)
    # Far from the origin: the Gram trick alone would lose every digit of the distances.
    assert F.betti_numbers(base + 1e9, 0.5) == (1, 1)


def test_accepts_torch_tensors_lists_and_integers():
    torch = pytest.importorskip("torch")
    cloud = circle(16)
    expected = F.betti_numbers(cloud, 0.5)
    assert F.betti_numbers(torch.tensor(cloud, dtype=torch.float64), 0.5) == expected
    assert F.betti_numbers(torch.tensor(cloud, requires_grad=True), 0.5) == expected
    assert F.betti_numbers(torch.tensor(cloud.T.copy()).T, 0.5) == expected  # non-contiguous
    assert F.betti_numbers(cloud.tolist(), 0.5) == expected
    # Distances 3, 4 and 5: at ε = 3.5 only the first pair is joined.
    assert F.betti_numbers(np.array([[0, 0], [0, 3], [4, 0]], dtype=np.int32), 3.5) == (2, 0)
    assert F.betti_numbers(np.array([[0, 0], [0, 3], [4, 0]], dtype=np.int32), 4) == (1, 0)


# --- persistence diagrams ----------------------------------------------------------------------------------


def finite_bars(diagram):
    return diagram[np.isfinite(diagram[:, 1])]


@pytest.mark.parametrize("seed", range(4))
def test_diagrams_match_gudhi_without_collapse(seed):
    cloud = np.random.default_rng(seed).normal(size=(40, 3))
    ours = F.persistence_diagrams(cloud, max_dimension=1)
    tree = gudhi.RipsComplex(points=cloud).create_simplex_tree(max_dimension=2)
    tree.compute_persistence(homology_coeff_field=2)
    for dim in (0, 1):
        reference = tree.persistence_intervals_in_dimension(dim)
        assert gudhi.bottleneck_distance(ours[dim], reference) == pytest.approx(0.0, abs=1e-9)
        assert len(ours[dim]) == len(reference)


@pytest.mark.parametrize("seed", range(3))
def test_diagrams_match_ripser(seed):
    cloud = np.random.default_rng(seed).normal(size=(50, 4))
    ours = F.persistence_diagrams(cloud)
    reference = ripser.ripser(cloud, maxdim=1)["dgms"]
    for dim in (0, 1):
        distance = gudhi.bottleneck_distance(finite_bars(ours[dim]), finite_bars(reference[dim]))
        assert distance == pytest.approx(0.0, abs=1e-5)  # ripser works in single precision


def test_diagram_of_a_circle_has_one_long_loop_and_one_component():
    h0, h1 = F.persistence_diagrams(circle(24))
    assert np.isinf(h0[:, 1]).sum() == 1
    assert len(h1) == 1
    assert h1[0, 0] == pytest.approx(chord(24, 1)) or h1[0, 0] <= chord(24, 2)
    assert h1[0, 1] == pytest.approx(math.sqrt(3))


def test_diagram_threshold_turns_late_deaths_into_essential_bars():
    cloud = np.vstack([circle(12), circle(12) + 20.0])
    h0, h1 = F.persistence_diagrams(cloud, threshold=1.0)
    assert np.isinf(h0[:, 1]).sum() == 2  # the two circles never merge below 1.0
    assert np.isinf(h1[:, 1]).sum() == 2  # both loops still open at 1.0


def test_diagram_subsample_is_seeded_and_bounded():
    cloud = np.random.default_rng(0).normal(size=(300, 5))
    a = F.persistence_diagrams(cloud, max_points=60, seed=1)
    b = F.persistence_diagrams(cloud, max_points=60, seed=1)
    c = F.persistence_diagrams(cloud, max_points=60, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    assert len(a[0]) == 60  # one H0 bar per sampled point (generic data: no zero-length bars)


def test_diagrams_of_identical_points_and_huge_values():
    h0, h1 = F.persistence_diagrams(np.full((10, 3), 2.0))
    assert h0.tolist() == [[0.0, np.inf]]
    assert h1.shape == (0, 2)
    base = F.persistence_diagrams(circle(20))
    huge = F.persistence_diagrams(circle(20) * 1e250)
    for small, large in zip(base, huge, strict=True):
        np.testing.assert_allclose(large / 1e250, small, rtol=1e-12)


def test_diagrams_dimension_two_of_an_octahedron_finds_the_void():
    octahedron = np.vstack([np.eye(3), -np.eye(3)])
    diagrams_ = F.persistence_diagrams(octahedron, max_dimension=2)
    assert len(diagrams_) == 3
    assert len(diagrams_[2]) == 1  # the hollow sphere at sqrt(2) <= eps < 2


# --- persistence entropy -----------------------------------------------------------------------------------


@given(diagrams())
def test_normalised_entropy_is_in_unit_interval(diagram):
    value = F.persistence_entropy(diagram)
    assert 0.0 <= value <= 1.0


@given(diagrams(allow_infinite=False), st.integers(0, 2**32 - 1), st.integers(-20, 20))
def test_entropy_ignores_bar_order_and_scale(diagram, seed, exponent):
    factor = 2.0**exponent  # exact: a bar one ulp long stays one ulp long
    shuffled = diagram[np.random.default_rng(seed).permutation(len(diagram))]
    assert F.persistence_entropy(shuffled) == pytest.approx(F.persistence_entropy(diagram), abs=1e-12)
    assert F.persistence_entropy(diagram * factor) == pytest.approx(F.persistence_entropy(diagram), abs=1e-9)


def test_entropy_of_bars_too_short_to_register_is_finite():
    # 5e-324 / 2 underflows to p = 0: its term is 0 * log 0 = 0, never NaN.
    assert F.persistence_entropy([[0.0, 2.0], [0.0, 5e-324]]) == 0.0
    assert F.persistence_entropy([[0.0, 2.0], [0.0, 2.0], [0.0, 5e-324]]) == pytest.approx(math.log(2) / math.log(3))


def test_entropy_known_values():
    assert F.persistence_entropy(np.zeros((0, 2))) == 0.0
    assert F.persistence_entropy([]) == 0.0
    assert F.persistence_entropy([[0.0, 2.0]]) == 0.0  # a single bar
    assert F.persistence_entropy([[0.0, 1.0]] * 8) == pytest.approx(1.0)
    assert F.persistence_entropy([[0.0, 1.0]] * 8, normalize=False) == pytest.approx(math.log(8))
    # Zero-length bars are dropped, not counted as bars.
    assert F.persistence_entropy([[0.0, 1.0], [0.0, 1.0], [3.0, 3.0]]) == pytest.approx(1.0)
    # Lengths 1 and 3: p = (1/4, 3/4).
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert F.persistence_entropy([[0, 1], [1, 4]], normalize=False) == pytest.approx(expected)
    assert F.persistence_entropy([[0, 1], [1, 4]]) == pytest.approx(expected / math.log(2))


def test_entropy_caps_infinite_bars_when_asked():
    diagram = [[0.0, 1.0], [0.0, np.inf]]
    assert F.persistence_entropy(diagram) == 0.0  # essential bar dropped: one bar left
    assert F.persistence_entropy(diagram, max_death=1.0) == pytest.approx(1.0)  # two bars of length 1


@pytest.mark.parametrize(
    ("diagram", "match"),
    [
        (np.ones((3, 3)), "shape \\(n_bars, 2\\)"),
        (np.ones(4), "shape \\(n_bars, 2\\)"),
        ([[0.0, np.nan]], "non-NaN"),
        ([[np.inf, np.inf]], "finite births"),
        ([[2.0, 1.0]], "dies before it is born: row 0"),
        (np.array([["a", "b"]]), "numeric dtype"),
    ],
)
def test_entropy_rejects_bad_diagrams(diagram, match):
    with pytest.raises(InputError, match=match):
        F.persistence_entropy(diagram)


# --- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0, -1.0, math.nan, math.inf, "0.5", None, True])
def test_betti_rejects_bad_epsilon(epsilon):
    with pytest.raises(InputError, match="`epsilon` must be a finite number > 0, got"):
        F.betti_numbers(circle(8), epsilon)


def test_betti_error_names_the_value():
    with pytest.raises(ValueError, match=r"`epsilon` must be a finite number > 0, got -1\.0"):
        F.betti_numbers(circle(8), -1.0)


def test_nan_rows_are_reported_not_passed_to_gudhi():
    cloud = circle(8)
    cloud[3, 1] = np.nan
    cloud[5, 0] = np.inf
    with pytest.raises(NonFiniteError, match=r"2 non-finite value\(s\) \(NaN or Inf\) in 2 row\(s\): \[3, 5\]") as err:
        F.betti_numbers(cloud, 0.5)
    assert err.value.rows == (3, 5)
    assert err.value.count == 2
    restored = pickle.loads(pickle.dumps(err.value))
    assert restored.rows == (3, 5)
    assert str(restored) == str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_dimension": -1}, "`max_dimension` must be an integer >= 0, got -1"),
        ({"max_dimension": 1.5}, "`max_dimension` must be an integer >= 0, got 1.5"),
        ({"max_points": 1}, "`max_points` must be an integer >= 2, got 1"),
        ({"threshold": 0.0}, "`threshold` must be a finite number > 0, got 0.0"),
        ({"seed": -3}, "`seed` must be an integer >= 0, got -3"),
    ],
)
def test_diagrams_reject_bad_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        F.persistence_diagrams(circle(8), **kwargs)
