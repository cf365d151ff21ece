"""When to act on the watched channels: rules over their history that return a [`Decision`][topocallbacks.Decision].

The policy only decides; applying a decision (warning, cutting the learning rate, rolling back, stopping, saving a
rescue checkpoint) is the rescuer's job ([`Rescuer`][topocallbacks.rescue.Rescuer]), so the same
policy drives Lightning, Hugging Face and plain loops. A decision is made in three steps, each its own part:

1. *score* (`channels`, with the pure functions of `scores`): each channel's value becomes the score
   its threshold is compared with (`score_value`; a training channel's z-score has a noise floor of
   `TRAINING_NOISE_FLOOR` of its scale); the z-score's reference (`Reference`) holds the recent
   checks that stayed below the threshold, so one jump does not hide the next;
2. *rule* (`rule`): a channel holds when its threshold held for ``patience`` checks after the warm-up
   (`rule_holds` for a whole series) or on a rising trend, and the rule when ``require`` channels hold;
3. *escalation* (`escalation`): the cooldown holds back a *repeat* of the same action unless the score beats
   the one that started it, never a stronger action; ``lower_lr`` and ``rollback`` escalate once spent.

`Policy` (`policy`) wires the three and takes the short-cuts of a diverged or totally collapsed check
(an action at once, warm-up or not); [`Decision`][topocallbacks.Decision] (`decision`) is what it returns. The
collapse-evidence suite (``benchmarks/collapse/``) evaluates steps 1 and 2 with the same functions
(`rule_scores`, `rule_holds`).
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
