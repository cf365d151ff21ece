"""The silent path (topocallbacks/silent.py, SilentSettings): the library reproduces the silent suite's replay of the
chosen candidate check by check, acts only where the loud path is quiet, and keeps its state."""

import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_module
from topocallbacks.exceptions import InputError
from topocallbacks.pipeline import CheckPipeline
from topocallbacks.settings import Action, MonitorSettings, SilentSettings
from topocallbacks.silent import SilentWatch

signals = benchmark_module("silent_signals", "silent")
round2 = benchmark_module("round2", "silent")


def frames(n_checks=40, onset=25, n=96, dim=12, seed=0, kind="rotate"):
    """A probe's features at each check: small healthy moves, then from ``onset`` a drift that grows (``rotate``:
    the features turn away from where they were; ``cone``: they gather in one direction; ``none``: healthy)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, dim))
    out = []
    for check in range(n_checks):
        x = base + 0.05 * rng.normal(size=(n, dim))
        t = max(0, check - onset + 1)
        if kind == "rotate" and t:
            mix = np.linalg.qr(rng.normal(size=(dim, dim)))[0]
            x = (1 - min(1.0, 0.08 * t)) * x + min(1.0, 0.08 * t) * (x @ mix) ** 2
        if kind == "cone" and t:
            x = x + 3.0 * t * np.ones(dim)
        out.append(x.astype(np.float32))
    return np.stack(out)


#: The silent path turned on (it ships off: ROUND3.md's stage 2).
ON = MonitorSettings().merged({"silent_path": True})


def library(features, settings=None):
    """The pipeline's silent watch at every check: (holding per check, decisions, the watch)."""
    pipeline = CheckPipeline(settings or ON)
    holding, decisions = [], []
    for i, frame in enumerate(features):
        decisions.append(pipeline.evaluate(frame, step=10 * i).record.decision)
        holding.append(pipeline.silent is not None and pipeline.silent.alarming_)
    return np.array(holding), decisions, pipeline.silent


def replay(features, signals, round2):
    """The benchmark's replay of round 2's chosen candidate (drift+sentinels, trailing, k 12, p 2): where it holds."""
    values, _ = signals.feature_signals(features)
    run = round2.r1.Run("x", 0, "healthy", np.arange(len(features)) * 10, values)
    hit = np.zeros(len(features), dtype=bool)
    for signal in (*round2.r1.FAMILIES["drift"], *round2.r1.SENTINELS):
        hit |= round2.alarms(run, signal, "trailing", 12.0, 2)
    hit[: signals.WARMUP] = False
    return hit, values


@pytest.mark.parametrize("kind", ["rotate", "cone", "none"])
def test_the_library_holds_where_the_benchmark_replay_of_the_chosen_candidate_does(kind, signals, round2):
    features = frames(kind=kind)
    holding, _, watch = library(features)
    expected, values = replay(features, signals, round2)
    for name in ("diagram_drift_ref", "cka_drift"):
        assert np.array_equal(np.array(watch.series_[name]), values[name], equal_nan=True), name
    assert holding.tolist() == expected.tolist()
    assert holding[25:].any() == (kind != "none")  # the drifts and the cone are seen; the healthy run is not
    assert not holding[:25].any()


def test_a_silent_alarm_warns_once_where_the_loud_path_is_quiet_and_can_be_turned_off():
    features = frames(kind="cone")
    holding, decisions, _ = library(features)
    silent = [d for d in decisions if d.rule == "silent"]
    assert len(silent) == 1  # raised once for the episode
    first = int(np.argmax(holding))
    assert silent[0].step == 10 * first
    assert silent[0].action is Action.WARN
    assert "silent" in silent[0].flagged
    assert "mean pairwise cosine" in silent[0].reason
    assert silent[0].reason.startswith("silent path:")
    assert not silent[0].healthy  # no rollback snapshot of a silently alarmed check
    _, quiet, _ = library(features, MonitorSettings())  # the default: off
    assert all(d.rule != "silent" for d in quiet)
    stop = ON.merged({"silent_action": "stop"})
    _, stopped, _ = library(features, stop)
    assert [d.action for d in stopped if d.rule == "silent"] == [Action.STOP]


def test_the_watch_resumes_from_its_saved_state_exactly():
    features = frames(kind="rotate")
    pipeline = CheckPipeline(ON)
    for i, frame in enumerate(features[:22]):
        pipeline.evaluate(frame, step=10 * i)
    twin = CheckPipeline(ON)
    twin.load_state_dict(pipeline.state_dict())
    for i, frame in enumerate(features[22:], start=22):
        one, two = pipeline.evaluate(frame, 10 * i).record.decision, twin.evaluate(frame, 10 * i).record.decision
        assert (one.action, one.rule, one.reason) == (two.action, two.rule, two.reason)
    assert twin.silent.series_ == pipeline.silent.series_


def test_a_diverged_check_counts_and_holds_no_value():
    watch = SilentWatch(SilentSettings(warmup=2))
    rng = np.random.default_rng(1)
    assert watch.observe(rng.normal(size=(32, 4)), None) is None
    assert watch.observe(None, None) is None  # the warm-up's last check diverged: no reference is taken
    assert watch.observe(rng.normal(size=(32, 4)), None) is None
    assert all(math.isnan(v) for v in watch.series_["cka_drift"])
    assert watch.checks_ == 3


def test_bad_settings_name_the_option_and_the_value():
    with pytest.raises(InputError, match=r"`silent_action` must be one of \['warn', 'stop'\], got 'rollback'"):
        MonitorSettings().merged({"silent_action": "rollback"})
    with pytest.raises(InputError, match="silent_patience"):
        MonitorSettings().merged({"silent_patience": 0})
    assert MonitorSettings().silent == SilentSettings(enabled=False, action="warn", threshold=12.0, patience=2,
                                                      warmup=10, sentinels=True)  # fmt: skip
    assert CheckPipeline(MonitorSettings()).silent is None  # off by default (ROUND3.md, stage 2)


@pytest.mark.parametrize("layer_rule", ["primary", "any"])
def test_with_several_layers_the_silent_path_watches_the_primary_layer_and_only_warns(layer_rule):
    from topocallbacks.pipeline import LayeredPipeline

    settings = ON.merged({"layers": ["a", "b"], "policy": {"layer_rule": layer_rule}})
    pipeline = LayeredPipeline(settings)
    cone, healthy = frames(kind="cone"), frames(kind="none", seed=1)
    decisions = [pipeline.evaluate({"a": cone[i], "b": healthy[i]}, step=10 * i).record.decision
                 for i in range(len(cone))]  # fmt: skip
    silent = [d for d in decisions if d.rule == "silent"]
    assert [d.action for d in silent] == [Action.WARN]
    assert all(d.action in (Action.NONE, Action.WARN) for d in decisions)  # a silent alarm never rolls back
    assert [p.silent is not None for p in pipeline.pipelines.values()] == [True, False]
    swapped = LayeredPipeline(settings)  # the drift on the other layer: not the primary's, no warning
    quiet = [swapped.evaluate({"a": healthy[i], "b": cone[i]}, step=10 * i).record.decision for i in range(len(cone))]
    assert all(d.rule != "silent" for d in quiet)


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_trailing_rule_scores_and_holds_as_the_rule_does_on_the_whole_series(seed):
    from topocallbacks.policy import rule_holds, rule_scores
    from topocallbacks.settings import PolicySettings
    from topocallbacks.silent import TrailingRule

    rng = np.random.default_rng(seed)
    series = np.abs(rng.normal(1.0, 0.1, size=80))
    series[:9] = math.nan  # before the reference, as the drifts are
    series[rng.choice(np.arange(10, 80), 6, replace=False)] = math.nan  # diverged checks
    series[40 + seed :] += 5.0 * (1 + seed)  # a lasting jump
    settings = SilentSettings(patience=1 + seed % 3)
    rule = TrailingRule(settings)
    scores, holds = [], []
    for value in series:
        score = rule.add(float(value))
        scores.append(math.nan if score is None else score)
        holds.append(rule.holds)
    policy = PolicySettings(threshold=settings.threshold, warmup=settings.warmup)
    expected = rule_scores(series, policy, direction=1)
    assert np.array_equal(np.array(scores), expected, equal_nan=True)
    assert holds == rule_holds(np.nan_to_num(expected, nan=-math.inf).tolist(), settings.threshold,
                               settings.patience, settings.warmup).tolist()  # fmt: skip
    assert any(holds)
