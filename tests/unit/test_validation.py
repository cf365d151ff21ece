import math

import numpy as np
import pytest

from topocallbacks import ConfigError, InputError, NonFiniteError, TopoCallbacksError
from topocallbacks import functional as F


@pytest.mark.parametrize(
    ("points", "match"),
    [
        (
            np.ones(5),
            r"`points` must be a 2-D array of shape \(n_samples, dim\), got a 1-D array of shape \(5,\) "
            r"\(use points.reshape\(-1, 1\) for one feature\)",
        ),
        (np.ones((2, 3, 4)), r"got a 3-D array of shape \(2, 3, 4\)"),
        (np.float64(3.0), r"got a 0-D array"),
        (np.ones((1, 3)), r"`points` must have at least 2 samples \(rows\), got 1"),
        (np.ones((0, 3)), r"`points` must have at least 2 samples \(rows\), got 0"),
        ([], r"got a 1-D array of shape \(0,\)"),
        (np.ones((4, 0)), r"`points` must have at least 1 feature \(column\), got shape \(4, 0\)"),
        (np.array([["a", "b"], ["c", "d"]]), r"real numeric dtype \(integer or floating\), got dtype <U1"),
        (np.ones((3, 2), dtype=complex), r"got dtype complex128"),
        (np.ones((3, 2), dtype=bool), r"got dtype bool"),
        ([[1.0, 2.0], [3.0]], r"`points` must be an array of shape \(n_samples, dim\), got list"),
        ({"a": 1}, r"got dtype object"),
    ],
)
def test_bad_point_clouds_name_the_argument_and_the_value(points, match):
    with pytest.raises(InputError, match=match):
        F.betti_numbers(points, 1.0)


def test_non_finite_rows_are_listed_and_truncated():
    cloud = np.zeros((30, 2))
    cloud[::2, 0] = np.inf
    with pytest.raises(NonFiniteError, match=r"15 row\(s\): \[0, 2, 4, 6, 8, 10, 12, 14, 16, 18\] and 5 more") as err:
        F.betti_numbers(cloud, 1.0)
    assert err.value.count == 15


def test_torch_inputs_that_cannot_be_points():
    torch = pytest.importorskip("torch")
    with pytest.raises(InputError, match=r"real numeric dtype, got torch dtype torch\.complex64"):
        F.betti_numbers(torch.ones(3, 2, dtype=torch.complex64), 1.0)
    with pytest.raises(InputError, match=r"got torch dtype torch\.bool"):
        F.betti_numbers(torch.ones(3, 2, dtype=torch.bool), 1.0)
    with pytest.raises(NonFiniteError, match=r"row\(s\): \[1\]"):
        F.anisotropy(torch.tensor([[0.0, 1.0], [math.nan, 0.0], [1.0, 1.0]]))


def test_exception_hierarchy():
    for error in (InputError, NonFiniteError, ConfigError):
        assert issubclass(error, TopoCallbacksError)
        assert issubclass(error, ValueError)
    assert issubclass(NonFiniteError, InputError)


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (1.0, {"low": 0.0, "high": 1.0}, "`x` must be a finite number in (0, 1), got 1.0"),
        (0.0, {"low": 0.0, "high": 1.0, "high_open": False}, "`x` must be a finite number in (0, 1], got 0.0"),
        (-1, {"low": 0.0, "low_open": False}, "`x` must be a finite number in [0, inf), got -1"),
        (math.nan, {}, "`x` must be a finite number, got nan"),
        (True, {}, "`x` must be a finite number, got True"),
        ("0.5", {"low": 0.0, "high": 1.0}, "`x` must be a finite number in (0, 1), got '0.5'"),
    ],
)
def test_check_number_names_the_interval(value, kwargs, message):
    from topocallbacks._validation import check_number

    with pytest.raises(InputError) as err:
        check_number(value, "x", **kwargs)
    assert str(err.value) == message


def test_check_number_accepts_the_closed_end_and_returns_a_float():
    from topocallbacks._validation import check_number

    assert check_number(1, "x", low=0.0, high=1.0, high_open=False) == 1.0
    assert isinstance(check_number(np.float32(0.5), "x"), float)


def test_check_state():
    from topocallbacks._validation import check_state

    check_state({"version": 2, "a": 1}, {"version", "a"}, 2)
    with pytest.raises(InputError, match=r"`state` is missing key\(s\) \['b'\]; got keys \['a', 'version'\]"):
        check_state({"version": 2, "a": 1}, {"version", "a", "b"}, 2)
    with pytest.raises(InputError, match=r"`state\['version'\]` must be 2, got 3"):
        check_state({"version": 3, "a": 1}, {"version", "a"}, 2)
