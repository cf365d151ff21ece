"""topocallbacks: see representational collapse coming, with topology, and act on it.

The core (this package outside ``integrations``) depends on numpy, scipy, GUDHI and torch only;
``import topocallbacks`` never imports lightning, transformers or tensorboard (nor torch: the monitor and the
probe, which need it, are imported on first use).

Examples:
    >>> import numpy as np
    >>> import topocallbacks.functional as TF
    >>> TF.betti_numbers(np.array([[0.0, 0.0], [0.0, 5.0]]), epsilon=1.0)
    BettiNumbers(b0=2, b1=0)
"""

from typing import TYPE_CHECKING, Any

from . import functional
from .collapse_index import CollapseIndex
from .exceptions import ConfigError, InputError, NonFiniteError, TopoCallbacksError
from .functional import BettiNumbers, CollapseReport
from .mmhm import MMHM
from .policy import Action, Decision, Policy
from .settings import MonitorSettings

if TYPE_CHECKING:
    from .analyze import analyze
    from .monitor import TopoMonitor
    from .probe import Probe
    from .report import write_report

__version__ = "0.1.0.dev0"

__all__ = [
    "MMHM",
    "Action",
    "BettiNumbers",
    "CollapseIndex",
    "CollapseReport",
    "ConfigError",
    "Decision",
    "InputError",
    "MonitorSettings",
    "NonFiniteError",
    "Policy",
    "Probe",
    "TopoCallbacksError",
    "TopoMonitor",
    "__version__",
    "analyze",
    "functional",
    "write_report",
]

# The monitor and the probe use torch, the report matplotlib; they are imported on first access so that
# `import topocallbacks` stays light.
_LAZY = {"TopoMonitor": ".monitor", "Probe": ".probe", "analyze": ".analyze", "write_report": ".report"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'topocallbacks' has no attribute {name!r}")
