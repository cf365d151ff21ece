"""The silent path (topocallbacks/silent.py, SilentSettings): the library reproduces the silent suite's replay of the
chosen candidate check by check, acts only where the loud path is quiet, and keeps its state."""

import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_module
from topocallbacks.exceptions import InputError
from topocallbacks.pipeline import CheckPipeline
from topocallbacks.settings import Action, MonitorSettings, SilentSettings
from topocallbacks.silent import GeometryWatch, SilentWatch

signals = benchmark_module("silent_signals", "silent")
round2 = benchmark_module("round2", "silent")
cases = benchmark_module("cases", "silent")
record = benchmark_module("record", "collapse")
library_replay = benchmark_module("library_replay", "silent")


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
    with pytest.raises(InputError, match=r"`silent_family` must be one of \['drift', 'geometry'\], got 'spectrum'"):
        MonitorSettings().merged({"silent_family": "spectrum"})
    default = MonitorSettings().silent
    assert default == SilentSettings(enabled=False, family="drift", action="warn", warmup=10)
    assert default.rule == (12.0, 2, True)  # round 2's registered rule (ROUND2.md, stage 2)
    assert SilentSettings(family="geometry").rule == (4.5, 3, False)  # round 5's (ROUND5.md, stage 2)
    assert SilentSettings(family="geometry", threshold=6.0, sentinels=True).rule == (6.0, 3, True)
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
    threshold, patience, _ = settings.rule
    policy = PolicySettings(threshold=threshold, warmup=settings.warmup)
    expected = rule_scores(series, policy, direction=1)
    assert np.array_equal(np.array(scores), expected, equal_nan=True)
    assert holds == rule_holds(np.nan_to_num(expected, nan=-math.inf).tolist(), threshold, patience,
                               settings.warmup).tolist()  # fmt: skip
    assert any(holds)


def clustered_frames(kind, n_checks=36, onset=20, seed=0):
    """Eight clusters in 12-d with small healthy moves, then from ``onset`` (``cone``) a common direction growing,
    (``shrink``) the cloud shrinking, (``merge``) the clusters drawn together, or (``none``) nothing."""
    rng = np.random.default_rng(seed)
    centres = 4.0 * rng.normal(size=(8, 12))
    labels = np.arange(128) % 8
    out = []
    for check in range(n_checks):
        t = max(0, check - onset + 1)
        x = centres[labels] + 0.3 * rng.normal(size=(128, 12))
        if kind == "cone" and t:
            x = x + 2.0 * t * np.ones(12)
        if kind == "shrink" and t:
            x = x * 0.8**t
        if kind == "merge" and t:
            x = x - min(1.0, 0.1 * t) * centres[labels]
        out.append(x.astype(np.float32))
    return np.stack(out)


GEOMETRY_ON = MonitorSettings().merged({"silent_path": True, "silent_family": "geometry"})


@pytest.mark.parametrize("kind", ["none", "cone", "shrink", "merge"])
def test_the_geometry_family_holds_where_the_benchmark_replay_of_round_fives_choice_does(kind, library_replay):
    features = clustered_frames(kind)
    holding, decisions, watch = library(features, GEOMETRY_ON)
    expected, values = library_replay.replay(features)
    assert isinstance(watch, GeometryWatch)
    for name in watch.series_:  # the same values, check by check
        assert np.allclose(watch.series_[name], values[name], rtol=1e-12, atol=0, equal_nan=True), name
    assert holding.tolist() == expected.tolist()
    assert expected.any() == (kind != "none")  # the replay itself alarms on each collapse and not on the healthy run
    first = int(np.argmax(expected)) if expected.any() else None
    warned = [i for i, d in enumerate(decisions) if d.rule == "silent"]
    assert warned == ([first] if first is not None else [])  # raised once, where the replay first holds
    if first is not None:
        reason = decisions[first].reason
        assert reason.startswith("silent path: ")
        assert "(>= 4.5 for 3 checks)" in reason


def test_the_geometry_watch_resumes_from_its_saved_state_exactly():
    features = clustered_frames("cone")
    pipeline = CheckPipeline(GEOMETRY_ON)
    for i, frame in enumerate(features[:15]):
        pipeline.evaluate(frame, 10 * i)
    twin = CheckPipeline(GEOMETRY_ON)
    twin.silent.load_state_dict(pipeline.silent.state_dict())
    for i, frame in enumerate(features[15:], start=15):
        pipeline.evaluate(frame, 10 * i)
        twin.evaluate(frame, 10 * i)
        assert pipeline.silent.state_dict() == twin.silent.state_dict()
    diverged = GeometryWatch(SilentSettings(family="geometry"))
    assert diverged.observe(None) is None
    assert all(math.isnan(values[0]) for values in diverged.series_.values())  # a diverged check holds no value
    assert diverged.checks_ == 1


def test_the_geometry_family_reproduces_the_replay_on_a_recorded_run(library_replay, cases, record, tmp_path):
    """A real recording (round 4's VICReg scenario, shortened; both branches): the library's watch and the benchmark's
    replay give the same values and hold at the same checks."""
    import dataclasses

    scenario = dataclasses.replace(cases.SCENARIOS["vicreg_variance_fade"], steps=200, fault_step=100)
    data = np.load(record.record(scenario.name, 3, tmp_path, scenario=scenario))
    for kind in ("collapse", "healthy"):
        features = data[f"{kind}/features"]
        assert features.shape == (21, 512, 128)
        holding, _, watch = library(features, GEOMETRY_ON)
        expected, values = library_replay.replay(features)
        for name in watch.series_:
            assert np.allclose(watch.series_[name], values[name], rtol=1e-12, atol=0, equal_nan=True), (kind, name)
        assert holding.tolist() == expected.tolist(), kind
