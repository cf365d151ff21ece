import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import point_clouds, rotations
from topocallbacks import functional as F
from topocallbacks.exceptions import InputError, NonFiniteError
from topocallbacks.functional.geometry import _singular_values

GEOMETRY = [F.anisotropy, F.effective_rank, F.participation_ratio]


def rankme_reference(features, eps=1e-7):
    """RankMe exactly as Garrido et al. (2023) write it: p_k = sigma_k / ||sigma||_1 + eps."""
    sigma = np.linalg.svd(features, compute_uv=False)
    p = sigma / np.abs(sigma).sum() + eps
    return float(np.exp(-np.sum(p * np.log(p))))


def covariance_eigenvalues(features):
    return np.clip(np.linalg.eigvalsh(np.cov(features, rowvar=False).reshape(features.shape[1], -1)), 0, None)


@pytest.mark.parametrize("seed", range(5))
def test_effective_rank_matches_rankme_formula(seed):
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(200, 16)) * rng.uniform(0.1, 3.0, size=16)
    assert F.effective_rank(features) == pytest.approx(rankme_reference(features), rel=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_participation_ratio_matches_covariance_eigenvalues(seed):
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(300, 12)) @ rng.normal(size=(12, 12))
    eigen = covariance_eigenvalues(features)
    assert F.participation_ratio(features) == pytest.approx(eigen.sum() ** 2 / np.sum(eigen**2), rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_anisotropy_matches_its_formula(seed):
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(300, 12)) @ rng.normal(size=(12, 12))
    p = covariance_eigenvalues(features) / covariance_eigenvalues(features).sum()
    effective = np.exp(-np.sum(p * np.log(p)))
    assert F.anisotropy(features) == pytest.approx((12 - effective) / 11, rel=1e-9)


def anisotropy_by_svd(cloud):
    """The anisotropy as it was computed until the eigenvalue route: the centred cloud's squared singular values."""
    rank_cap = min(cloud.shape[0] - 1, cloud.shape[1])
    values = _singular_values(np.asarray(cloud, dtype=np.float64), center=True)
    if values.size == 0:
        return 1.0
    if rank_cap == 1:
        return 0.0
    p = values**2 / np.sum(values**2)
    return float(np.clip((rank_cap - np.exp(-np.sum(p * np.log(p)))) / (rank_cap - 1), 0.0, 1.0))


def structured_clouds():
    rng = np.random.default_rng(7)
    healthy = rng.normal(size=(512, 64)) * rng.uniform(0.05, 1.0, 64)
    centres = healthy[np.arange(512) % 4]
    yield healthy
    yield centres + 1e-3 * (healthy - centres)  # the benchmark's collapsed cloud: 4 cores a thousand times tighter
    yield np.repeat(healthy[:8], 64, axis=0)  # duplicates
    yield healthy[:, :1] @ rng.normal(size=(1, 64)) + 1e-9 * healthy  # nearly a line
    yield healthy @ rng.normal(size=(64, 5)) @ rng.normal(size=(5, 64))  # rank 5 of 64
    yield healthy[:20]  # fewer points than dimensions
    yield healthy + 1e8  # far from the origin
    yield healthy * 1e-300


@given(point_clouds(min_points=2, max_points=40, max_dim=8))
def test_anisotropy_from_the_covariance_eigenvalues_equals_the_svd_of_the_cloud(cloud):
    # The eigenvalues of the Gram matrix differ from the squared singular values in the last bits (about 1e-13 on
    # real features), and the two null cutoffs differ below about 1e-13 x the largest eigenvalue.
    assert F.anisotropy(cloud) == pytest.approx(anisotropy_by_svd(cloud), abs=1e-9)


def test_anisotropy_of_structured_clouds_equals_the_svd_of_the_cloud():
    for cloud in structured_clouds():
        assert F.anisotropy(cloud) == pytest.approx(anisotropy_by_svd(cloud), abs=1e-9)


def test_isotropic_gaussian_values():
    features = np.random.default_rng(0).normal(size=(1000, 10))
    assert F.anisotropy(features) == pytest.approx(0.007, abs=0.005)
    assert F.effective_rank(features) == pytest.approx(10.0, abs=0.05)
    assert F.participation_ratio(features) == pytest.approx(9.9, abs=0.15)


def test_full_collapse_values():
    collapsed = np.tile([[0.3, -2.0, 5.0]], (40, 1))
    assert F.anisotropy(collapsed) == 1.0
    assert F.effective_rank(collapsed) == pytest.approx(1.0)
    assert F.effective_rank(collapsed, center=True) == 0.0
    assert F.participation_ratio(collapsed) == 0.0
    assert F.effective_rank(np.zeros((5, 3))) == 0.0


def test_dimensional_collapse_drives_anisotropy_up_and_rank_down():
    rng = np.random.default_rng(1)
    base = rng.normal(size=(500, 32))
    anisotropies, ranks = [], []
    for strength in (0.0, 0.05, 0.2, 1.0):
        shrunk = base * np.exp(-strength * np.arange(32))
        anisotropies.append(F.anisotropy(shrunk))
        ranks.append(F.effective_rank(shrunk))
    assert anisotropies == sorted(anisotropies)
    assert anisotropies[-1] > 0.95
    # RankMe weighs singular values (not their squares): sigma_k ~ e^-k gives exp(H) of about 2.9.
    assert ranks == sorted(ranks, reverse=True)
    assert ranks[-1] < 3.0


def test_cloud_far_from_the_origin_keeps_its_shape():
    features = np.random.default_rng(2).normal(size=(200, 6))
    assert F.anisotropy(features + 1e8) == pytest.approx(F.anisotropy(features), abs=1e-6)
    assert F.participation_ratio(np.tile([[1e8, -3.0]], (9, 1))) == 0.0


def test_line_is_fully_anisotropic_and_rank_one():
    line = np.outer(np.linspace(-1, 1, 50), np.arange(1.0, 6.0))
    assert F.anisotropy(line) == pytest.approx(1.0)
    assert F.participation_ratio(line) == pytest.approx(1.0)


@pytest.mark.parametrize("function", GEOMETRY)
def test_finite_when_fewer_samples_than_dimensions(function):
    features = np.random.default_rng(0).normal(size=(5, 300))
    value = function(features)
    assert np.isfinite(value)
    if function is F.anisotropy:
        assert 0.0 <= value <= 1.0


def test_anisotropy_uses_the_rank_a_sample_can_reach():
    # 4 points in 300-D span 3 directions; a regular tetrahedron fills them evenly.
    tetrahedron = np.zeros((4, 300))
    tetrahedron[:, :4] = np.eye(4)
    assert F.anisotropy(tetrahedron) == pytest.approx(0.0, abs=1e-12)
    # Two distinct points: one direction is all a sample of two can have.
    assert F.anisotropy(np.array([[0.0, 0.0], [1.0, 1.0]])) == 0.0


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1.0, 1e150, 1e300])
@pytest.mark.parametrize("function", GEOMETRY)
def test_scale_invariant_and_finite_for_huge_and_tiny_values(function, scale):
    features = np.random.default_rng(3).normal(size=(60, 8))
    assert function(features * scale) == pytest.approx(function(features), rel=1e-9)


@given(point_clouds(min_points=3, max_points=30, max_dim=6), st.data())
def test_rotation_invariance_and_ranges(cloud, data):
    rotation = data.draw(rotations(cloud.shape[1]))
    rotated = cloud @ rotation.T
    a = F.anisotropy(cloud)
    assert 0.0 <= a <= 1.0
    # Rounding can move a singular value across the null cutoff: compare with a tolerance.
    assert F.anisotropy(rotated) == pytest.approx(a, abs=1e-6)
    rank_cap = min(cloud.shape[0] - 1, cloud.shape[1])
    pr = F.participation_ratio(cloud)
    assert pr == 0.0 or 1.0 - 1e-9 <= pr <= rank_cap + 1e-9
    rank = F.effective_rank(cloud)
    assert rank == 0.0 or 1.0 - 1e-9 <= rank <= min(cloud.shape) + 1e-9


def test_accepts_torch_tensors_of_any_dtype():
    torch = pytest.importorskip("torch")
    features = np.random.default_rng(0).normal(size=(64, 8))
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        tensor = torch.tensor(features).to(dtype)
        expected = F.anisotropy(tensor.to(torch.float64).numpy())
        assert F.anisotropy(tensor) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("function", GEOMETRY)
def test_geometry_rejects_bad_input_with_the_argument_name(function):
    with pytest.raises(InputError, match="`features` must be a 2-D array"):
        function(np.ones(5))
    with pytest.raises(InputError, match="`features` must have at least 2 samples"):
        function(np.ones((1, 5)))
    with pytest.raises(NonFiniteError, match="`features` contains 1 non-finite value"):
        function(np.array([[1.0, np.nan], [0.0, 1.0]]))
