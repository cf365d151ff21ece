"""When to act on the watched channels: rules over their history that return a :class:`Decision`.

The policy only decides; applying a decision (warning, cutting the learning rate, rolling back, stopping, saving a
rescue checkpoint) is :func:`topocallbacks.interventions.apply`'s job, so the same policy drives Lightning, Hugging
Face and plain loops. A decision is made in three steps, each its own part:

1. *score* (:mod:`.channels`, with the pure functions of :mod:`.scores`): each channel's value becomes the score
   its threshold is compared with (:func:`score_value`; a training channel's z-score has a noise floor of
   :data:`TRAINING_NOISE_FLOOR` of its scale); the z-score's reference (:class:`Reference`) holds the recent
   checks that stayed below the threshold, so one jump does not hide the next;
2. *rule* (:mod:`.rule`): a channel holds when its threshold held for ``patience`` checks after the warm-up
   (:func:`rule_holds` for a whole series) or on a rising trend, and the rule when ``require`` channels hold;
3. *escalation* (:mod:`.escalation`): the cooldown holds back a *repeat* of the same action unless the score beats
   the one that started it, never a stronger action; ``lower_lr`` and ``rollback`` escalate once spent.

:class:`Policy` (:mod:`.policy`) wires the three and takes the short-cuts of a diverged or totally collapsed check
(an action at once, warm-up or not); :class:`Decision` (:mod:`.decision`) is what it returns. The
collapse-evidence suite (``benchmarks/collapse/``) evaluates steps 1 and 2 with the same functions
(:func:`rule_scores`, :func:`rule_holds`).
"""

from ..settings import Action
from .channels import TRAINING_NOISE_FLOOR
from .decision import Decision
from .policy import Policy
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
