import json
import pickle

import numpy as np
import pytest
import torch

from tests.cadence import AT_CADENCE
from topocallbacks import ConfigError, InputError, MonitorSettings, Policy, TopoMonitor
from topocallbacks import functional as F
from topocallbacks.check import CheckRecord
from topocallbacks.sinks import JsonlSink


def checks(monitor):
    return [r for r in monitor.history if isinstance(r, CheckRecord)]


def as_json(records):
    return json.dumps([r.as_dict() for r in records])


def digits_mlp():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )
    return model, x, y


def test_plain_pytorch_loop_in_three_lines(tmp_path):
    model, x, y = digits_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TopoMonitor(
        probe=x[:300], layer="3", check_every=10, history_path=str(tmp_path / "history.jsonl"), **AT_CADENCE
    )
    for step in range(31):
        batch = torch.randint(0, len(x), (32,))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if monitor.due(step):
            monitor.check(model, step)
    records = checks(monitor)
    assert [r.step for r in records] == [0, 10, 20, 30]
    assert all(0.0 <= r.report.ci <= 1.0 and r.status == "ok" for r in records)
    assert JsonlSink.read(tmp_path / "history.jsonl") == json.loads(json.dumps([r.as_dict() for r in records]))
    # The record matches the functional index on the same (normalised) features at the calibrated ε.
    features = monitor.features(model).astype(np.float64)
    centred = features - features.mean(axis=0)
    cloud = centred / np.sqrt(np.mean(np.sum(centred**2, axis=1)))
    expected = F.collapse_index(cloud, epsilon=monitor.epsilon_, max_points=monitor.settings.index.max_points, seed=0)
    assert records[-1].report.ci == pytest.approx(expected.ci)
    assert (records[-1].report.betti0, records[-1].report.betti1) == (expected.betti0, expected.betti1)
    assert records[-1].n_points == 300


def test_normalisation_makes_the_index_blind_to_feature_scale():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 8))
    monitor = TopoMonitor(check_every=1, **AT_CADENCE)
    first = monitor.process(features, 0)
    shrunk = monitor.process(features * 1e-3, 1)
    assert shrunk.report.ci == pytest.approx(first.report.ci)
    raw = TopoMonitor(check_every=1, normalize=False, **AT_CADENCE)
    raw.process(features, 0)
    assert raw.process(features * 1e-3, 1).report.betti0 == 1  # everything within the old ε: one blob


def test_diverged_features_are_logged_and_trigger_the_configured_action(tmp_path):
    monitor = TopoMonitor(
        policy={"action": "warn", "on_diverged": "stop"}, history_path=str(tmp_path / "h.jsonl"), **AT_CADENCE
    )
    monitor.process(np.random.default_rng(0).normal(size=(50, 4)), 0)
    broken = np.full((50, 4), np.nan)
    record = monitor.process(broken, 100)
    assert record.status == "diverged"
    assert record.report is None
    assert record.index_value is None
    assert record.decision.action.value == "stop"
    assert record.decision.rule == "diverged"
    assert JsonlSink.read(tmp_path / "h.jsonl")[-1]["status"] == "diverged"


@pytest.mark.parametrize("projection", ["pca", "random"])
def test_projection_is_fitted_once_and_kept(projection):
    rng = np.random.default_rng(1)
    monitor = TopoMonitor(projection=projection, projection_dim=5, check_every=1, **AT_CADENCE)
    first = rng.normal(size=(80, 20))
    monitor.process(first, 0)
    kept = json.dumps(monitor.state_dict()["pipeline"]["transform"])
    monitor.process(rng.normal(size=(80, 20)) * 3, 1)
    assert json.dumps(monitor.state_dict()["pipeline"]["transform"]) == kept
    with pytest.raises(InputError, match="`features` must keep dimension 20 between checks, got 7"):
        monitor.process(rng.normal(size=(80, 7)), 2)


def test_streaming_mode_watches_a_window_of_training_batches():
    rng = np.random.default_rng(2)
    monitor = TopoMonitor(mode="stream", window=128, check_every=4, **AT_CADENCE)
    records = [monitor.observe(rng.normal(size=(16, 6)), step) for step in range(12)]
    # Every 4 steps from step 4: the window of step 0 holds a single batch.
    assert [r is not None for r in records] == [step % 4 == 0 and step > 0 for step in range(12)]
    assert records[8].n_points == 128
    assert records[8].engine.path in {"vertex", "rebuild"}
    # Several batches at one step (gradient accumulation): all pushed, the window checked once.
    again = [monitor.observe(rng.normal(size=(16, 6)), 12) for _ in range(4)]
    assert [r is not None for r in again] == [True, False, False, False]
    assert len(checks(monitor)) == 3
    with pytest.raises(InputError, match="observe\\(\\) is for streaming mode"):
        TopoMonitor(**AT_CADENCE).observe(np.zeros((4, 2)), 0)


def test_state_round_trip_keeps_epsilon_history_and_policy(tmp_path):
    model, x, _ = digits_mlp()
    settings = {
        "probe": x[:100],
        "layer": "1",
        "index": "paper",
        "policy": {"action": "lower_lr", "threshold": 0.0, "patience": 1, "warmup": 1},
    }
    monitor = TopoMonitor(**settings, **AT_CADENCE)
    monitor.check(model, 0)
    record = monitor.check(model, 100)
    assert record.decision.action.value == "lower_lr"
    done = monitor.act(record, RecordingActuator())
    assert done.detail == "learning rate x 0.5"
    assert done.lr_factor == 0.5
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = TopoMonitor(**settings, **AT_CADENCE)
    restored.load_state_dict(state)
    assert restored.epsilon_ == monitor.epsilon_
    assert as_json(restored.history) == as_json(monitor.history)  # (NaN engine predictions: compared as JSON)
    assert restored.lr_factor_ == 0.5
    assert restored.policy == monitor.policy
    assert restored.last_checked_step_ == 100
    assert not restored.due(100)
    assert restored.due(200)
    assert restored.state_dict() == state  # loading and saving again changes nothing
    assert restored.check(model, 200).report.ci == pytest.approx(monitor.check(model, 200).report.ci)
    twin = pickle.loads(pickle.dumps(monitor))
    assert as_json(twin.history) == as_json(monitor.history)
    other_probe = TopoMonitor(probe=x[100:200], layer="1", **AT_CADENCE)
    with pytest.raises(InputError, match="the probe differs"):
        other_probe.load_state_dict(state)


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = TopoMonitor(tensorboard_dir=str(tmp_path / "tb"), diagram_every=1, check_every=1, **AT_CADENCE)
    rng = np.random.default_rng(3)
    for step in range(3):
        monitor.process(rng.normal(size=(60, 4)), step * 10)
    monitor.close()
    records = checks(monitor)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0}).Reload()
    scalars = events.Tags()["scalars"]
    for name in ["topo/ci", "topo/betti0", "topo/betti1", "topo/epsilon", "topo/check_ms", "topo/anisotropy_term"]:
        assert name in scalars
    assert [e.step for e in events.Scalars("topo/ci")] == [0, 10, 20]
    assert [e.value for e in events.Scalars("topo/ci")] == pytest.approx([r.report.ci for r in records])
    # No drift at the first check: logged as 0 there, so that the curve (and a monitor of it) starts with the run.
    assert [(e.step, e.value) for e in events.Scalars("topo/index")] == [
        (0, 0.0),
        *[(r.step, pytest.approx(r.index_value)) for r in records[1:]],
    ]
    if "topo/persistence_diagram" not in events.Tags()["images"]:
        pytest.importorskip("matplotlib")
        pytest.fail("a persistence-diagram figure was due at every check")


def test_jsonl_reader_skips_a_torn_last_line(tmp_path):
    sink = JsonlSink(tmp_path / "h.jsonl")
    sink.write({"step": 1})
    with (tmp_path / "h.jsonl").open("a") as handle:
        handle.write('{"step": 2, "ci"')  # a crash mid-write
    assert JsonlSink.read(tmp_path / "h.jsonl") == [{"step": 1}]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "batch"}, r"`mode` must be one of \['probe', 'stream'\], got 'batch'"),
        ({"schedule": {"mode": "batch"}}, r"`schedule.mode` must be one of \['probe', 'stream'\], got 'batch'"),
        ({"max_probe_samples": 1}, "`max_probe_samples` must be an integer >= 2, got 1"),
        ({"policy": {"patience": 0}}, "`policy.patience` must be an integer >= 1, got 0"),
        ({"check_every": 0}, "`check_every` must be an integer >= 1, got 0"),
        ({"check_every": -5}, "`check_every` must be an integer >= 1, got -5"),
        ({"window": 1}, "`window` must be an integer >= 2, got 1"),
        ({"projection": "umap"}, "`projection` must be one of"),
        ({"epsilon": -1.0}, "`epsilon` must be a finite number > 0, got -1.0"),
        ({"epsilon_quantile": 1.5}, r"`epsilon_quantile` must be a finite number in \(0, 1\], got 1.5"),
        ({"policy": "strict"}, "`policy` must be a mapping of its options or a PolicySettings, got str"),
        ({"seed": -1}, "`seed` must be an integer >= 0, got -1"),
        ({"probe": torch.zeros(4, 2)}, "`layer` is required with a `probe`"),
        ({"probe": torch.zeros(0, 2), "layer": "x"}, "`probe` is empty"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        TopoMonitor(**kwargs, **AT_CADENCE)


# --- the watched index (diagram drift by default, chosen by benchmarks/collapse) -------------------------------


def test_default_index_is_diagram_drift_and_matches_the_functional_definition():
    rng = np.random.default_rng(0)
    frames = [rng.normal(size=(120, 6)) for _ in range(3)]
    monitor = TopoMonitor(check_every=1, **AT_CADENCE)
    assert monitor.settings.index.name == "diagram_drift"
    rule = monitor.policy.settings
    assert (rule.score, rule.threshold, rule.warmup) == ("zscore", 4.5, 10)
    records = [monitor.process(frame, step) for step, frame in enumerate(frames)]
    assert records[0].index == "diagram_drift"
    assert records[0].index_value is None  # nothing to drift from at the first check
    assert records[0].decision.value is None
    previous = None
    for frame, record in zip(frames, records, strict=True):
        centred = frame - frame.mean(axis=0)
        cloud = centred / np.sqrt(np.mean(np.sum(centred**2, axis=1)))
        sample = cloud  # 120 points: below max_points, no subsample
        diagrams = F.persistence_diagrams(sample, threshold=F.longest_mst_edge(sample))
        if previous is not None:
            expected = sum(F.diagram_distance(a, b) for a, b in zip(previous, diagrams, strict=True))
            assert record.index_value == pytest.approx(expected)
            assert record.decision.value == pytest.approx(expected)  # what the policy saw
        previous = diagrams
    assert records[1].index_value > 0


def test_rankme_is_handed_to_the_policy_negated_and_paper_keeps_the_threshold_policy():
    features = np.random.default_rng(1).normal(size=(100, 5))
    rankme = TopoMonitor(check_every=1, index="rankme", **AT_CADENCE)
    record = rankme.process(features, 0)
    assert record.index_value == pytest.approx(F.effective_rank(features - features.mean(axis=0)))
    assert record.decision.value == pytest.approx(-record.index_value)
    paper = TopoMonitor(check_every=1, index="paper", **AT_CADENCE)
    record = paper.process(features, 0)
    assert record.index_value == record.report.ci
    assert (paper.policy.settings.score, paper.policy.settings.threshold) == ("value", 0.7)
    with pytest.raises(InputError, match=r"`index` must be one of \['diagram_drift', 'paper', 'rankme'\], got 'ci'"):
        TopoMonitor(index="ci", **AT_CADENCE)


def test_drift_state_survives_a_round_trip_so_a_resume_continues_the_drift():
    rng = np.random.default_rng(2)
    frames = [rng.normal(size=(80, 4)) for _ in range(3)]
    uninterrupted = TopoMonitor(check_every=1, **AT_CADENCE)
    expected = [uninterrupted.process(f, i).index_value for i, f in enumerate(frames)]
    first = TopoMonitor(check_every=1, **AT_CADENCE)
    first.process(frames[0], 0)
    first.process(frames[1], 1)
    resumed = TopoMonitor(check_every=1, **AT_CADENCE)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.process(frames[2], 2).index_value == pytest.approx(expected[2])
    assert pickle.loads(pickle.dumps(first)).state_dict() == first.state_dict()


# --- settings ----------------------------------------------------------------------------------------------


def test_settings_overrides_and_a_settings_value_configure_the_same_monitor():
    settings = MonitorSettings().merged({"check_every": 7, "index": "rankme", "policy": {"patience": 2}, **AT_CADENCE})
    direct = TopoMonitor(check_every=7, index="rankme", policy={"patience": 2}, **AT_CADENCE)
    assert direct.settings == settings == TopoMonitor(settings, **AT_CADENCE).settings
    assert settings.schedule.check_every == 7
    assert settings.rule.patience == 2
    assert settings.rule.threshold == 4.5  # merged into the index's default rule
    assert TopoMonitor(settings, seed=3, **AT_CADENCE).settings.seed == 3  # overrides merge into a given value
    from_policy = TopoMonitor(policy=Policy(action="stop", score="value", threshold=0.9), **AT_CADENCE)
    assert (from_policy.policy.settings.action, from_policy.policy.settings.threshold) == ("stop", 0.9)
    assert MonitorSettings().merged(settings.as_dict()) == settings
    assert json.loads(json.dumps(settings.as_dict())) == settings.as_dict()


def test_an_unknown_option_gets_a_did_you_mean_and_a_policy_option_a_pointer():
    with pytest.raises(ConfigError, match=r"unknown argument `chek_every`; did you mean `check_every`\?"):
        TopoMonitor(chek_every=3, **AT_CADENCE)
    with pytest.raises(ConfigError, match=r"`threshold`: it is a policy option, pass policy=\{'threshold': ...\}"):
        TopoMonitor(threshold=3, **AT_CADENCE)
    with pytest.raises(ConfigError, match=r"unknown key `policy.patiense`; did you mean `policy.patience`\?"):
        TopoMonitor(policy={"patiense": 3}, **AT_CADENCE)


class RecordingActuator:
    def __init__(self):
        self.calls = []

    def scale_learning_rate(self, factor):
        self.calls.append(("scale", factor))
        return f"learning rate x {factor}"

    def request_stop(self):
        self.calls.append(("stop",))
        return "stop requested"

    def checkpoint_location(self, tag):
        return f"at {tag}"

    def save_checkpoint(self, tag):
        self.calls.append(("save", tag))


def test_a_stop_is_recorded_before_its_checkpoint_is_saved(tmp_path):
    monitor = TopoMonitor(
        check_every=1,
        index="paper",
        policy={"action": "stop", "threshold": 0.0, "patience": 1, "warmup": 1},
        **AT_CADENCE,
    )
    actuator = RecordingActuator()
    saved_history = []
    actuator.save_checkpoint = lambda tag: saved_history.append([r.kind for r in monitor.history])
    rng = np.random.default_rng(5)
    assert monitor.act(monitor.process(rng.normal(size=(40, 3)), 0), actuator) is None  # warm-up: nothing to do
    done = monitor.act(monitor.process(rng.normal(size=(40, 3)), 1), actuator)
    assert done.action == "stop"
    assert done.detail == "stop requested; checkpoint at topo-stop-step1"
    assert saved_history == [["check", "check", "intervention"]]  # the checkpoint holds the intervention


def test_paths_may_be_path_objects(tmp_path):
    monitor = TopoMonitor(
        check_every=1, history_path=tmp_path / "h.jsonl", tensorboard_dir=tmp_path / "tb", **AT_CADENCE
    )
    assert monitor.settings.output.history_path == str(tmp_path / "h.jsonl")  # kept as text: settings stay JSON
    monitor.process(np.random.default_rng(0).normal(size=(20, 3)), step=0)
    monitor.close()
    assert (tmp_path / "h.jsonl").read_text().count("\n") == 1
    with pytest.raises(InputError, match=r"`history_path` must be a path \(a non-empty string or os.PathLike\)"):
        TopoMonitor(history_path=3, **AT_CADENCE)
