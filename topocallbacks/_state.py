"""State written declaratively once: which attributes a stateful object saves, under which keys, at which version."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ._validation import check_state

__all__ = ["StateFields", "Stateful"]


class StateFields:
    """The saved state of a class: ``{key: attribute}`` plus a version, with optional converters.

    ``save`` copies each attribute (through ``encode[key]`` when given, e.g. arrays to lists; an attribute that is
    itself `Stateful` gives its own ``state_dict()``) into a JSON-ready dict; ``load`` checks the keys and
    the version and sets each attribute back (through ``decode[key]``, or the attribute's own ``load_state_dict``).

    Examples:
        >>> class Counter:
        ...     _state = StateFields(version=1, fields={"count": "count_"})
        ...     count_ = 3
        >>> Counter._state.save(Counter())
        {'version': 1, 'count': 3}
    """

    def __init__(
        self,
        *,
        version: int,
        fields: Mapping[str, str],
        encode: Mapping[str, Callable[[Any], Any]] | None = None,
        decode: Mapping[str, Callable[[Any], Any]] | None = None,
    ) -> None:
        self.version = version
        self.fields = dict(fields)
        self.encode = dict(encode or {})
        self.decode = dict(decode or {})

    @property
    def keys(self) -> set[str]:
        """Every key of a saved state, ``version`` included."""
        return {"version", *self.fields}

    def save(self, obj: Any, only: set[str] | None = None) -> dict[str, Any]:
        """The state of ``obj`` (all keys, or ``only`` these)."""
        state: dict[str, Any] = {"version": self.version}
        for key, attribute in self.fields.items():
            if only is None or key in only:
                value = getattr(obj, attribute)
                if key in self.encode:
                    state[key] = self.encode[key](value)
                elif isinstance(value, Stateful):
                    state[key] = value.state_dict()
                else:
                    state[key] = copy.deepcopy(value)
        return state

    def load(self, obj: Any, state: Mapping[str, Any], only: set[str] | None = None) -> None:
        """Set the attributes of ``obj`` from ``state`` (all keys, or ``only`` these).

        Raises:
            InputError: missing keys or another version.
        """
        check_state(state, (self.keys if only is None else {"version", *only}), self.version)
        for key, attribute in self.fields.items():
            if only is None or key in only:
                value, current = state[key], getattr(obj, attribute, None)
                if key in self.decode:
                    setattr(obj, attribute, self.decode[key](value))
                elif isinstance(current, Stateful):
                    current.load_state_dict(value)
                else:
                    setattr(obj, attribute, copy.deepcopy(value))


class Stateful:
    """``state_dict``/``load_state_dict`` from the class's `StateFields` (its ``_state`` attribute)."""

    _state: StateFields

    def state_dict(self) -> dict[str, Any]:
        """A JSON-ready copy of the state (see the class's ``_state`` for the keys)."""
        return self._state.save(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`.

        Raises:
            InputError: missing keys or another version.
        """
        self._state.load(self, state)
