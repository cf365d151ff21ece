"""Several layers watched in one probe pass: ``TopoMonitor(layers=[...])``."""

import json
import pickle

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from tests.cadence import AT_CADENCE
from tests.unit.rules import old_rule
from topocallbacks import InputError, TopoMonitor
from topocallbacks.exceptions import ConfigError
from topocallbacks.interventions import LoopActuator
from topocallbacks.pipeline import LayeredPipeline
from topocallbacks.presets import load
from topocallbacks.probe import resolve_layers
from topocallbacks.settings import MonitorSettings

DIGITS = load_digits()
X = torch.tensor(DIGITS.data / 16.0, dtype=torch.float32)
Y = torch.tensor(DIGITS.target)
PROBE = X[:128]
LAYERS = ["0", "2", "4"]


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 24),
        torch.nn.ReLU(),
        torch.nn.Linear(24, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 10),
    )


def train(model: torch.nn.Module, steps: int, offset: int = 0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(offset, offset + steps):
        batch = slice((step * 64) % 1600, (step * 64) % 1600 + 64)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(X[batch]), Y[batch]).backward()
        optimizer.step()


def checks(monitor: TopoMonitor, layer: str | None = None) -> list:
    return [r for r in monitor.history if r.kind == "check" and (layer is None or r.layer == layer)]


def summary(record) -> tuple:
    report = record.report
    return record.step, report.betti0, report.betti1, report.epsilon, report.ci, record.index_value, record.n_points


def test_one_probe_forward_per_check_whatever_the_number_of_layers():
    model = mlp()
    calls = {"model": 0, "head": 0}
    model.register_forward_pre_hook(lambda *_: calls.__setitem__("model", calls["model"] + 1))
    model[6].register_forward_pre_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))
    monitor = TopoMonitor(probe=PROBE, layers=LAYERS, check_every=1, batch_size=64, **AT_CADENCE)
    for step in range(3):
        records = monitor.on_step(step, model=model)
        assert [r.layer for r in records] == ["2", "4", "0"]  # the primary layer's record (the first) comes last
    assert calls == {"model": 3 * 2, "head": 0}  # 2 probe batches per check; the pass stops at layer 4
    assert monitor.several
    assert monitor.pipeline.layers == LAYERS


def test_each_layer_is_what_a_monitor_of_that_layer_alone_computes():
    model = mlp()
    rule = old_rule(warmup=1)  # the index alone: the records' decisions are the index rule's
    several = TopoMonitor(probe=PROBE, layers=LAYERS, check_every=5, policy=rule, **AT_CADENCE)
    alone = {layer: TopoMonitor(probe=PROBE, layer=layer, check_every=5, policy=rule, **AT_CADENCE) for layer in LAYERS}
    for step in range(0, 16):
        several.on_step(step, model=model)
        for monitor in alone.values():
            monitor.on_step(step, model=model)
        train(model, 1, step)
    for layer, monitor in alone.items():
        mine = checks(several, layer)
        assert [summary(r) for r in mine] == [summary(r) for r in checks(monitor)]  # the same features: exactly
        assert [r.step for r in mine] == [0, 5, 10, 15]
        assert all(r.index_value is not None and r.index_value > 0 for r in mine[1:])  # training moved them
    # The primary layer's decisions are exactly its own monitor's (layer_rule "primary").
    primary = [r.decision.as_dict() for r in checks(several, "0")]
    assert primary == [r.decision.as_dict() for r in checks(alone["0"])]
    assert several.epsilon_ == alone["0"].epsilon_


def clouds(collapses: dict[str, set[int]], steps: int = 8, kind: str = "line") -> list[dict[str, np.ndarray]]:
    """Two layers' features per check: ``a`` and ``b`` the same points, but collapsed onto a line (``kind`` "line": a
    collapse the one-direction sentinel sees) or moved to other points ("moved": only the index sees it) at the checks
    ``collapses`` names for each (diagram drift is the smaller distance to the previous check or to the last one
    that was not flagged, so a layer back to its points has no drift)."""
    rng = np.random.default_rng(0)
    still = {"a": rng.normal(size=(60, 5)), "b": rng.normal(size=(60, 7))}
    line = rng.normal(size=(60, 1)) * np.ones((1, 7))
    if kind == "moved":
        line = rng.normal(size=(60, 7))
    collapsed = {"a": line[:, :5], "b": line}
    return [{k: (collapsed[k] if i in collapses.get(k, set()) else v) for k, v in still.items()} for i in range(steps)]


RULE = old_rule(score="value", threshold=1e-6, patience=1, warmup=2, cooldown=0)


@pytest.mark.parametrize(("kind", "rule"), [("moved", "threshold"), ("line", "sentinel")])
@pytest.mark.parametrize(("layer_rule", "fires"), [("primary", False), ("any", True), (2, False), ("all", False)])
def test_a_move_on_a_non_primary_layer_acts_only_under_any(layer_rule, fires, kind, rule):
    monitor = TopoMonitor(layers=["a", "b"], policy={**RULE, "layer_rule": layer_rule}, **AT_CADENCE)
    records = [monitor.process(features, step) for step, features in enumerate(clouds({"b": {5}}, kind=kind))]
    assert {r.layer for r in records} == {"a"}  # process() returns the primary layer's record
    held = [(r.step, r.decision.rule) for r in checks(monitor, "b") if r.decision.rule is not None]
    assert held == [(5, rule)]  # layer b's own rule held at the move, whatever the layer rule
    assert all(not r.decision.fired for r in checks(monitor, "b"))  # a layer's own verdict never acts
    fired = [r for r in records if r.decision.fired]
    assert [r.step for r in fired] == ([5] if fires else [])
    if fires:
        reason = fired[0].decision.reason
        assert "the rule holds on 1 of 2 layers (b; layer_rule 'any')" in reason
        assert "layer that moved first: b 0 -> " in reason  # b's drift from 0, then a, which stayed at 0
        assert "; then a 0 -> 0 (+0" in reason
        assert fired[0].decision.action.value == "warn"
        assert fired[0].decision.onset == 5


def test_two_layers_moving_at_one_check_cut_the_learning_rate_once():
    monitor = TopoMonitor(layers=["a", "b"], policy={**RULE, "action": "lower_lr", "layer_rule": "any"}, **AT_CADENCE)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    actuator = LoopActuator(optimizer)  # no model: no snapshots for a stop to restore, said once

    def run():
        for step, cloud in enumerate(clouds({"a": {4}, "b": {4}})):  # both layers collapse at step 4
            monitor.process(cloud, step)
            for record in [r for r in checks(monitor) if r.step == step]:
                monitor.act(record, actuator)

    with pytest.warns(RuntimeWarning, match="keeps no rollback snapshots: `rollback` needs the model"):
        run()
    cuts = [r for r in monitor.history if r.kind == "intervention"]
    assert [(r.step, r.action) for r in cuts] == [(4, "lower_lr")]
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert monitor.policy.lr_cuts_ == 1
    assert "the rule holds on 2 of 2 layers (a, b" in cuts[0].reason


def test_k_of_n_needs_k_layers():
    monitor = TopoMonitor(layers=["a", "b"], policy={**RULE, "layer_rule": 2}, **AT_CADENCE)
    for step, cloud in enumerate(clouds({"a": {5}, "b": {3, 5}}, steps=6)):
        record = monitor.process(cloud, step)
        assert record.decision.fired == (step == 5)
    assert "(2 required)" in checks(monitor, "a")[3].decision.reason  # step 3: only b held


def test_resume_keeps_every_layer_state_and_continues_identically():
    model = mlp()
    settings = MonitorSettings().merged({"layers": LAYERS, "check_every": 4, "policy": old_rule(warmup=1)})
    straight = TopoMonitor(settings, probe=PROBE, **AT_CADENCE)
    first = TopoMonitor(settings, probe=PROBE, **AT_CADENCE)
    for step in range(0, 9):
        straight.on_step(step, model=model)
        first.on_step(step, model=model)
        train(model, 1, step)
    state = json.loads(json.dumps(first.state_dict()))
    assert set(state["pipeline"]["layers"]["states"]) == set(LAYERS)
    resumed = TopoMonitor(settings, probe=PROBE, **AT_CADENCE)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert resumed.pipeline.layers == LAYERS
    assert resumed.epsilon_ == first.epsilon_
    for step in range(9, 17):
        straight.on_step(step, model=model)
        resumed.on_step(step, model=model)
        train(model, 1, step)
    assert [summary(r) for r in checks(resumed)] == [summary(r) for r in checks(straight)]
    assert [r.decision.as_dict() for r in checks(resumed)] == [r.decision.as_dict() for r in checks(straight)]
    clone = pickle.loads(pickle.dumps(resumed))
    assert clone.state_dict() == resumed.state_dict()


def test_a_state_of_other_layers_is_refused():
    first = TopoMonitor(layers=["a", "b"], **AT_CADENCE)
    first.process(clouds({}, steps=1)[0], 0)
    other = TopoMonitor(layers=["a", "c"], **AT_CADENCE)
    other.process({"a": np.ones((5, 2)) * np.arange(5)[:, None], "c": np.arange(10.0).reshape(5, 2)}, 0)
    with pytest.raises(InputError, match=r"the saved state watched layers \['a', 'b'\], this monitor watches"):
        other.load_state_dict(first.state_dict())


def test_background_checks_give_the_records_of_checks_in_the_loop():
    model = mlp()
    inline = TopoMonitor(probe=PROBE, layers=LAYERS, check_every=3, background=False, **AT_CADENCE)
    behind = TopoMonitor(probe=PROBE, layers=LAYERS, check_every=3, background=True, lag=1, **AT_CADENCE)
    try:
        for step in range(8):
            inline.on_step(step, model=model)
            behind.on_step(step, model=model)
            train(model, 1, step)
        behind.finish()
    finally:
        behind.close()
    assert [(r.layer, r.applied_step) for r in checks(behind)][:3] == [("2", 1), ("4", 1), ("0", 1)]
    assert [summary(r) for r in checks(behind)] == [summary(r) for r in checks(inline)]


def test_patterns_and_preset_shortcuts():
    transformers = pytest.importorskip("transformers")
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50))
    probe = load("gpt").settings.probe
    assert resolve_layers(gpt, ["all_blocks"], primary=probe.layer, shortcuts=probe.shortcuts) == [
        "transformer.ln_f",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
    ]
    assert resolve_layers(gpt, ["transformer.h.*"]) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=50
        )
    )
    probe = load("llama").settings.probe
    assert resolve_layers(llama, ["all_blocks"], primary=probe.layer, shortcuts=probe.shortcuts) == [
        "model.norm",
        "model.layers.0",
        "model.layers.1",
    ]
    for name in ("resnet", "vit"):
        assert load(name).settings.probe.shortcuts["all_blocks"]
    # A preset's shortcut, end to end: one pass over a real (tiny) GPT-2 watches ln_f and every block.
    ids = torch.randint(0, 50, (24, 6), generator=torch.Generator().manual_seed(0))
    monitor = TopoMonitor(
        load("gpt").settings, probe={"input_ids": ids}, layers=["all_blocks"], max_probe_samples=None, **AT_CADENCE
    )
    records = monitor.on_step(0, model=gpt)
    assert [r.layer for r in records] == ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.ln_f"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"layers": []}, r"`layers` must be a non-empty list of module names, name patterns or preset shortcuts"),
        ({"layers": ["a", "b", "a"]}, r"`layers` names 'a' twice: \['a', 'b', 'a'\]"),
        ({"layers": ["a", 3]}, r"`layers` must be a non-empty list"),
        ({"layers": ["a", "b"], "policy": {"layer_rule": "most"}}, r"`policy.layer_rule` must be one of"),
        ({"layers": ["a", "b"], "policy": {"layer_rule": 0}}, r"`policy.layer_rule` must be one of .* got 0"),
        ({"policy": {"layer_rule": "any"}}, r"`policy.layer_rule` 'any' needs several layers: pass `layers=\[...\]`"),
        ({"layers": ["a", "b"], "mode": "stream"}, r"`layers` \(\['a', 'b'\]\) works in probe mode only"),
        ({"shortcuts": {"blocks": []}}, r"`shortcuts.blocks` must be a module name or a non-empty list"),
    ],
)
def test_bad_arguments_are_refused_with_their_name_and_value(overrides, match):
    with pytest.raises(InputError, match=match):
        TopoMonitor(**overrides, **AT_CADENCE)


def test_bad_layers_are_refused_at_the_first_check_with_close_matches():
    model = mlp()
    with pytest.raises(InputError, match=r"`layers` entry '9' is not a module of Sequential; some names: \['0', '1'"):
        TopoMonitor(probe=PROBE, layers=["0", "9"], **AT_CADENCE).check(model, 0)
    with pytest.raises(InputError, match=r"`layers` entries '\[02\]' and '2' both designate module '2'"):
        TopoMonitor(probe=PROBE, layers=["[02]", "2"], **AT_CADENCE).check(model, 0)
    with pytest.raises(InputError, match=r"`layers` pattern 'x\*' matches no module of Sequential"):
        TopoMonitor(probe=PROBE, layers=["0", "x*"], **AT_CADENCE).resolve_layers(model)
    with pytest.raises(InputError, match=r"`policy.layer_rule` is 3, but 2 layers are watched"):
        TopoMonitor(probe=PROBE, layers=["0", "2"], policy={"layer_rule": 3}, **AT_CADENCE).check(model, 0)
    with pytest.raises(InputError, match=r"`layers` must designate at least 2 layers to watch several, got \['0'\]"):
        TopoMonitor(probe=PROBE, layers=["0"], **AT_CADENCE).check(model, 0)
    with pytest.raises(InputError, match=r"pass the features as a mapping \{layer: \(n, d\) array\}"):
        TopoMonitor(layers=["a", "b"], **AT_CADENCE).process(np.zeros((4, 2)), 0)
    with pytest.raises(ConfigError, match=r"unknown argument `layer_rule`: it is a policy option"):
        TopoMonitor(layers=["a", "b"], layer_rule="any", **AT_CADENCE)


def test_the_primary_layer_comes_first_and_is_listed_once():
    model = mlp()
    monitor = TopoMonitor(probe=PROBE, layer="4", layers=["[024]"], **AT_CADENCE)
    assert monitor.resolve_layers(model) == ["4", "0", "2"]
    record = monitor.check(model, 0)
    assert record.layer == "4"
    assert monitor.pipeline.primary == "4"
    assert "at 3 layers (4, 0, 2; primary 4)" in monitor.summary()
    assert isinstance(monitor.pipeline, LayeredPipeline)


def test_a_rollback_restores_once_and_rewinds_every_layer():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    actuator = LoopActuator(optimizer, model=model)
    monitor = TopoMonitor(layers=["a", "b"], policy={**RULE, "action": "rollback", "layer_rule": "any"}, **AT_CADENCE)
    weights = {}
    for step, cloud in enumerate(clouds({"b": {5}})):
        with torch.no_grad():
            model.weight.fill_(float(step))  # the state a rollback must bring back
        monitor.process(cloud, step)
        for record in [r for r in checks(monitor) if r.step == step]:
            monitor.act(record, actuator)
        weights[step] = model.weight.flatten().tolist()
    rollbacks = [r for r in monitor.history if r.kind == "intervention"]
    assert [(r.step, r.action, r.snapshot_step, r.steps_lost) for r in rollbacks] == [(5, "rollback", 4, 1)]
    assert weights[5] == [4.0, 4.0]  # step 4's state, restored once at step 5
    steps = [snapshot.step for snapshot in monitor.snapshots.snapshots]
    assert len(steps) == len(set(steps))  # one snapshot per healthy check, not one per layer
    # Every layer measures drift against its own snapshot diagrams again: b is back to its points at step 6.
    assert [r.index_value for r in checks(monitor, "b") if r.step >= 6] == [0.0, 0.0]


def test_the_report_of_several_layers_draws_the_primary_layers_diagrams(tmp_path):
    pytest.importorskip("matplotlib")
    monitor = TopoMonitor(layers=["a", "b"], policy={**RULE, "layer_rule": "any"}, **AT_CADENCE)
    for step, cloud in enumerate(clouds({"b": {5}}, steps=7)):
        monitor.process(cloud, step)
    page = monitor.report(tmp_path).read_text()
    for figure in ("heatmap_index.png", "heatmap_ci.png", "diagrams.png", "composite_0.png", "composite_1.png"):
        assert (tmp_path / figure).is_file()
    assert "layer that moved first: b 0 -&gt; 23.3" in page  # the warning's reason, in its diagnosis
