import json
import math
import pickle

import numpy as np
import pytest

from topocallbacks import ConfigError, InputError
from topocallbacks.policy import Action, Decision, Policy, rule_holds, rule_scores, trailing_zscore
from topocallbacks.settings import PolicySettings


def run(policy, values, start=0):
    return [policy.decide(step, value) for step, value in enumerate(values, start=start)]


def actions(decisions):
    return [d.action.value for d in decisions]


def test_threshold_needs_patience_consecutive_checks_after_warmup():
    policy = Policy(action="stop", score="value", threshold=0.7, patience=3, warmup=2, cooldown=0)
    decisions = run(policy, [0.9, 0.9, 0.8, 0.8, 0.6, 0.8, 0.8, 0.8])
    assert actions(decisions) == ["none"] * 7 + ["stop"]
    assert decisions[0].reason == "warm-up check 1 of 2"
    assert decisions[-1].rule == "threshold"
    assert "for 3 consecutive checks" in decisions[-1].reason
    assert decisions[-1].step == 7


def test_cooldown_blocks_and_patience_restarts_after_an_action():
    policy = Policy(action="warn", score="value", threshold=0.5, patience=2, warmup=0, cooldown=3)
    decisions = run(policy, [0.9] * 9)
    # Fires at check 2; checks 3-5 are in cooldown; patience counts again from check 3, so check 6 fires.
    assert actions(decisions) == ["none", "warn", "none", "none", "none", "warn", "none", "none", "none"]
    assert decisions[2].reason == "index 0.9000 >= threshold 0.5 for 1 of 2 required consecutive checks"
    assert decisions[3].held_back is Action.WARN  # the rule held, the same score again: held back, and said so
    assert "held back: warn again 2 check(s) after the warn at check 2 (cooldown 3)" in decisions[3].reason


def test_rising_trend_fires_below_the_threshold():
    policy = Policy(
        action="warn", score="value", threshold=0.95, patience=1, warmup=1, trend_window=4, trend_slope=0.04
    )
    decisions = run(policy, [0.40, 0.40, 0.41, 0.40, 0.41, 0.45, 0.50, 0.55])
    fired = [i for i, d in enumerate(decisions) if d.fired]
    assert fired == [7]
    assert decisions[7].rule == "trend"
    # Slope of [0.41, 0.45, 0.50, 0.55] is 0.047; of the window before, [0.40, 0.41, 0.45, 0.50], 0.034.
    assert "index rising 0.0470 per check over the last 4 checks (>= 0.04)" in decisions[7].reason


def test_score_relative_to_the_warmup_baseline():
    policy = Policy(action="warn", score="baseline", threshold=0.1, patience=1, warmup=3)
    decisions = run(policy, [0.5, 0.6, 0.4, 0.55, 0.61])
    assert policy.baseline_ == pytest.approx(0.5)
    assert actions(decisions) == ["none", "none", "none", "none", "warn"]
    assert "index - baseline 0.1100 (baseline 0.5000)" in decisions[-1].reason


def test_learning_rate_cuts_escalate_after_the_cap():
    policy = Policy(
        action="lower_lr",
        score="value",
        threshold=0.5,
        patience=1,
        warmup=0,
        cooldown=0,
        lr_factor=0.25,
        max_lr_cuts=2,
        after_max_lr_cuts="stop",
        checkpoint=True,
    )
    decisions = run(policy, [0.9, 0.9, 0.9])
    assert actions(decisions) == ["lower_lr", "lower_lr", "stop"]
    assert [d.lr_factor for d in decisions] == [0.25, 0.25, None]
    assert "cut 2 of 2" in decisions[1].reason
    assert "2 learning-rate cuts made already, so stop" in decisions[2].reason
    assert all(d.checkpoint for d in decisions)
    assert policy.lr_cuts_ == 2


def test_warn_never_asks_for_a_checkpoint():
    policy = Policy(action="warn", score="value", threshold=0.5, patience=1, warmup=0, checkpoint=True)
    assert not policy.decide(0, 0.9).checkpoint


def test_divergence_acts_at_once_even_in_warmup():
    policy = Policy(action="warn", warmup=5, on_diverged="stop")
    decision = policy.decide(12, None, diverged=True)
    assert decision.action is Action.STOP
    assert decision.rule == "diverged"
    assert decision.value is None
    assert policy.decide(13, math.nan).action is Action.STOP
    assert Policy(on_diverged="none").decide(0, None, diverged=True).action is Action.NONE


def test_diverged_learning_rate_cuts_are_capped_like_the_rules():
    policy = Policy(on_diverged="lower_lr", max_lr_cuts=2, after_max_lr_cuts="stop", cooldown=0)
    decisions = [policy.decide(step, None, diverged=True) for step in range(4)]
    assert actions(decisions) == ["lower_lr", "lower_lr", "stop", "stop"]
    assert decisions[1].reason == "the features diverged (NaN or Inf): learning rate x 0.5 (cut 2 of 2)"
    assert decisions[2].reason == "the features diverged (NaN or Inf); 2 learning-rate cuts made already, so stop"
    assert policy.lr_cuts_ == 2


def test_state_round_trip_never_refires():
    values = [0.2, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    settings = {
        "action": "lower_lr",
        "score": "value",
        "threshold": 0.7,
        "patience": 2,
        "warmup": 2,
        "cooldown": 2,
        "max_lr_cuts": 5,
    }
    uninterrupted = actions(run(Policy(**settings), values))
    first = Policy(**settings)
    head = actions(run(first, values[:5]))
    restored = Policy(**settings)
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert restored == first
    tail = actions(run(restored, values[5:], start=5))
    assert head + tail == uninterrupted
    assert uninterrupted.count("lower_lr") == 3
    assert pickle.loads(pickle.dumps(first)) == first


def test_decision_round_trip():
    decision = Decision(Action.LOWER_LR, "because", 10, 0.8, 0.8, "threshold", 0.5, True)
    assert Decision.from_dict(json.loads(json.dumps(decision.as_dict()))) == decision
    assert decision.as_dict()["action"] == "lower_lr"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"action": "explode"},
            r"`action` must be one of \['none', 'warn', 'lower_lr', 'rollback', 'stop'\], got 'explode'",
        ),
        ({"threshold": math.nan}, "`threshold` must be a finite number, got nan"),
        ({"patience": 0}, "`patience` must be an integer >= 1, got 0"),
        ({"warmup": -1}, "`warmup` must be an integer >= 0, got -1"),
        ({"cooldown": 1.5}, "`cooldown` must be an integer >= 0, got 1.5"),
        ({"trend_window": 3}, "`trend_window` and `trend_slope` go together"),
        ({"trend_window": 1, "trend_slope": 0.1}, "`trend_window` must be an integer >= 2, got 1"),
        ({"trend_window": 3, "trend_slope": -0.1}, r"`trend_slope` must be a finite number > 0, got -0.1"),
        ({"lr_factor": 1.0}, r"`lr_factor` must be a finite number in \(0, 1\), got 1.0"),
        ({"max_lr_cuts": -2}, "`max_lr_cuts` must be an integer >= 0, got -2"),
        ({"after_max_lr_cuts": "lower_lr"}, r"`after_max_lr_cuts` must be one of \['warn', 'stop', 'none'\]"),
        ({"on_diverged": "panic"}, "`on_diverged` must be one of"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        Policy(**kwargs)


def test_load_state_errors():
    with pytest.raises(InputError, match=r"missing key\(s\)"):
        Policy().load_state_dict({"version": 6})
    with pytest.raises(InputError, match=r"`state\['version'\]` must be 6, got 1"):
        Policy().load_state_dict({**Policy().state_dict(), "version": 1})


def test_an_unknown_field_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown argument `patiense`; did you mean `patience`\?"):
        Policy(patiense=3)
    with pytest.raises(InputError, match="`settings` must be a PolicySettings, got dict"):
        Policy({"patience": 3})


# --- trailing z-score (the collapse suite's warning rule) ------------------------------------------------------


def test_trailing_zscore_known_values():
    from topocallbacks.policy import trailing_zscore

    past = [1.0, 1.1, 0.9, 1.0, 1.1, 0.9]
    # level = median 1.0; |differences| = 0.1, 0.2, 0.1, 0.1, 0.2 -> median 0.1 -> noise 1.4826 * 0.1 / sqrt(2).
    noise = 1.4826 * 0.1 / math.sqrt(2)
    assert trailing_zscore(past, 2.0) == pytest.approx(1.0 / noise)
    assert trailing_zscore(past, 2.0, direction=-1) == pytest.approx(-1.0 / noise)
    assert trailing_zscore(past, 0.0, direction=0) == pytest.approx(1.0 / noise)
    # Only the last `window` values set the level: a slow drift is followed.
    drift = [float(i) for i in range(30)]
    assert trailing_zscore(drift, 30.0, window=10) == pytest.approx((30 - 24.5) / (1.4826 / math.sqrt(2)))
    # Quantised history (most differences 0): the mean absolute difference stands in for the median.
    flips = [1.0] * 9 + [0.0, 1.0]
    assert trailing_zscore(flips, 0.0) == pytest.approx(-1.0 / (1.2533 * 0.2 / math.sqrt(2)))
    # Not enough history, or a non-finite value: no score.
    assert trailing_zscore([1.0, 2.0], 3.0) is None
    assert trailing_zscore(past, math.nan) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"direction": 2}, "`direction` must be -1, 0 or 1, got 2"), ({"window": 1}, "`window` must be")],
)
def test_trailing_zscore_rejects_bad_arguments(kwargs, message):
    from topocallbacks.policy import trailing_zscore

    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        trailing_zscore([1.0, 2.0, 3.0, 4.0], 5.0, **kwargs)


def test_zscore_score_is_the_trailing_zscore_with_warmup_and_patience():
    from topocallbacks.policy import trailing_zscore

    rng = np.random.default_rng(0)
    values = [*list(1.0 + 0.01 * rng.normal(size=15)), 1.5, 1.5, 1.0]
    policy = Policy(action="stop", score="zscore", threshold=4.5, patience=1, warmup=10, cooldown=0)
    decisions = [policy.decide(step, value) for step, value in enumerate(values)]
    assert [d.action for d in decisions[:10]] == [Action.NONE] * 10  # warm-up
    expected = trailing_zscore(values[-20 - 3 : 15], values[15], window=10)
    assert f"z = {expected:.2f}" in decisions[15].reason
    assert [d.action for d in decisions[10:15]] == [Action.NONE] * 5
    assert decisions[15].action is Action.STOP
    assert decisions[15].rule == "threshold"
    # The same series through a saved and restored policy gives the same decisions.
    first = Policy(action="stop", score="zscore", threshold=4.5, patience=1, warmup=10, cooldown=0)
    for step, value in enumerate(values[:12]):
        first.decide(step, value)
    restored = Policy(action="stop", score="zscore", threshold=4.5, patience=1, warmup=10, cooldown=0)
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [restored.decide(s, v).action for s, v in enumerate(values[12:], 12)] == [d.action for d in decisions[12:]]


def test_score_arguments_are_validated():
    with pytest.raises(InputError, match=r"`score` must be one of \['value', 'baseline', 'zscore'\], got 'z'"):
        Policy(score="z")
    with pytest.raises(InputError, match="`zscore_window` must be"):
        Policy(score="zscore", zscore_window=1)


def test_the_default_policy_is_the_tuned_zscore_rule():
    settings = Policy().settings
    assert (settings.score, settings.threshold, settings.patience, settings.warmup, settings.zscore_window) == (
        "zscore",
        4.5,
        1,
        10,
        10,
    )
    assert Policy(PolicySettings(action="stop"), patience=2).settings == PolicySettings(action="stop", patience=2)


def test_series_functions_give_the_scores_and_holds_the_policy_computes():
    rng = np.random.default_rng(4)
    values = [*list(1.0 + 0.05 * rng.normal(size=25)), 2.5, 2.6, 1.0, math.nan, 1.02, 3.0]
    settings = PolicySettings(action="warn", threshold=4.5, patience=2, warmup=10, cooldown=0)
    policy = Policy(settings)
    decisions = [policy.decide(i, None if math.isnan(v) else v, diverged=math.isnan(v)) for i, v in enumerate(values)]
    scores = rule_scores(values, settings)
    for i, decision in enumerate(decisions):
        if i < 10 or math.isnan(values[i]) or decision.score is None:
            assert math.isnan(scores[i])
        else:
            assert scores[i] == decision.score
    holds = rule_holds(scores, 4.5, 2, 10, diverged=np.isnan(values))
    assert holds.tolist() == [d.rule is not None for d in decisions]
    assert np.flatnonzero(holds).tolist() == [26, 28]  # the jump held for 2 checks; the diverged check at once


# --- the rule never sleeps through a collapse (cooldown of the same action only; a reference of healthy checks) --


def drift_history(seed=7, checks=19):
    """A healthy diagram-drift history like the fine-tuning case of the issue: about 0.35, checked every 8 steps."""
    rng = np.random.default_rng(seed)
    return [None, *(0.35 + 0.06 * rng.normal(size=checks - 1)).tolist(), 0.352]


def replay(policy, values, first_step=-8):
    return {first_step + 8 * i: policy.decide(first_step + 8 * i, v) for i, v in enumerate(values)}


@pytest.mark.parametrize("action", ["warn", "lower_lr", "stop"])
def test_a_false_alarm_does_not_silence_the_collapse_that_follows(action):
    # The case: step 152 a false alarm (healthy), 160 the fault starts, 168 the collapse (drift x60).
    decisions = replay(Policy(action=action), [*drift_history(), 0.840, 0.658, 31.38])
    assert decisions[144].action is Action.NONE
    assert decisions[152].action.value == action  # the false alarm (its z is above 4.5)
    assert decisions[168].action.value == action  # was "none (in cooldown)": now fires through
    assert decisions[168].score > 50 * decisions[152].score
    if action == "lower_lr":
        assert "cut 2 of 3" in decisions[168].reason
    # Step 160 is measured against the healthy checks only (152's jump is held out of the reference): it reaches
    # the threshold too, but a smaller repeat of the same action within the cooldown is held back, and said so.
    assert decisions[160].score >= 4.5
    assert decisions[160].held_back.value == action
    assert decisions[160].action is Action.NONE
    assert "held back" in decisions[160].reason


def test_a_jump_stays_out_of_the_reference_so_it_does_not_hide_itself():
    history = drift_history()
    values = [*history, *([0.95] * 8)]
    scores = rule_scores(values, PolicySettings())[len(history) :]
    assert np.all(scores >= 4.5)  # every check of the sustained jump is measured against the healthy checks
    # A trailing window of the last checks instead takes the jump in: blind from its 7th check on.
    positional = [np.nan if v is None else v for v in values]
    trailing = [trailing_zscore(positional[i - 20 : i], positional[i]) for i in range(len(history), len(values))]
    assert trailing[6] == trailing[7] == 0.0


def test_a_sustained_collapse_after_a_false_alarm_is_flagged_at_every_check_until_it_becomes_the_level():
    policy = Policy(action="warn", cooldown=5)
    history = drift_history()
    decisions = replay(policy, [*history, 0.9, 0.35, 0.33, *([4.0] * 14)])
    steps = sorted(decisions)
    onset = steps[len(history) + 3]
    assert decisions[steps[len(history)]].action is Action.WARN  # the false alarm
    assert decisions[onset].action is Action.WARN  # 2 checks into the cooldown: a bigger alarm goes through
    collapsed = [decisions[s] for s in steps if s > onset]
    # The collapse stays out of the reference for zscore_window (10) checks: the rule keeps holding (the repeats
    # are held back by the cooldown, or fire after it), then the new level enters the reference.
    assert all(d.rule == "threshold" for d in collapsed[:9])
    assert [d.action.value for d in collapsed[:9]].count("warn") == 1  # once more, after the cooldown
    assert all(d.held_back is Action.WARN for d in collapsed[:9] if d.action is Action.NONE)
    assert collapsed[-1].rule is None


def test_a_stronger_action_is_never_held_back_by_a_cooldown():
    policy = Policy(action="lower_lr", max_lr_cuts=1, after_max_lr_cuts="stop", cooldown=10)
    decisions = replay(policy, [*drift_history(), 2.0, 1.9])
    last, previous = decisions[max(decisions)], decisions[max(decisions) - 8]
    assert previous.action is Action.LOWER_LR
    assert last.score < previous.score  # a smaller alarm...
    assert last.action is Action.STOP  # ...but the cuts are spent: the escalation to stop goes through
    assert "1 learning-rate cuts made already, so stop" in last.reason


def test_a_warning_does_not_start_a_cooldown_for_a_stronger_action():
    policy = Policy(action="warn")
    replay(policy, [*drift_history(), 0.9])
    policy.settings = policy.settings.replace(action="stop")  # e.g. a rule over several channels escalating
    decision = policy.decide(200, 0.8)
    assert decision.action is Action.STOP


def test_held_back_decisions_and_the_new_state_round_trip():
    first = Policy(action="warn")
    values = [*drift_history(), 0.84, 0.66]
    decisions = replay(first, values)
    held = decisions[max(decisions)]
    assert Decision.from_dict(json.loads(json.dumps(held.as_dict()))) == held
    restored = Policy(action="warn")
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert restored == first
    assert restored.decide(500, 31.38).action is Action.WARN
