"""Several layers watched by one Hugging Face callback in real ``Trainer.train`` runs on CPU."""

import json
import pickle

import pytest
from transformers import Trainer

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE
from tests.integration.test_hf import PROBE, DigitsNet, arguments, digits_dataset
from topocallbacks import InputError, TopoMonitor
from topocallbacks.hf import TopoCollapseTrainerCallback

LAYERS = ["encoder.0", "head"]  # the primary layer is encoder (its ReLU output)


def checks(callback, layer=None):
    return [r for r in callback.history if r.kind == "check" and (layer is None or r.layer == layer)]


def interventions(callback):
    return [r for r in callback.history if r.kind == "intervention"]


def test_every_layer_reaches_report_to_under_its_name(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", layers=LAYERS, check_every=5, **AT_CADENCE)
    args = arguments(tmp_path, report_to="tensorboard", logging_strategy="no")
    trainer = Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[callback])
    trainer.train()
    assert callback.monitor.pipeline.layers == ["encoder", *LAYERS]
    for layer in ["encoder", *LAYERS]:
        logged = [entry for entry in trainer.state.log_history if f"topo/{layer}/ci" in entry]
        assert [(entry["step"], entry[f"topo/{layer}/betti0"]) for entry in logged] == [
            (r.step, r.report.betti0) for r in checks(callback, layer)
        ]
        assert [entry["step"] for entry in logged] == [0, 5, 10]
    assert not any("topo/ci" in entry for entry in trainer.state.log_history)  # only the named layers' values
    events = EventAccumulator(str(next((tmp_path / "runs").iterdir()))).Reload()
    assert {"train/topo/encoder/ci", "train/topo/encoder.0/index", "train/topo/head/betti1"} <= set(
        events.Tags()["scalars"]
    )
    assert [e.value for e in events.Scalars("train/topo/head/ci")] == pytest.approx(
        [r.report.ci for r in checks(callback, "head")]
    )


def test_each_layer_equals_a_callback_on_that_layer_alone(tmp_path):
    several = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", layers=LAYERS, check_every=5, **AT_CADENCE)
    Trainer(model=DigitsNet(), args=arguments(tmp_path), train_dataset=digits_dataset(), callbacks=[several]).train()
    alone = TopoCollapseTrainerCallback(probe=PROBE, layer="head", check_every=5, **AT_CADENCE)
    args = arguments(tmp_path / "alone")
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[alone]).train()
    assert [(r.step, r.report.betti0, r.report.betti1, r.index_value) for r in checks(several, "head")] == [
        (r.step, r.report.betti0, r.report.betti1, r.index_value) for r in checks(alone)
    ]


def test_an_any_rule_acts_once_per_check_and_a_resume_keeps_every_layer(tmp_path):
    policy = {**OLD_RULE, "action": "lower_lr", "score": "value", "threshold": -1.0, "patience": 1, "warmup": 1}
    policy |= {"max_lr_cuts": 1, "after_max_lr_cuts": "none", "layer_rule": "any"}
    first = TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", layers=LAYERS, check_every=2, policy=policy, **AT_CADENCE
    )
    args = arguments(tmp_path, max_steps=8, save_strategy="steps", save_steps=4)
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[first]).train()
    assert [(r.step, r.action) for r in interventions(first)] == [(2, "lower_lr")]  # once, not once per layer
    assert "the rule holds on 3 of 3 layers" in interventions(first)[0].reason

    fresh = TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", layers=LAYERS, check_every=2, policy=policy, **AT_CADENCE
    )
    trainer = Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[fresh])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert [r.step for r in checks(fresh, "head")] == [0, 2, 4, 6, 8]
    assert [r.step for r in checks(fresh, "encoder")] == [0, 2, 4, 6, 8]
    assert [r.step for r in interventions(fresh)] == [2]  # the cut count came back: no new cut at step 6
    assert fresh.monitor.lr_factor_ == 0.5
    mine = [r.index_value for r in checks(fresh, "encoder.0")][:3]
    assert mine == [r.index_value for r in checks(first, "encoder.0")][:3]
    state = json.loads(json.dumps(fresh.state()))
    assert state["args"]["settings"]["probe"]["layers"] == LAYERS
    assert pickle.loads(pickle.dumps(fresh)).monitor.state_dict() == fresh.monitor.state_dict()


def test_bad_layers_fail_when_training_begins(tmp_path):
    callback = TopoCollapseTrainerCallback(probe=PROBE, layers=["encoder.0", "haed"], check_every=5, **AT_CADENCE)
    trainer = Trainer(model=DigitsNet(), args=arguments(tmp_path), train_dataset=digits_dataset(), callbacks=[callback])
    with pytest.raises(InputError, match=r"`layers` entry 'haed' is not a module of DigitsNet; closest: \['head'\]"):
        trainer.train()
    with pytest.raises(InputError, match=r"`policy.layer_rule` 'any' needs several layers"):
        TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", policy={"layer_rule": "any"}, **AT_CADENCE)
    assert TopoMonitor(layers=["a", "b"], **AT_CADENCE).several
