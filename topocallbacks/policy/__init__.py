"""When to act on the watched index: rules over its history that return a :class:`Decision`.

The policy only decides; applying a decision (warning, cutting the learning rate, stopping, saving a rescue
checkpoint) is :func:`topocallbacks.interventions.apply`'s job, so the same policy drives Lightning, Hugging Face
and plain loops. A decision is made in three steps, each its own function
(:class:`Policy` in :mod:`.policy`, the pure scores in :mod:`.scores`, :class:`Decision` in :mod:`.decision`):

1. *score*: the index becomes the score the threshold is compared with (:func:`score_value`); the z-score's
   reference (:class:`Reference`) holds the recent checks that stayed below the threshold, so one jump does not
   hide the next;
2. *rule*: the threshold held for ``patience`` checks after the warm-up (:func:`rule_holds` for a whole series),
   or a rising trend;
3. *gate*: the cooldown holds back a *repeat* of the same action unless the score beats the one that started it,
   never a stronger action; ``lower_lr`` escalates once the learning-rate cuts are spent.

The collapse-evidence suite (``benchmarks/collapse/``) evaluates steps 1 and 2 with the same functions
(:func:`rule_scores`, :func:`rule_holds`).
"""

from ..settings import Action
from .decision import Decision
from .policy import TRAINING_NOISE_FLOOR, Policy
from .scores import Reference, rule_holds, rule_scores, score_value, trailing_zscore

__all__ = [
    "TRAINING_NOISE_FLOOR",
    "Action",
    "Decision",
    "Policy",
    "Reference",
    "rule_holds",
    "rule_scores",
    "score_value",
    "trailing_zscore",
]
