"""Weight-space topology (neural persistence, the H0 persistence of neurons), flattening steps and spectrum decay."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.sparse.csgraph import minimum_spanning_tree
from scipy.spatial.distance import pdist, squareform

from topocallbacks import functional as F
from topocallbacks.exceptions import InputError, NonFiniteError

# --- neural persistence ---------------------------------------------------------------------------------------


def neural_persistence_reference(weight, order=2.0):
    """Kruskal with a union-find on the complete bipartite graph, written out (the paper's Algorithm 1)."""
    n, m = weight.shape
    w = np.abs(weight) / np.abs(weight).max()
    parent = list(range(n + m))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    persistence = [1.0]  # the component that never dies, paired with 0 as in the authors' code
    for _, i, j in sorted(((w[i, j], i, n + j) for i in range(n) for j in range(m)), reverse=True):
        a, b = find(i), find(j)
        if a != b:
            parent[a] = b
            persistence.append(1.0 - w[i, j - n])
    assert len(persistence) == n + m
    return float(np.sum(np.power(persistence, order)) ** (1 / order))


small_matrices = st.tuples(st.integers(1, 6), st.integers(1, 6)).flatmap(
    lambda shape: hnp.arrays(
        np.float64,
        shape,
        # Integers in [-4, 4] make ties common: every maximum spanning tree must give the same value.
        elements=st.integers(-4, 4).map(float) | st.floats(-3, 3, allow_nan=False, allow_infinity=False),
    ).filter(lambda w: np.abs(w).max() > 0)
)


def test_neural_persistence_of_a_hand_computed_layer():
    # w' = [[1, .5], [.25, 0]]: the tree takes 1 (a1-b1), .5 (a1-b2), .25 (a2-b1); persistence 0, .5, .75 and 1.
    weight = np.array([[4.0, -2.0], [1.0, 0.0]])
    assert F.neural_persistence(weight) == pytest.approx(math.sqrt(0.25 + 0.5625 + 1.0), rel=1e-12)
    assert F.neural_persistence(weight, normalize=True) == pytest.approx(math.sqrt(1.8125 / 3), rel=1e-12)
    assert F.neural_persistence(weight, order=1.0) == pytest.approx(0.5 + 0.75 + 1.0, rel=1e-12)
    # The paper's network-wide normalisation: the largest weight elsewhere is 8, so here w' = [[.5, .25], ...].
    assert F.neural_persistence(weight, max_weight=8.0) == pytest.approx(
        math.sqrt(0.5**2 + 0.75**2 + 0.875**2 + 1.0), rel=1e-12
    )


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (16, 4)])
def test_constant_matrix_has_every_merge_at_the_top(shape):
    weight = np.full(shape, -0.7)
    assert F.neural_persistence(weight) == pytest.approx(1.0)
    assert F.neural_persistence(weight, normalize=True) == pytest.approx(1.0 / math.sqrt(sum(shape) - 1))


def test_random_gaussian_value_and_the_normalised_range():
    values = [F.neural_persistence(np.random.default_rng(seed).normal(size=(64, 64))) for seed in range(3)]
    assert all(3.8 < v < 4.6 for v in values)  # the docstring's "about 4.1"
    for seed in range(5):
        weight = np.random.default_rng(seed).normal(size=(20, 7))
        assert 0.0 < F.neural_persistence(weight, normalize=True) <= 1.0


@given(small_matrices)
def test_neural_persistence_matches_kruskal_written_out(weight):
    assert F.neural_persistence(weight) == pytest.approx(neural_persistence_reference(weight), rel=1e-12, abs=1e-12)
    assert F.neural_persistence(weight, order=3.0) == pytest.approx(
        neural_persistence_reference(weight, 3.0), rel=1e-12, abs=1e-12
    )


@given(small_matrices, st.integers(0, 2**32 - 1), st.floats(1e-3, 1e3))
def test_neural_persistence_invariances(weight, seed, scale):
    rng = np.random.default_rng(seed)
    value = F.neural_persistence(weight)
    permuted = weight[rng.permutation(weight.shape[0])][:, rng.permutation(weight.shape[1])]
    signs = rng.choice([-1.0, 1.0], size=weight.shape)
    assert F.neural_persistence(permuted) == pytest.approx(value, rel=1e-12)
    assert F.neural_persistence(weight.T) == pytest.approx(value, rel=1e-12)
    assert F.neural_persistence(weight * signs) == pytest.approx(value, rel=1e-12)
    assert F.neural_persistence(weight * scale) == pytest.approx(value, rel=1e-9)


def test_kernels_torch_tensors_and_bad_input():
    kernel = np.random.default_rng(0).normal(size=(4, 3, 2, 2))
    assert F.neural_persistence(kernel) == F.neural_persistence(kernel.reshape(4, 12))
    assert F.neural_persistence(torch.tensor(kernel, dtype=torch.float32)) == pytest.approx(
        F.neural_persistence(kernel.astype(np.float32)), rel=1e-12
    )
    with pytest.raises(InputError, match=r"`weight` must be a weight matrix .* got a 1-D array"):
        F.neural_persistence(np.ones(3))
    with pytest.raises(InputError, match="`weight` is all zeros"):
        F.neural_persistence(np.zeros((2, 3)))
    with pytest.raises(NonFiniteError, match="`weight` contains 1 non-finite"):
        F.neural_persistence(np.array([[1.0, np.nan]]))
    with pytest.raises(InputError, match=r"`order` must be a finite number in \[1, inf\), got 0.5"):
        F.neural_persistence(np.ones((2, 2)), order=0.5)
    with pytest.raises(InputError, match=r"`max_weight` must be >= the layer's largest \|w\| \(2.0\), got 1.0"):
        F.neural_persistence(np.array([[2.0, 1.0]]), max_weight=1.0)
    with pytest.raises(InputError, match="`weight` must have a real numeric dtype"):
        F.neural_persistence(np.array([["a", "b"]]))


# --- H0 total persistence of the neurons ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_weight_h0_total_persistence_is_the_mst_length_scipy_finds(seed):
    rows = np.random.default_rng(seed).normal(size=(40, 6))
    expected = minimum_spanning_tree(squareform(pdist(rows))).sum()
    assert F.weight_h0_total_persistence(rows) == pytest.approx(expected, rel=1e-10)


def test_weight_h0_total_persistence_is_the_h0_total_persistence_gudhi_finds():
    rows = np.random.default_rng(7).normal(size=(30, 5))
    h0 = F.persistence_diagrams(rows, max_dimension=0, max_points=30)[0]
    assert F.weight_h0_total_persistence(rows) == pytest.approx(F.total_persistence(h0), rel=1e-9)


def test_weight_h0_total_persistence_known_values():
    assert F.weight_h0_total_persistence([[0.0, 0.0], [3.0, 4.0], [3.0, 5.0]]) == 6.0
    assert F.weight_h0_total_persistence(np.ones((5, 3))) == 0.0
    assert F.weight_h0_total_persistence(np.ones((1, 3))) == 0.0
    values = [F.weight_h0_total_persistence(np.random.default_rng(s).normal(size=(64, 64))) for s in range(3)]
    assert all(560 < v < 620 for v in values)  # the docstring's "about 590"
    # Duplicated neurons add zero-length edges (scipy's csgraph would read those zeros as missing edges).
    rows = np.random.default_rng(1).normal(size=(10, 4))
    assert F.weight_h0_total_persistence(np.vstack([rows, rows[:3]])) == pytest.approx(
        F.weight_h0_total_persistence(rows), rel=1e-12
    )


@given(
    hnp.arrays(np.float64, st.tuples(st.integers(2, 12), st.integers(1, 5)), elements=st.floats(-5, 5)),
    st.integers(0, 2**32 - 1),
    st.floats(0.01, 100.0),
)
def test_weight_h0_total_persistence_invariances(rows, seed, scale):
    rng = np.random.default_rng(seed)
    value = F.weight_h0_total_persistence(rows)
    rotation = np.linalg.qr(rng.normal(size=(rows.shape[1], rows.shape[1])))[0]
    assert F.weight_h0_total_persistence(rows[rng.permutation(len(rows))]) == pytest.approx(value, rel=1e-9, abs=1e-9)
    assert F.weight_h0_total_persistence(rows[:, rng.permutation(rows.shape[1])]) == pytest.approx(
        value, rel=1e-9, abs=1e-9
    )
    assert F.weight_h0_total_persistence(rows @ rotation) == pytest.approx(value, rel=1e-7, abs=1e-7)
    assert F.weight_h0_total_persistence(rows * scale) == pytest.approx(value * scale, rel=1e-9, abs=1e-9)


# --- flattening step ------------------------------------------------------------------------------------------


def test_flattening_step_examples():
    assert F.flattening_step([0, 10, 20, 30, 40], [0.0, 5.0, 5.2, 5.25, 5.25]) == 10
    assert F.flattening_step([0, 10, 20], [0.0, 1.0, 3.0]) is None
    assert F.flattening_step([0, 1, 2], [2.0, 2.0, 2.0]) == 0
    # A plateau, then a rise, then a plateau: the second plateau counts (the first came before the fast change).
    assert F.flattening_step([0, 1, 2, 3, 4, 5], [1.0, 1.0, 1.0, 9.0, 9.05, 9.05]) == 3
    # The rate is per step: a big change over a long interval is slow.
    assert F.flattening_step([0, 1, 100, 101], [0.0, 1.0, 2.0, 2.01]) == 1
    # fraction sets what counts as flat.
    assert F.flattening_step([0, 1, 2, 3], [0.0, 1.0, 1.3, 1.35], fraction=0.5) == 1
    assert F.flattening_step([0, 1, 2, 3], [0.0, 1.0, 1.3, 1.35], fraction=0.1) == 2


def test_flattening_step_on_an_exponential_approach():
    steps = list(range(0, 200, 10))
    values = [1.0 - math.exp(-s / 30) for s in steps]
    # The rate over [s, s + 10] is exp(-s/30) times the first one's: below 10 % from s >= 30 ln 10 = 69.1.
    assert F.flattening_step(steps, values) == 70


@given(
    st.lists(st.floats(-10, 10), min_size=3, max_size=12),
    st.floats(0.1, 10) | st.floats(-10, -0.1),
    st.floats(-100, 100),
)
def test_flattening_step_ignores_the_units_of_the_quantity(values, scale, shift):
    steps = list(range(len(values)))
    scaled = [scale * v + shift for v in values]
    rates = np.abs(np.diff(values))
    if rates.max() > 0 and np.any(np.abs(rates / rates.max() - 0.1) < 1e-9):
        return  # a rate exactly at the threshold may fall either side after rounding
    assert F.flattening_step(steps, scaled) == F.flattening_step(steps, values)


def test_flattening_step_rejects_bad_input():
    with pytest.raises(InputError, match="same length, got 3 steps and 2 values"):
        F.flattening_step([0, 1, 2], [0.0, 1.0])
    with pytest.raises(InputError, match="at least 2 checkpoints, got 1"):
        F.flattening_step([0], [0.0])
    with pytest.raises(InputError, match="strictly increasing"):
        F.flattening_step([0, 2, 1], [0.0, 1.0, 2.0])
    with pytest.raises(InputError, match="`values` must be finite"):
        F.flattening_step([0, 1], [0.0, math.nan])
    with pytest.raises(InputError, match=r"`fraction` must be a finite number in \(0, 1\), got 1.5"):
        F.flattening_step([0, 1], [0.0, 1.0], fraction=1.5)


# --- eigenspectrum decay (topocallbacks.functional.spectrum) --------------------------------------------------


def power_law_cloud(alpha, n=200, d=12, seed=0):
    """A centred cloud whose covariance eigenvalues are exactly proportional to k^-alpha."""
    basis = np.random.default_rng(seed).normal(size=(n, d))
    basis -= basis.mean(axis=0)
    basis = np.linalg.qr(basis)[0]
    return basis * np.arange(1, d + 1) ** (-alpha / 2)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.5])
def test_eigenspectrum_decay_recovers_a_power_law(alpha):
    assert F.eigenspectrum_decay(power_law_cloud(alpha)) == pytest.approx(alpha, abs=1e-9)


@given(st.floats(0.0, 3.0), st.integers(0, 2**32 - 1), st.floats(0.01, 100.0))
def test_eigenspectrum_decay_invariances(alpha, seed, scale):
    cloud = power_law_cloud(alpha, n=60, d=6, seed=seed % 1000)
    rng = np.random.default_rng(seed)
    rotation = np.linalg.qr(rng.normal(size=(6, 6)))[0]
    moved = scale * cloud @ rotation + rng.normal(size=6)
    assert F.eigenspectrum_decay(moved) == pytest.approx(F.eigenspectrum_decay(cloud), abs=1e-6)


def test_eigenspectrum_decay_leaves_out_the_float32_noise_floor():
    """Features a float32 network computes in fewer directions than its width: the unused ones hold rounding noise."""
    exact = power_law_cloud(1.0, n=256, d=6) @ np.random.default_rng(1).normal(size=(6, 24))  # rank 6 in 24 dims
    rounded = exact.astype(np.float32)
    assert F.eigenspectrum_decay(rounded, rtol=0.0) > 10  # the fit runs down the noise floor's cliff
    six = np.linalg.svd(exact - exact.mean(axis=0), compute_uv=False)[:6] ** 2
    slope = np.polyfit(np.log(np.arange(1, 7)), np.log(six), 1)[0]
    assert F.eigenspectrum_decay(rounded) == pytest.approx(-slope, rel=1e-4)  # only the six real directions
    assert F.eigenspectrum_decay(exact) == pytest.approx(-slope, rel=1e-9)
    with pytest.raises(InputError, match=r"`rtol` must be a finite number in \[0, 1\), got 1.0"):
        F.eigenspectrum_decay(rounded, rtol=1.0)


def test_eigenspectrum_decay_reference_cases():
    assert F.eigenspectrum_decay(np.ones((5, 3))) == math.inf
    assert F.eigenspectrum_decay(np.outer(np.arange(6.0), [1.0, 2.0])) == math.inf  # a line: one eigenvalue
    gaussian = F.eigenspectrum_decay(np.random.default_rng(0).normal(size=(1000, 10)))
    assert 0.0 < gaussian < 0.3
    with pytest.raises(NonFiniteError):
        F.eigenspectrum_decay(np.array([[0.0, np.inf], [1.0, 2.0]]))
