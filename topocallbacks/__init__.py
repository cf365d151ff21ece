"""topocallbacks: see representational collapse coming, with topology, and act on it.

The core (this package outside ``integrations``) depends on numpy, scipy, GUDHI and torch only;
``import topocallbacks`` never imports lightning, transformers or tensorboard.

Example:
    >>> import numpy as np
    >>> import topocallbacks.functional as TF
    >>> TF.betti_numbers(np.array([[0.0, 0.0], [0.0, 5.0]]), epsilon=1.0)
    BettiNumbers(b0=2, b1=0)
"""

from . import functional
from .collapse_index import CollapseIndex
from .exceptions import ConfigError, InputError, NonFiniteError, TopoCallbacksError
from .functional import BettiNumbers, CollapseReport
from .mmhm import MMHM

__version__ = "0.1.0.dev0"

__all__ = [
    "MMHM",
    "BettiNumbers",
    "CollapseIndex",
    "CollapseReport",
    "ConfigError",
    "InputError",
    "NonFiniteError",
    "TopoCallbacksError",
    "__version__",
    "functional",
]
