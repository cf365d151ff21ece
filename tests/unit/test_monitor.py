import json
import pickle

import numpy as np
import pytest
import torch

from topocallbacks import InputError, Policy, TopoMonitor
from topocallbacks import functional as F
from topocallbacks.sinks import JsonlSink


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
    monitor = TopoMonitor(probe=x[:300], layer="3", check_every=10, history_path=str(tmp_path / "history.jsonl"))
    for step in range(31):
        batch = torch.randint(0, len(x), (32,))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if monitor.should_check(step):
            monitor.check(model, step)
    checks = [r for r in monitor.history if r["kind"] == "check"]
    assert [r["step"] for r in checks] == [0, 10, 20, 30]
    assert all(0.0 <= r["ci"] <= 1.0 and r["status"] == "ok" for r in checks)
    assert JsonlSink.read(tmp_path / "history.jsonl") == json.loads(json.dumps(monitor.history))
    # The record matches the functional index on the same (normalised) features at the calibrated ε.
    features = monitor.features(model).astype(np.float64)
    centred = features - features.mean(axis=0)
    cloud = centred / np.sqrt(np.mean(np.sum(centred**2, axis=1)))
    expected = F.collapse_index(cloud, epsilon=monitor.epsilon_, max_points=monitor.max_points, seed=0)
    assert checks[-1]["ci"] == pytest.approx(expected.ci)
    assert (checks[-1]["betti0"], checks[-1]["betti1"]) == (expected.betti0, expected.betti1)


def test_normalisation_makes_the_index_blind_to_feature_scale():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 8))
    monitor = TopoMonitor(check_every=1)
    first = monitor.process(features, 0)
    shrunk = monitor.process(features * 1e-3, 1)
    assert shrunk["ci"] == pytest.approx(first["ci"])
    raw = TopoMonitor(check_every=1, normalize=False)
    raw.process(features, 0)
    assert raw.process(features * 1e-3, 1)["betti0"] == 1  # everything within the old ε: one blob


def test_diverged_features_are_logged_and_trigger_the_configured_action(tmp_path):
    monitor = TopoMonitor(policy=Policy(action="warn", on_diverged="stop"), history_path=str(tmp_path / "h.jsonl"))
    monitor.process(np.random.default_rng(0).normal(size=(50, 4)), 0)
    broken = np.full((50, 4), np.nan)
    record = monitor.process(broken, 100)
    assert record["status"] == "diverged"
    assert record["ci"] is None
    assert record["decision"]["action"] == "stop"
    assert record["decision"]["rule"] == "diverged"
    assert JsonlSink.read(tmp_path / "h.jsonl")[-1]["status"] == "diverged"


@pytest.mark.parametrize("projection", ["pca", "random"])
def test_projection_is_fitted_once_and_kept(projection):
    rng = np.random.default_rng(1)
    monitor = TopoMonitor(projection=projection, projection_dim=5, check_every=1)
    first = rng.normal(size=(80, 20))
    monitor.process(first, 0)
    kept = json.dumps(monitor.state_dict()["transform"])
    monitor.process(rng.normal(size=(80, 20)) * 3, 1)
    assert json.dumps(monitor.state_dict()["transform"]) == kept
    with pytest.raises(InputError, match="`features` must keep dimension 20 between checks, got 7"):
        monitor.process(rng.normal(size=(80, 7)), 2)


def test_streaming_mode_watches_a_window_of_training_batches():
    rng = np.random.default_rng(2)
    monitor = TopoMonitor(mode="stream", window=128, check_every=4)
    records = [monitor.observe(rng.normal(size=(16, 6)), step) for step in range(12)]
    assert [r is not None for r in records] == [step % 4 == 0 for step in range(12)]
    assert records[8]["n_points"] == 128
    assert records[8]["engine_path"] in {"vertex", "rebuild"}
    with pytest.raises(InputError, match="observe\\(\\) is for streaming mode"):
        TopoMonitor().observe(np.zeros((4, 2)), 0)


def test_state_round_trip_keeps_epsilon_history_and_policy(tmp_path):
    model, x, _ = digits_mlp()
    settings = {
        "probe": x[:100],
        "layer": "1",
        "policy": Policy(action="lower_lr", threshold=0.0, patience=1, warmup=1),
    }
    monitor = TopoMonitor(**settings)
    monitor.check(model, 0)
    decision_record = monitor.check(model, 100)
    assert decision_record["decision"]["action"] == "lower_lr"
    from topocallbacks.policy import Decision

    monitor.record_intervention(100, Decision.from_dict(decision_record["decision"]), "param groups scaled")
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = TopoMonitor(**{**settings, "policy": Policy(action="lower_lr", threshold=0.0, patience=1, warmup=1)})
    restored.load_state_dict(state)
    assert restored.epsilon_ == monitor.epsilon_
    assert restored.history == monitor.history
    assert restored.lr_factor_ == 0.5
    assert restored.policy == monitor.policy
    assert restored.check(model, 200)["ci"] == pytest.approx(monitor.check(model, 200)["ci"])
    twin = pickle.loads(pickle.dumps(monitor))
    assert twin.history == monitor.history
    other_probe = TopoMonitor(probe=x[100:200], layer="1")
    with pytest.raises(InputError, match="the probe differs"):
        other_probe.load_state_dict(state)


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = TopoMonitor(tensorboard_dir=str(tmp_path / "tb"), diagram_every=1, check_every=1)
    rng = np.random.default_rng(3)
    for step in range(3):
        monitor.process(rng.normal(size=(60, 4)), step * 10)
    monitor.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0}).Reload()
    scalars = events.Tags()["scalars"]
    for name in ["topo/ci", "topo/betti0", "topo/betti1", "topo/epsilon", "topo/check_ms", "topo/anisotropy_term"]:
        assert name in scalars
    assert [e.step for e in events.Scalars("topo/ci")] == [0, 10, 20]
    assert [e.value for e in events.Scalars("topo/ci")] == pytest.approx([r["ci"] for r in monitor.history])
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
        ({"check_every": 0}, "`check_every` must be an integer >= 1, got 0"),
        ({"check_every": -5}, "`check_every` must be an integer >= 1, got -5"),
        ({"window": 1}, "`window` must be an integer >= 2, got 1"),
        ({"projection": "umap"}, "`projection` must be one of"),
        ({"epsilon": -1.0}, "`epsilon` must be a finite number > 0, got -1.0"),
        ({"epsilon_quantile": 1.5}, r"`epsilon_quantile` must be a finite number in \(0, 1\], got 1.5"),
        ({"policy": "strict"}, "`policy` must be a topocallbacks.policy.Policy, got str"),
        ({"probe": torch.zeros(4, 2)}, "`layer` is required with a `probe`"),
        ({"probe": torch.zeros(0, 2), "layer": "x"}, "`probe` is empty"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        TopoMonitor(**kwargs)


# --- the watched index (diagram drift by default, chosen by benchmarks/collapse) -------------------------------


def test_default_index_is_diagram_drift_and_matches_the_functional_definition():
    rng = np.random.default_rng(0)
    frames = [rng.normal(size=(120, 6)) for _ in range(3)]
    monitor = TopoMonitor(check_every=1)
    assert monitor.index == "diagram_drift"
    assert monitor.policy.score == "zscore"
    assert monitor.policy.threshold == 4.5
    assert monitor.policy.warmup == 10
    records = [monitor.process(frame, step) for step, frame in enumerate(frames)]
    assert records[0]["index"] == "diagram_drift"
    assert records[0]["index_value"] == 0.0  # nothing to drift from at the first check
    previous = None
    for frame, record in zip(frames, records, strict=True):
        centred = frame - frame.mean(axis=0)
        cloud = centred / np.sqrt(np.mean(np.sum(centred**2, axis=1)))
        sample = cloud  # 120 points: below max_points, no subsample
        diagrams = F.persistence_diagrams(sample, threshold=F.longest_mst_edge(sample))
        if previous is not None:
            expected = sum(F.diagram_distance(a, b) for a, b in zip(previous, diagrams, strict=True))
            assert record["index_value"] == pytest.approx(expected)
            assert record["decision"]["ci"] == pytest.approx(expected)  # what the policy saw
        previous = diagrams
    assert records[1]["index_value"] > 0


def test_rankme_is_handed_to_the_policy_negated_and_paper_keeps_the_threshold_policy():
    features = np.random.default_rng(1).normal(size=(100, 5))
    rankme = TopoMonitor(check_every=1, index="rankme")
    record = rankme.process(features, 0)
    assert record["index_value"] == pytest.approx(F.effective_rank(features - features.mean(axis=0)))
    assert record["decision"]["ci"] == pytest.approx(-record["index_value"])
    paper = TopoMonitor(check_every=1, index="paper")
    record = paper.process(features, 0)
    assert record["index_value"] == record["ci"]
    assert paper.policy.score == "value"
    assert paper.policy.threshold == 0.7
    with pytest.raises(InputError, match=r"`index` must be one of \['diagram_drift', 'paper', 'rankme'\], got 'ci'"):
        TopoMonitor(index="ci")


def test_drift_state_survives_a_round_trip_so_a_resume_continues_the_drift():
    rng = np.random.default_rng(2)
    frames = [rng.normal(size=(80, 4)) for _ in range(3)]
    uninterrupted = TopoMonitor(check_every=1)
    expected = [uninterrupted.process(f, i)["index_value"] for i, f in enumerate(frames)]
    first = TopoMonitor(check_every=1)
    first.process(frames[0], 0)
    first.process(frames[1], 1)
    resumed = TopoMonitor(check_every=1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.process(frames[2], 2)["index_value"] == pytest.approx(expected[2])
    assert pickle.loads(pickle.dumps(first)).state_dict() == first.state_dict()
