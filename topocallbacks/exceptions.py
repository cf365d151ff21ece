"""Exceptions raised by topocallbacks.

Every exception derives from `TopoCallbacksError` *and* from the built-in it refines, so callers can catch
either ``topocallbacks.TopoCallbacksError`` or the familiar ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "InputError",
    "NonFiniteError",
    "SnapshotUnsupported",
    "TopoCallbacksError",
]


class TopoCallbacksError(Exception):
    """Base class of every error raised on purpose by topocallbacks."""


class InputError(TopoCallbacksError, ValueError):
    """An argument has the wrong shape, dtype or value; the message names the argument and the value."""


class NonFiniteError(InputError):
    """Features contain NaN or Inf.

    The pure functions raise it; the training callbacks turn it into a logged "diverged" check instead.

    Attributes:
        rows: indices of the first offending rows (at most 10).
        count: total number of non-finite entries.
    """

    def __init__(self, message: str, *, rows: tuple[int, ...] = (), count: int = 0) -> None:
        super().__init__(message)
        self.rows = rows
        self.count = count

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only attributes must survive pickling (ddp_spawn pickles exceptions raised in workers).
        return (_rebuild_non_finite, (self.args[0], self.rows, self.count))


def _rebuild_non_finite(message: str, rows: tuple[int, ...], count: int) -> NonFiniteError:
    return NonFiniteError(message, rows=rows, count=count)


class SnapshotUnsupported(InputError):
    """The training state cannot be kept for a rollback here (sharded parameters, or too big for host memory).

    The monitor does not stop training for it: it warns once, keeps no snapshots, and a rollback decision becomes a
    warning whose reason says why.
    """


class ConfigError(InputError):
    """A configuration key is unknown, or a value read from a preset file is invalid (an `InputError`)."""
