"""The rule the library used before issue 22, for the tests of the rule's mechanics.

Issue 22 made the rescue suite's rule the default (index and loss channels, both required, rollback with a
compounding cut of 0.5 and a skip, at most 4 rollbacks). The tests of the z-score rule, the cooldown, the escalation,
the rollback, the skip and the compounding cuts were written against the earlier defaults; they name that rule here
so that they keep testing exactly the same mechanics and values.
"""

from __future__ import annotations

from typing import Any

from topocallbacks.policy import Policy
from topocallbacks.settings import PolicySettings

#: The :class:`PolicySettings` defaults before issue 22 that it changed (the sentinels did not exist; they stay on:
#: they act only where a check's features are totally collapsed).
OLD_RULE: dict[str, Any] = {
    "channels": ("index",),
    "require": 1,
    "action": "warn",
    "on_diverged": "stop",
    "rollback_lr_factor": None,
    "rollback_skip": 0,
    "max_rollbacks": 2,
    "rollback_order": "skip_and_cut",  # the order before issue 35's pre-registered choice (every rollback cuts)
}


def old_rule(**overrides: Any) -> dict[str, Any]:
    """The old rule with ``overrides``, as the mapping ``TopoMonitor(policy=...)`` takes."""
    return {**OLD_RULE, **overrides}


def old_settings(**overrides: Any) -> PolicySettings:
    """The old rule with ``overrides``, as settings."""
    return PolicySettings(**old_rule(**overrides))


def old_policy(**overrides: Any) -> Policy:
    """A :class:`Policy` of the old rule with ``overrides``."""
    return Policy(old_settings(**overrides))
