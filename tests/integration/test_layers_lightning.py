"""Several layers watched by one Lightning callback in real ``Trainer.fit`` runs on CPU."""

import csv
import json
import pickle

import pytest

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE, TinyCNN, digits, digits_loader
from tests.integration.models import quiet_trainer as trainer
from topocallbacks import InputError, TopoMonitor
from topocallbacks.lightning import TopoCollapseCallback

PROBE, _ = digits(256)
LAYERS = ["backbone.1", "backbone.3"]  # the two ReLUs; the primary layer is avgpool


def checks(callback, layer=None):
    return [r for r in callback.history if r.kind == "check" and (layer is None or r.layer == layer)]


def test_every_layer_is_logged_under_its_name_at_each_check_with_a_csv_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", layers=LAYERS, check_every=10, **AT_CADENCE)
    fit = trainer(tmp_path, [callback], 20, logger=CSVLogger(str(tmp_path), name="run"), log_every_n_steps=50)
    fit.fit(TinyCNN(), digits_loader())
    assert callback.monitor.pipeline.layers == ["avgpool", *LAYERS]
    with open(f"{fit.logger.log_dir}/metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for layer in ["avgpool", *LAYERS]:
        logged = [(int(row["step"]), float(row[f"topo/{layer}/ci"])) for row in rows if row.get(f"topo/{layer}/ci")]
        assert logged == [(r.step, pytest.approx(r.report.ci)) for r in checks(callback, layer)]
        assert [step for step, _ in logged] == [0, 10, 20]
        betti = [float(row[f"topo/{layer}/betti0"]) for row in rows if row.get(f"topo/{layer}/betti0")]
        assert betti == [r.report.betti0 for r in checks(callback, layer)]
    assert not any(key.startswith("topo/ci") for key in rows[0])  # no unnamed topo/... values beside them
    # The callback metrics hold every layer's latest values; the progress bar shows the primary layer's index.
    assert {"topo/avgpool/index", "topo/backbone.1/index", "topo/backbone.3/index"} <= set(fit.callback_metrics)
    assert "topo/avgpool/index" in fit.progress_bar_metrics


def test_every_layer_reaches_tensorboard_and_equals_a_callback_on_that_layer_alone(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    several = TopoCollapseCallback(probe=PROBE, layer="avgpool", layers=LAYERS, check_every=10, **AT_CADENCE)
    fit = trainer(tmp_path, [several], 20, logger=TensorBoardLogger(str(tmp_path), name="run"))
    fit.fit(TinyCNN(), digits_loader())
    events = EventAccumulator(fit.logger.log_dir).Reload()
    alone = TopoCollapseCallback(probe=PROBE, layer="backbone.3", check_every=10, **AT_CADENCE)
    trainer(tmp_path / "alone", [alone], 20).fit(TinyCNN(), digits_loader())
    logged = events.Scalars("topo/backbone.3/betti0")
    assert [(e.step, e.value) for e in logged] == [(r.step, r.report.betti0) for r in checks(alone)]
    mine = checks(several, "backbone.3")
    assert [(r.report.betti0, r.report.betti1, r.index_value) for r in mine] == [
        (r.report.betti0, r.report.betti1, r.index_value) for r in checks(alone)
    ]


def test_an_any_rule_acts_once_per_check_and_resumes_with_every_layer(tmp_path):
    policy = {**OLD_RULE, "action": "lower_lr", "score": "value", "threshold": -1.0, "patience": 1, "warmup": 1}
    policy |= {"cooldown": 0, "max_lr_cuts": 5, "layer_rule": "any"}
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", layers=LAYERS, check_every=10, policy=policy, **AT_CADENCE
    )
    trainer(tmp_path, [callback], 30).fit(TinyCNN(lr=0.05), digits_loader())
    cuts = [r for r in callback.history if r.kind == "intervention"]
    # Every layer holds at every check after the warm-up: one cut per check, not one per layer.
    assert [(r.step, r.action) for r in cuts] == [(10, "lower_lr"), (20, "lower_lr"), (30, "lower_lr")]
    assert callback.monitor.lr_factor_ == pytest.approx(0.125)
    assert "the rule holds on 3 of 3 layers" in cuts[0].reason
    assert "layer that moved first:" in cuts[0].reason
    state = json.loads(json.dumps(callback.state_dict()))
    twin = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", layers=LAYERS, check_every=10, policy=policy, **AT_CADENCE
    )
    twin.load_state_dict(state)
    assert twin.state_dict() == state
    assert twin.monitor.pipeline.layers == ["avgpool", *LAYERS]
    assert twin.monitor.policy.lr_cuts_ == 3
    assert pickle.loads(pickle.dumps(twin)).state_dict() == state
    assert "layers" in callback.state_key


def test_bad_layers_fail_in_setup_with_close_matches(tmp_path):
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", layers=["backbone.1", "backbon.3"], check_every=10, **AT_CADENCE
    )
    with pytest.raises(
        InputError, match=r"`layers` entry 'backbon.3' is not a module of TinyCNN; closest: \['backbone.3'"
    ):
        trainer(tmp_path, [callback], 5).fit(TinyCNN(), digits_loader())
    with pytest.raises(InputError, match=r"`layers` \(\['avgpool'\]\) works in probe mode only"):
        TopoCollapseCallback(layers=["avgpool"], layer="avgpool", mode="stream", **AT_CADENCE)
    with pytest.raises(InputError, match=r"`layers` must be a non-empty list"):
        TopoCollapseCallback(probe=PROBE, layers=[], **AT_CADENCE)
    assert TopoMonitor(layers=["a", "b"], **AT_CADENCE).several


def test_a_resume_from_a_checkpoint_keeps_every_layer_and_never_refires(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    policy = {**OLD_RULE, "action": "lower_lr", "score": "value", "threshold": -1.0, "patience": 1, "warmup": 1}
    policy |= {"max_lr_cuts": 1, "after_max_lr_cuts": "none", "layer_rule": "any", "cooldown": 100}
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=20, save_top_k=-1)
    first = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", layers=LAYERS, check_every=10, policy=policy, **AT_CADENCE
    )
    trainer(tmp_path, [first, saver], 20, enable_checkpointing=True).fit(TinyCNN(), digits_loader())
    path = next((tmp_path / "ckpt").glob("*step=20*.ckpt"))
    second = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", layers=LAYERS, check_every=10, policy=policy, **AT_CADENCE
    )
    trainer(tmp_path, [second], 40).fit(TinyCNN(), digits_loader(), ckpt_path=str(path))
    for layer in ["avgpool", *LAYERS]:
        assert [r.step for r in checks(second, layer)] == [0, 10, 20, 30, 40]  # step 20 not checked twice
        assert [r.index_value for r in checks(second, layer)][:3] == [r.index_value for r in checks(first, layer)]
    assert [r.step for r in second.history if r.kind == "intervention"] == [10]  # the cut came back, not made again
    assert second.monitor.lr_factor_ == 0.5
