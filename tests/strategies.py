"""Hypothesis strategies for point clouds and persistence diagrams, shared by the test modules."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.spatial.distance import pdist

finite_coordinates = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def point_clouds(draw, min_points=2, max_points=24, min_dim=1, max_dim=4):
    """A small cloud, sometimes with duplicated rows and clustered structure."""
    n = draw(st.integers(min_points, max_points))
    dim = draw(st.integers(min_dim, max_dim))
    cloud = draw(hnp.arrays(np.float64, (n, dim), elements=finite_coordinates))
    if n > 2 and draw(st.booleans()):
        # Duplicate a few rows: identical points must merge at any ε.
        k = draw(st.integers(1, n // 2))
        cloud[:k] = cloud[n - k :]
    return cloud


@st.composite
def looped_clouds(draw, min_points=2, max_points=24, min_dim=1, max_dim=4):
    """Noisy circles (one or two) in random planes, plus clutter: clouds with loops at some scales."""
    dim = draw(st.integers(max(min_dim, 2), max(max_dim, 2)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    budget = draw(st.integers(max(min_points, 6), max(max_points, 6)))
    n_loops = draw(st.integers(1, 2)) if budget >= 12 else 1
    parts = []
    for _ in range(n_loops):
        m = budget // n_loops
        angles = np.sort(rng.uniform(0, 2 * np.pi, m)) if draw(st.booleans()) else 2 * np.pi * np.arange(m) / m
        plane = np.linalg.qr(rng.normal(size=(dim, 2)))[0]
        radius = draw(st.floats(0.5, 5.0))
        loop = radius * np.stack([np.cos(angles), np.sin(angles)], axis=1) @ plane.T
        parts.append(loop + rng.normal(scale=draw(st.floats(0.0, 0.2)), size=loop.shape) + rng.uniform(-6, 6, dim))
    clutter = budget - sum(len(p) for p in parts)
    if clutter:
        parts.append(rng.uniform(-6, 6, size=(clutter, dim)))
    return np.vstack(parts)


@st.composite
def clouds_with_epsilon(draw, **kwargs):
    """A cloud (uniform or looped) and an ε drawn between its pairwise-distance quantiles."""
    looped = draw(st.booleans())
    cloud = draw(looped_clouds(**kwargs) if looped else point_clouds(**kwargs))
    distances = pdist(cloud)
    positive = distances[distances > 0]
    if positive.size == 0:
        return cloud, draw(st.floats(0.1, 5.0))
    # Loops live at small scales: between the gaps along a loop and a third of its circumference.
    quantile = draw(st.floats(0.0, 0.25) if looped else st.floats(0.0, 1.0))
    stretch = draw(st.floats(0.9, 1.1))
    return cloud, float(np.quantile(positive, quantile)) * stretch


def margin(cloud, epsilon):
    """Relative gap between ε and the nearest pairwise distance (how far from a borderline decision)."""
    distances = pdist(cloud)
    if distances.size == 0:
        return np.inf
    return float(np.min(np.abs(distances - epsilon)) / epsilon)


@st.composite
def diagrams(draw, max_bars=30, allow_infinite=True):
    """A persistence diagram: (birth, death) rows with death >= birth, deaths possibly infinite."""
    n = draw(st.integers(0, max_bars))
    births = draw(hnp.arrays(np.float64, n, elements=st.floats(0.0, 10.0, allow_subnormal=False)))
    lengths = draw(hnp.arrays(np.float64, n, elements=st.floats(0.0, 10.0, allow_subnormal=False)))
    deaths = births + lengths
    if allow_infinite and n:
        infinite = draw(hnp.arrays(np.bool_, n, elements=st.booleans()))
        deaths = np.where(infinite, np.inf, deaths)
    return np.stack([births, deaths], axis=1)


@st.composite
def rotations(draw, dim):
    """A random orthogonal matrix (rotation or reflection) of size ``dim``."""
    seed = draw(st.integers(0, 2**32 - 1))
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(dim, dim)))
    return q * np.sign(np.diag(r))
