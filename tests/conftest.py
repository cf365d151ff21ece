import os

import pytest

# Tiny models on two cores are ~10x slower with torch's default threading; set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import HealthCheck, settings

# Derandomized: CI runs the same examples every time; a failure found once is found again.
settings.register_profile(
    "default",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=["numba", "numpy"])
def kernels(request, monkeypatch):
    """Both implementations of a compiled kernel: numba's (when installed) and numpy's (``TOPOCALLBACKS_NUMBA``)."""
    if request.param == "numba":
        pytest.importorskip("numba")
    monkeypatch.setenv("TOPOCALLBACKS_NUMBA", "1" if request.param == "numba" else "0")
    return request.param
