"""Argument checks shared by the public functions.

Messages follow one pattern: the argument in backticks, what it must be, and what was given, e.g.
"`epsilon` must be a finite number > 0, got -1.0".
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .exceptions import InputError, NonFiniteError

__all__ = ["as_points", "check_int", "check_number", "check_positive_float", "check_seed", "check_state"]

_MAX_LISTED_ROWS = 10


def _torch_tensor_to_numpy(value: Any) -> NDArray[Any] | None:
    """Return ``value`` as a CPU float64 array if it is a torch tensor, else None.

    torch is only consulted if the caller already imported it (einops' habit): no import is triggered here.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    if value.is_complex():
        raise InputError(f"`points` must have a real numeric dtype, got torch dtype {value.dtype}")
    if value.dtype == torch.bool:
        raise InputError("`points` must have a real numeric dtype, got torch dtype torch.bool")
    # Any device, any real dtype (bfloat16 included): move and convert in torch, which knows every dtype.
    array: NDArray[Any] = value.detach().to(device="cpu", dtype=torch.float64).numpy()
    return array


def as_points(points: Any, name: str = "points", *, min_samples: int = 2) -> NDArray[np.float64]:
    """Validate a point cloud and return it as a C-contiguous float64 array of shape ``(n_samples, dim)``.

    Args:
        points: array-like or torch tensor (any device) of shape ``(n_samples, dim)``.
        name: argument name used in error messages.
        min_samples: the least number of rows the caller needs.

    Raises:
        InputError: wrong rank, too few samples, ``dim == 0``, or a non-numeric dtype.
        NonFiniteError: NaN or Inf entries; the message lists the first offending rows.
    """
    array = _torch_tensor_to_numpy(points)
    if array is None:
        try:
            array = np.asarray(points)
        except (TypeError, ValueError) as exc:  # ragged lists and the like
            raise InputError(
                f"`{name}` must be an array of shape (n_samples, dim), got {type(points).__name__}: {exc}"
            ) from exc
    if array.dtype.kind not in "iuf":
        raise InputError(f"`{name}` must have a real numeric dtype (integer or floating), got dtype {array.dtype}")
    if array.ndim != 2:
        hint = " (use points.reshape(-1, 1) for one feature)" if array.ndim == 1 else ""
        raise InputError(
            f"`{name}` must be a 2-D array of shape (n_samples, dim), got a {array.ndim}-D array of shape "
            f"{array.shape}{hint}"
        )
    n_samples, dim = array.shape
    if n_samples < min_samples:
        raise InputError(f"`{name}` must have at least {min_samples} samples (rows), got {n_samples}")
    if dim == 0:
        raise InputError(f"`{name}` must have at least 1 feature (column), got shape {array.shape}")
    result = np.ascontiguousarray(array, dtype=np.float64)
    finite = np.isfinite(result)
    if not finite.all():
        bad_rows = np.flatnonzero(~finite.all(axis=1))
        count = int((~finite).sum())
        listed = tuple(int(r) for r in bad_rows[:_MAX_LISTED_ROWS])
        more = f" and {len(bad_rows) - len(listed)} more" if len(bad_rows) > len(listed) else ""
        raise NonFiniteError(
            f"`{name}` contains {count} non-finite value(s) (NaN or Inf) in {len(bad_rows)} row(s): "
            f"{list(listed)}{more}",
            rows=listed,
            count=count,
        )
    return result


def check_positive_float(value: Any, name: str, *, allow_none: bool = False) -> float:
    """Return ``value`` as a float after checking it is a finite real number > 0."""
    if value is None and allow_none:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"`{name}` must be a finite number > 0, got {value!r} of type {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result) or result <= 0.0:
        raise InputError(f"`{name}` must be a finite number > 0, got {value!r}")
    return result


def check_number(
    value: Any,
    name: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = True,
    high_open: bool = True,
) -> float:
    """Return ``value`` as a float after checking it is a finite real number in the given interval.

    The message names the interval as written, e.g. "`lr_factor` must be a finite number in (0, 1), got 1.5".
    """
    interval = ""
    if math.isfinite(low) or math.isfinite(high):
        interval = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise InputError(f"`{name}` must be a finite number{interval}, got {value!r}")
    result = float(value)
    if (result <= low if low_open else result < low) or (result >= high if high_open else result > high):
        raise InputError(f"`{name}` must be a finite number{interval}, got {value!r}")
    return result


def check_state(state: Mapping[str, Any], keys: Iterable[str], version: int) -> None:
    """Check that a saved ``state`` has every key in ``keys`` and the expected ``version``."""
    missing = sorted(set(keys) - set(state))
    if missing:
        raise InputError(f"`state` is missing key(s) {missing}; got keys {sorted(state)}")
    if state["version"] != version:
        raise InputError(f"`state['version']` must be {version}, got {state['version']!r}")


def check_int(value: Any, name: str, *, minimum: int) -> int:
    """Return ``value`` as an int after checking it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"`{name}` must be an integer >= {minimum}, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise InputError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_seed(value: Any, name: str = "seed") -> int:
    """Return a non-negative integer seed."""
    return check_int(value, name, minimum=0)
