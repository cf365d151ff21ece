import json
import math
import pickle

import numpy as np
import pytest

from tests.unit.rules import OLD_RULE, old_policy, old_settings
from topocallbacks import ConfigError, InputError
from topocallbacks.policy import Action, Decision, Policy, rule_holds, rule_scores, trailing_zscore
from topocallbacks.settings import DEFAULT_RULES, PolicySettings


def run(policy, values, start=0):
    return [policy.decide(step, value) for step, value in enumerate(values, start=start)]


def actions(decisions):
    return [d.action.value for d in decisions]


def test_threshold_needs_patience_consecutive_checks_after_warmup():
    policy = old_policy(action="stop", score="value", threshold=0.7, patience=3, warmup=2, cooldown=0)
    decisions = run(policy, [0.9, 0.9, 0.8, 0.8, 0.6, 0.8, 0.8, 0.8])
    assert actions(decisions) == ["none"] * 7 + ["stop"]
    assert decisions[0].reason == "warm-up check 1 of 2"
    assert decisions[-1].rule == "threshold"
    assert "for 3 consecutive checks" in decisions[-1].reason
    assert decisions[-1].step == 7


def test_cooldown_blocks_and_patience_restarts_after_an_action():
    policy = old_policy(action="warn", score="value", threshold=0.5, patience=2, warmup=0, cooldown=3)
    decisions = run(policy, [0.9] * 9)
    # Fires at check 2; checks 3-5 are in cooldown; patience counts again from check 3, so check 6 fires.
    assert actions(decisions) == ["none", "warn", "none", "none", "none", "warn", "none", "none", "none"]
    assert decisions[2].reason == "index 0.9000 >= threshold 0.5 for 1 of 2 required consecutive checks"
    assert decisions[3].held_back is Action.WARN  # the rule held, the same score again: held back, and said so
    assert "held back: warn again 2 check(s) after the warn at check 2 (cooldown 3)" in decisions[3].reason


def test_rising_trend_fires_below_the_threshold():
    policy = old_policy(
        action="warn", score="value", threshold=0.95, patience=1, warmup=1, trend_window=4, trend_slope=0.04
    )
    decisions = run(policy, [0.40, 0.40, 0.41, 0.40, 0.41, 0.45, 0.50, 0.55])
    fired = [i for i, d in enumerate(decisions) if d.fired]
    assert fired == [7]
    assert decisions[7].rule == "trend"
    # Slope of [0.41, 0.45, 0.50, 0.55] is 0.047; of the window before, [0.40, 0.41, 0.45, 0.50], 0.034.
    assert "index rising 0.0470 per check over the last 4 checks (>= 0.04)" in decisions[7].reason


def test_score_relative_to_the_warmup_baseline():
    policy = old_policy(action="warn", score="baseline", threshold=0.1, patience=1, warmup=3)
    decisions = run(policy, [0.5, 0.6, 0.4, 0.55, 0.61])
    assert policy.baseline_ == pytest.approx(0.5)
    assert actions(decisions) == ["none", "none", "none", "none", "warn"]
    assert "index - baseline 0.1100 (baseline 0.5000)" in decisions[-1].reason


def test_learning_rate_cuts_escalate_after_the_cap():
    policy = old_policy(
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
        **OLD_RULE,
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
        Policy().load_state_dict({"version": 7})
    with pytest.raises(InputError, match=r"`state\['version'\]` must be 7, got 1"):
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
    policy = old_policy(action="stop", score="zscore", threshold=4.5, patience=1, warmup=10, cooldown=0)
    decisions = [policy.decide(step, value) for step, value in enumerate(values)]
    assert [d.action for d in decisions[:10]] == [Action.NONE] * 10  # warm-up
    expected = trailing_zscore(values[-20 - 3 : 15], values[15], window=10)
    assert f"z = {expected:.2f}" in decisions[15].reason
    assert [d.action for d in decisions[10:15]] == [Action.NONE] * 5
    assert decisions[15].action is Action.STOP
    assert decisions[15].rule == "threshold"
    # The same series through a saved and restored policy gives the same decisions.
    first = old_policy(action="stop", score="zscore", threshold=4.5, patience=1, warmup=10, cooldown=0)
    for step, value in enumerate(values[:12]):
        first.decide(step, value)
    restored = old_policy(action="stop", score="zscore", threshold=4.5, patience=1, warmup=10, cooldown=0)
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


def test_the_default_rule_is_the_rescue_suites_rule():
    s = Policy().settings
    assert (s.channels, s.require, s.action, s.on_diverged) == (("index", "loss"), 2, "rollback", "rollback")
    assert (s.rollback_lr_factor, s.rollback_skip, s.max_rollbacks, s.after_max_rollbacks) == (0.5, None, 4, "stop")
    assert s.sentinels is True
    assert DEFAULT_RULES["diagram_drift"] == DEFAULT_RULES["rankme"] == s
    paper = DEFAULT_RULES["paper"]
    assert (paper.channels, paper.require, paper.action, paper.score, paper.threshold) == (
        ("index",), 1, "rollback", "value", 0.7,
    )  # fmt: skip
    # The rule names both channels: watching one alone must also say how many are required.
    with pytest.raises(InputError, match=r"`require` must be at most the number of `channels` \(1"):
        Policy(channels=["index"])  # require 2 is the default: one channel must say require=1


def test_a_rollback_that_fires_again_cuts_and_the_escalation_names_the_structural_cause():
    # The default rule: rollback; the first one does not cut, one within two checks of the last cuts 0.5; at most 4.
    policy = Policy(warmup=0, cooldown=0)
    decisions = [policy.decide(step, 0.3, loss=2.0, collapsed="the features are constant") for step in range(6)]
    assert actions(decisions) == ["rollback"] * 4 + ["stop"] * 2
    assert [d.lr_factor for d in decisions] == [None] + [0.5] * 3 + [None] * 2
    assert decisions[0].reason == (
        "the features are constant: roll back to the newest healthy snapshot before step 0, no cut (no rollback in "
        "the two checks before) (rollback 1 of 4)"
    )
    assert decisions[1].reason == (
        "the features are constant: roll back to the newest healthy snapshot before step 1, learning rate x 0.5 as it "
        "fired again within two checks of the last rollback (rollback 2 of 4)"
    )
    assert decisions[4].reason == (
        "the features are constant; 4 rollbacks made already and the alarm came back after them: its cause outlives "
        "a rollback (structural: the model, the data or the learning-rate schedule, not a passing burst), so stop"
    )
    none = Policy(max_rollbacks=0).decide(0, 0.3, collapsed="the features are constant")
    assert (none.action, none.reason) == (
        Action.STOP,
        "the features are constant; no rollbacks allowed (max_rollbacks 0), so stop",
    )


def test_series_functions_give_the_scores_and_holds_the_policy_computes():
    rng = np.random.default_rng(4)
    values = [*list(1.0 + 0.05 * rng.normal(size=25)), 2.5, 2.6, 1.0, math.nan, 1.02, 3.0]
    settings = old_settings(action="warn", threshold=4.5, patience=2, warmup=10, cooldown=0)
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
    decisions = replay(old_policy(action=action), [*drift_history(), 0.840, 0.658, 31.38])
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
    policy = old_policy(action="warn", cooldown=5)
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
    policy = old_policy(action="lower_lr", max_lr_cuts=1, after_max_lr_cuts="stop", cooldown=10)
    decisions = replay(policy, [*drift_history(), 2.0, 1.9])
    last, previous = decisions[max(decisions)], decisions[max(decisions) - 8]
    assert previous.action is Action.LOWER_LR
    assert last.score < previous.score  # a smaller alarm...
    assert last.action is Action.STOP  # ...but the cuts are spent: the escalation to stop goes through
    assert "1 learning-rate cuts made already, so stop" in last.reason


def test_a_warning_does_not_start_a_cooldown_for_a_stronger_action():
    policy = old_policy(action="warn")
    replay(policy, [*drift_history(), 0.9])
    policy.settings = policy.settings.replace(action="stop")  # e.g. a rule over several channels escalating
    decision = policy.decide(200, 0.8)
    assert decision.action is Action.STOP


def test_held_back_decisions_and_the_new_state_round_trip():
    first = old_policy(action="warn")
    values = [*drift_history(), 0.84, 0.66]
    decisions = replay(first, values)
    held = decisions[max(decisions)]
    assert Decision.from_dict(json.loads(json.dumps(held.as_dict()))) == held
    restored = old_policy(action="warn")
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert restored == first
    assert restored.decide(500, 31.38).action is Action.WARN


# --- issue 22: the absolute sentinels, the training channels' noise floor, the state of the new fields -------------


def healthy_checks(policy, count, start=0):
    """``count`` healthy checks: the index about 0.35, the loss falling slowly, a steady gradient norm about 1."""
    return [
        policy.decide(
            step,
            0.35 + 0.01 * (-1) ** step,
            loss=2.0 - 0.01 * step + 0.01 * (-1) ** step,
            grad_norm=1.0 + 0.02 * (-1) ** step,
        )
        for step in range(start, start + count)
    ]


def channel_states(policy):
    state = policy.state_dict()
    return state["channels"], state["unwatched"]


def test_a_sentinel_acts_at_once_in_the_warm_up_and_its_values_enter_no_reference():
    policy = Policy()  # the default rule: warm-up 10 checks, rollback
    assert actions(healthy_checks(policy, 3)) == ["none"] * 3
    before = channel_states(policy)
    collapse = "the features are constant (spread 1e-09 of their size, at most 0.0001)"
    decision = policy.decide(3, 9.0, loss=50.0, grad_norm=40.0, collapsed=collapse)
    assert decision.action is Action.ROLLBACK  # the 4th check of a warm-up of 10: a sentinel needs no baseline
    assert (decision.rule, decision.flagged, decision.onset, decision.step) == ("sentinel", ("collapse",), 3, 3)
    assert (decision.value, decision.score, decision.lr_factor) == (9.0, None, None)  # a first rollback: no cut
    assert decision.reason == (
        f"{collapse}: roll back to the newest healthy snapshot before step 3, no cut (no rollback in the two checks "
        "before) (rollback 1 of 4)"
    )
    assert not decision.healthy
    assert channel_states(policy) == before  # no index, loss or gradient norm value entered a reference or warm-up
    assert (policy.checks_decided_, policy.rollbacks_) == (4, 1)
    assert policy.checks_ == policy.checks_decided_  # the old name, kept working
    # The rest of the warm-up only builds the reference; the collapsed values never reach it.
    assert actions(healthy_checks(policy, 8, start=4)) == ["none"] * 8
    index = policy.channels_["index"]
    assert 9.0 not in index.reference.values
    assert 9.0 not in index.warmup
    assert policy.channels_["loss"].reference.scale == pytest.approx(2.0 + 0.01)  # the healthy maximum, not 50
    assert 40.0 not in policy.unwatched_["grad_norm"].reference.values
    # After the warm-up, a sentinel acts again at once; an index that merely comes back is not an alarm.
    again = policy.decide(12, 0.35, loss=1.9, collapsed=collapse)
    assert (again.action, again.rule) == (Action.ROLLBACK, "sentinel")
    assert "(rollback 2 of 4)" in again.reason
    quiet = policy.decide(13, 0.35, loss=1.88)
    assert quiet.healthy


def test_a_sentinel_acts_with_the_rules_action_or_only_reports_when_off():
    collapse = "the features lie on one line"
    warn = Policy(action="warn")
    decision = warn.decide(0, None, collapsed=collapse)
    assert (decision.action, decision.reason, decision.rule) == (Action.WARN, collapse, "sentinel")
    on = Policy()
    before = channel_states(on)
    decision = on.decide(0, 0.4, loss=2.0, collapsed=collapse)
    assert decision.action is Action.ROLLBACK
    assert decision.flagged == ("collapse",)
    assert channel_states(on) == before  # a collapsed check's values enter no reference
    # Off, the user counts such features as healthy (a binary classifier's terminal phase, say): the check is judged
    # like any other, its values enter the references, and nothing acts on the sentinel.
    off = Policy(sentinels=False)
    decision = off.decide(0, 0.4, loss=2.0, collapsed=collapse)
    assert decision.action is Action.NONE
    assert decision.reason == "warm-up check 1 of 10"
    assert decision.flagged == ()
    assert off.channels_["index"].reference.values == [0.4]
    assert off.channels_["loss"].reference.values == [2.0]
    assert off.rollbacks_ == 0


def test_the_loss_channel_is_scored_on_its_own_scale_so_a_blip_near_zero_is_not_an_alarm():
    # A contrastive loss that fell from 3 to 1e-5 (the MiniLM case): one batch at 0.04.
    losses = [3.0, 2.0, 1.0, 0.3, 0.05, 0.01, 1e-3, 1e-4, *[1e-5 * (1 + 0.1 * (-1) ** i) for i in range(14)]]
    assert trailing_zscore(losses, 0.04) > 10_000  # the raw z-score: thousands of deviations
    for score in ("zscore", "value"):  # the index's score does not change how the loss is scored
        policy = Policy(score=score, threshold=4.5 if score == "zscore" else 0.7)
        for step, loss in enumerate(losses):
            policy.decide(step, 0.35, loss=loss)
        assert policy.channels_["loss"].reference.scale == 3.0  # the largest value admitted, long out of the window
        blip = policy.decide(len(losses), 0.35, loss=0.04)
        # The noise is floored at 1 % of the scale: z = (0.04 - 1e-5) / 0.03.
        assert blip.scores["loss"] == pytest.approx((0.04 - 1e-5) / 0.03)
        if score == "zscore":
            assert blip.flagged == ()
    # The loss the rule does not watch is scored the same way: the blip leaves the check healthy.
    policy = Policy(channels=["index"], require=1)
    for step, loss in enumerate(losses):
        policy.decide(step, 0.35, loss=loss)
    assert policy.decide(len(losses), 0.35, loss=0.04).healthy


def test_a_real_jump_of_the_loss_scores_far_above_the_threshold():
    # A loss whose scale is 2.3, settled at 0.3 (check-to-check noise 0.02), jumps to 2.0.
    losses = [*np.linspace(2.3, 0.3, 10).tolist(), *[0.3 + 0.01 * (-1) ** i for i in range(12)]]
    policy = Policy()
    for step, loss in enumerate(losses):
        policy.decide(step, 0.35 + 0.01 * (-1) ** step, loss=loss)
    jump = policy.decide(len(losses), 0.35, loss=2.0)
    # The raw noise, 1.4826 x 0.02 / sqrt(2) = 0.021, is below the floor 0.023: z = (2.0 - 0.3) / 0.023.
    assert jump.scores["loss"] == pytest.approx((2.0 - 0.3) / 0.023)
    assert jump.scores["loss"] > 70
    assert jump.flagged == ("loss",)
    assert jump.action is Action.NONE  # the loss alone: the default rule requires the index too
    assert "loss 2 at z = 73.91 against its last 10 checks" in jump.reason
    assert jump.reason.endswith("(1 of the 2 channels required)")
    both = policy.decide(len(losses) + 1, 5.0, loss=2.0)  # the index jumps with it: the rule holds
    assert both.action is Action.ROLLBACK
    assert both.flagged == ("index", "loss")


def test_the_state_of_the_new_fields_round_trips_through_json_and_pickle():
    policy = Policy()
    healthy_checks(policy, 12)
    policy.decide(12, 9.0, loss=40.0, collapsed="the features are constant")
    policy.decide(13, 0.35, loss=9.0, grad_norm=30.0)  # the loss and the unwatched gradient norm spike
    state = policy.state_dict()
    assert state["version"] == 7
    assert "unwatched" in state
    assert "sentinels" not in state  # the key's old name
    assert set(state["unwatched"]) == {"grad_norm"}
    assert state["channels"]["loss"]["scale"] == pytest.approx(2.01)  # neither 40 (collapse) nor 9 (held out)
    assert state["channels"]["loss"]["held"] == [9.0]
    assert state["unwatched"]["grad_norm"]["scale"] == pytest.approx(1.02)  # not 30 (held out)
    assert state["unwatched"]["grad_norm"]["held"] == [30.0]
    assert (state["checks"], state["rollbacks"], state["last_action"]) == (14, 1, "rollback")
    restored = Policy()
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored == policy
    assert restored.channels_["loss"].reference.scale == policy.channels_["loss"].reference.scale
    assert pickle.loads(pickle.dumps(policy)) == policy
    # The scale is what the floor is made of: the same checks give the same scores after a restore.
    for step, loss in [(14, 0.04), (15, 1.96), (16, 1.95)]:
        assert restored.decide(step, 0.35, loss=loss) == policy.decide(step, 0.35, loss=loss)
    with pytest.raises(InputError, match=r"`state\['version'\]` must be 7, got 6"):
        Policy().load_state_dict({**state, "version": 6})
