import copy
import json
import pickle

import numpy as np
import pytest

from topocallbacks import CollapseIndex, CollapseReport, ConfigError, InputError, NonFiniteError
from topocallbacks import functional as F


def clustered(n=300, dim=16, clusters=6, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=4.0, size=(clusters, dim))
    return centres[rng.integers(0, clusters, n)] + rng.normal(size=(n, dim))


def test_report_components_are_the_documented_formulas():
    features = clustered()
    report = F.collapse_index(features, epsilon=3.0, max_points=128)
    b0, b1 = F.betti_numbers(features, 3.0)
    assert (report.betti0, report.betti1) == (b0, b1)
    assert report.betti_term == pytest.approx(1 - min(max(b1 / b0, 0), 1))
    assert report.anisotropy_term == pytest.approx(F.anisotropy(features))
    assert report.entropy_term == pytest.approx(1 - report.persistence_entropy)
    expected = 0.4 * report.betti_term + 0.3 * report.entropy_term + 0.3 * report.anisotropy_term
    assert report.ci == pytest.approx(expected)
    assert (report.n_samples, report.n_features, report.n_diagram_points) == (300, 16, 128)
    assert report.epsilon == 3.0
    assert set(report.timings_ms) == {"betti", "persistence", "anisotropy", "total"}
    assert all(value >= 0 for value in report.timings_ms.values())
    assert report.timings_ms["total"] >= report.timings_ms["betti"]


def test_entropy_comes_from_the_finite_bars_of_the_mst_thresholded_subsample():
    features = clustered(n=200)
    report = F.collapse_index(features, epsilon=3.0, max_points=120, seed=4)
    sample = features[np.sort(np.random.default_rng(4).choice(200, size=120, replace=False))]
    h0, h1 = F.persistence_diagrams(sample, threshold=F.longest_mst_edge(sample))
    assert np.isfinite(h0[:, 1]).sum() == 119  # every merge happens below the threshold
    assert report.persistence_entropy == pytest.approx(F.persistence_entropy(np.vstack([h0, h1])))


def test_default_epsilon_gives_every_point_eight_neighbours_on_average():
    features = clustered(n=100)
    distances = np.linalg.norm(features[:, None] - features[None], axis=-1)[np.triu_indices(100, 1)]
    epsilon = F.epsilon_heuristic(features)
    assert epsilon == pytest.approx(np.quantile(distances, 8 / 99))
    assert 2 * np.sum(distances <= epsilon) / 100 == pytest.approx(8.0, abs=0.1)  # the mean degree
    assert F.collapse_index(features).epsilon == pytest.approx(epsilon)
    assert F.epsilon_heuristic(features, degree=20) == pytest.approx(np.quantile(distances, 20 / 99))
    # A fixed quantile replaces the degree: the paper's heuristic is 0.5 x the median.
    assert F.epsilon_heuristic(features, quantile=0.5, factor=0.5) == pytest.approx(0.5 * np.median(distances))
    assert F.epsilon_heuristic(features, quantile=0.1, factor=2.0) == pytest.approx(2.0 * np.quantile(distances, 0.1))


@pytest.mark.parametrize("dim", [2, 8, 64, 384])
def test_the_default_epsilon_is_informative_in_any_dimension(dim):
    # Neither every point isolated nor one blob, whatever the dimension (the median heuristic isolated every point of
    # a 384-d cloud and joined a 2-d one into one component).
    cloud = np.random.default_rng(dim).normal(size=(256, dim))
    b0, _ = F.betti_numbers(cloud, F.epsilon_heuristic(cloud))
    assert 0.02 * 256 < b0 < 0.5 * 256


def test_epsilon_heuristic_degenerate_clouds():
    # Most points coincide: the quantile is 0, the smallest positive distance is used.
    cloud = np.vstack([np.zeros((20, 2)), [[3.0, 4.0]]])
    assert F.epsilon_heuristic(cloud) == pytest.approx(5.0)
    assert F.epsilon_heuristic(cloud, quantile=0.5, factor=0.5) == pytest.approx(2.5)
    with pytest.warns(RuntimeWarning, match="all points are identical"):
        assert F.epsilon_heuristic(np.ones((5, 3))) == 1.0


def test_full_collapse_gives_one_in_every_component():
    report = F.collapse_index(np.full((64, 8), 0.25), epsilon=0.5)
    assert report.ci == 1.0
    assert report.components == {"betti": 1.0, "entropy": 1.0, "anisotropy": 1.0}
    assert (report.betti0, report.betti1) == (1, 0)


def test_isotropic_gaussian_documented_value():
    cloud = np.random.default_rng(0).normal(size=(512, 32))
    report = F.collapse_index(cloud)
    assert report.ci == pytest.approx(0.04, abs=0.03)
    assert report.betti_term == 0.0  # saturated at the other end: loops outnumber components at mean degree 8
    assert report.anisotropy_term < 0.1
    paper = F.collapse_index(cloud, epsilon=F.epsilon_heuristic(cloud, quantile=0.5, factor=0.5))
    assert paper.ci == pytest.approx(0.43, abs=0.03)
    assert paper.betti_term == 1.0  # the saturation the docs warn about, at the paper's ε


def test_collapse_raises_the_index_relative_to_healthy_features():
    features = clustered(dim=32)
    index = CollapseIndex(seed=0)
    healthy = index(features)
    collapsed = index(features * np.exp(-np.arange(32)))  # all variance squeezed onto a few directions
    assert collapsed.ci > healthy.ci
    assert collapsed.anisotropy_term > healthy.anisotropy_term


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        (None, {"betti": 0.4, "entropy": 0.3, "anisotropy": 0.3}),
        ("paper", {"betti": 0.4, "entropy": 0.3, "anisotropy": 0.3}),
        ({"entropy": 2.0, "anisotropy": 2.0}, {"betti": 0.0, "entropy": 0.5, "anisotropy": 0.5}),
    ],
)
def test_weights_are_resolved_and_normalised(weights, expected):
    assert F.resolve_weights(weights) == pytest.approx(expected)
    report = F.collapse_index(clustered(n=80), weights=weights)
    assert dict(report.weights) == pytest.approx(expected)
    assert report.ci == pytest.approx(sum(expected[k] * v for k, v in report.components.items()))


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ("uniform", r'`weights` must be "paper", None or a mapping of component weights, got \'uniform\''),
        ([0.4, 0.3, 0.3], "`weights` must be a mapping of component weights, got list"),
        (
            {"betti": 1.0, "rank": 1.0},
            r"unknown component\(s\) \['rank'\]; valid components: "
            r"\['anisotropy', 'betti', 'entropy'\]",
        ),
        ({"betti": -0.1}, r"`weights\['betti'\]` must be a finite number >= 0, got -0.1"),
        ({"betti": float("nan")}, r"`weights\['betti'\]` must be a finite number >= 0, got nan"),
        ({"betti": 0, "entropy": 0.0}, "`weights` must have at least one weight > 0"),
    ],
)
def test_bad_weights_are_named(weights, match):
    with pytest.raises(InputError, match=match):
        F.collapse_index(clustered(n=20), weights=weights)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": -1.0}, r"`epsilon` must be a finite number > 0, got -1.0"),
        ({"epsilon": float("nan")}, r"`epsilon` must be a finite number > 0, got nan"),
        ({"max_points": 1}, r"`max_points` must be an integer >= 2, got 1"),
        ({"seed": 1.5}, r"`seed` must be an integer >= 0, got 1.5"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(InputError, match=match):
        F.collapse_index(clustered(n=20), **kwargs)


def test_non_finite_features_raise_the_divergence_error():
    features = clustered(n=20)
    features[7, 3] = np.inf
    with pytest.raises(NonFiniteError, match=r"`features` contains 1 non-finite value.*\[7\]"):
        F.collapse_index(features)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quantile": 0.0}, r"`quantile` must be a finite number in \(0, 1\], got 0.0"),
        ({"quantile": 1.5}, r"`quantile` must be a finite number in \(0, 1\], got 1.5"),
        ({"factor": -2}, "`factor` must be a finite number > 0, got -2"),
    ],
)
def test_epsilon_heuristic_rejects_bad_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        F.epsilon_heuristic(clustered(n=10), **kwargs)


def test_betti_and_entropy_term_ranges():
    assert F.betti_term(3, 0) == 1.0
    assert F.betti_term(2, 1) == 0.5
    assert F.betti_term(1, 5) == 0.0
    with pytest.raises(InputError, match="`b0` must be >= 1"):
        F.betti_term(0, 0)
    with pytest.raises(InputError, match="`b1` must be >= 0, got -1"):
        F.betti_term(1, -1)
    with pytest.raises(InputError, match=r"`normalized_entropy` must be in \[0, 1\], got 1.5"):
        F.entropy_term(1.5)


def test_report_is_json_ready_and_frozen():
    report = F.collapse_index(clustered(n=60))
    assert json.loads(json.dumps(report.as_dict()))["ci"] == report.ci
    with pytest.raises(AttributeError):
        report.ci = 0.0  # type: ignore[misc]
    assert isinstance(pickle.loads(pickle.dumps(report)), CollapseReport)


def test_longest_mst_edge():
    assert F.longest_mst_edge([[0.0], [1.0], [5.0], [5.5]]) == pytest.approx(4.0)
    assert F.longest_mst_edge(np.ones((4, 2))) is None
    # Coincident points do not hide the true longest edge.
    assert F.longest_mst_edge([[0.0], [0.0], [2.0], [2.0]]) == pytest.approx(2.0)


# --- the stateful class ------------------------------------------------------------------------------------


def test_collapse_index_calibrates_once_and_keeps_epsilon():
    features = clustered(n=150)
    index = CollapseIndex(seed=0)
    assert not index.is_calibrated
    first = index(features)
    assert index.epsilon_ == pytest.approx(F.epsilon_heuristic(features))
    second = index(features * 0.1)  # a shrunken cloud is judged at the same ε
    assert second.epsilon == first.epsilon
    assert second.betti0 <= first.betti0
    index.reset()
    assert index.epsilon_ is None


def test_collapse_index_with_a_fixed_epsilon_never_calibrates():
    index = CollapseIndex(epsilon=2.0)
    assert index.epsilon_ == 2.0
    index.calibrate(clustered(n=50))
    assert index(clustered(n=50)).epsilon == 2.0
    index.reset()
    assert index.epsilon_ == 2.0


def test_collapse_index_state_round_trip_and_pickle():
    index = CollapseIndex(weights={"entropy": 1.0, "anisotropy": 1.0}, max_points=64, seed=3)
    index(clustered(n=90))
    state = json.loads(json.dumps(index.state_dict()))
    restored = CollapseIndex(weights={"entropy": 1.0, "anisotropy": 1.0}, max_points=64, seed=3)
    restored.load_state_dict(state)
    assert restored == index
    assert restored.state_dict() == index.state_dict()
    assert pickle.loads(pickle.dumps(index)) == index
    assert copy.deepcopy(index) == index
    later = clustered(n=90, seed=9)
    assert restored(later).ci == index(later).ci


def test_collapse_index_load_state_errors():
    index = CollapseIndex()
    with pytest.raises(InputError, match=r"`state` is missing key\(s\) \['epsilon_', 'weights_'\]"):
        index.load_state_dict({"version": 2})
    with pytest.raises(InputError, match=r"`state\['version'\]` must be 2, got 7"):
        index.load_state_dict({"version": 7, "epsilon_": 1.0, "weights_": "paper"})
    with pytest.raises(InputError, match=r"`state\['epsilon_'\]` must be None or a finite number > 0, got -1"):
        index.load_state_dict({"version": 2, "epsilon_": -1, "weights_": "paper"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0}, "`epsilon` must be a finite number > 0, got 0"),
        ({"epsilon_quantile": 2.0}, r"`epsilon_quantile` must be a finite number in \(0, 1\], got 2.0"),
        ({"epsilon_factor": float("inf")}, "`epsilon_factor` must be a finite number > 0, got inf"),
        ({"weights": {"loops": 1.0}}, "unknown component"),
        ({"max_points": 0}, "`max_points` must be an integer >= 2, got 0"),
        ({"seed": -1}, "`seed` must be an integer >= 0, got -1"),
    ],
)
def test_collapse_index_validates_in_init(kwargs, match):
    with pytest.raises(InputError, match=match):
        CollapseIndex(**kwargs)


def test_collapse_index_repr_echoes_the_settings():
    assert repr(CollapseIndex(epsilon=1.5, seed=2)) == (
        "CollapseIndex(IndexSettings(name='diagram_drift', epsilon=1.5, epsilon_degree=8.0, epsilon_quantile=None, "
        "epsilon_factor=1.0, weights='paper', max_points=256), seed=2)"
    )
    with pytest.raises(ConfigError, match="unknown argument `epsilon_quantil`; did you mean `epsilon_quantile`"):
        CollapseIndex(epsilon_quantil=0.4)
