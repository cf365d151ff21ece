import itertools
import json
import os
import pickle
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE, TinyCNN, digits, digits_loader
from tests.integration.models import quiet_trainer as trainer
from topocallbacks import InputError, Policy
from topocallbacks.functional.collapse import DEGREE_BAND
from topocallbacks.lightning import TopoCollapseCallback

PROBE, _ = digits(256)


class LearningRates(pl.Callback):
    """Records the learning rate in effect after every optimizer step."""

    def __init__(self):
        self.rates = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rates[trainer.global_step] = [g["lr"] for g in trainer.optimizers[0].param_groups]


def checks(callback):
    return [r for r in callback.history if r.kind == "check"]


def interventions(callback):
    return [r for r in callback.history if r.kind == "intervention"]


def old_rule(**settings):
    """A policy on the old default rule (the index alone, see ``OLD_RULE``) with ``settings`` on top."""
    return Policy(**{**OLD_RULE, **settings})


def always(action, **kwargs):
    """A policy that fires at every check after a one-check warm-up."""
    return old_rule(action=action, score="value", threshold=-1.0, patience=1, warmup=1, cooldown=0, **kwargs)


def blow_up_policy(action):
    # The paper composite with a baseline-relative threshold (these tests pin index="paper"); the default index
    # and rule have their own test below. The blow-up kills the ReLUs (constant features from step 60): the absolute
    # sentinels would name that first, so they are off here and the paper index's own rule is what acts.
    return old_rule(action=action, threshold=0.15, score="baseline", patience=2, warmup=2, cooldown=5, sentinels=False)


def test_checks_run_every_n_steps_are_logged_and_leave_the_module_training(tmp_path):
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=10, history_path=str(tmp_path / "h.jsonl"), **AT_CADENCE
    )
    model = TinyCNN()
    fit = trainer(tmp_path, [callback], max_steps=30)
    fit.fit(model, digits_loader())
    assert [r.step for r in checks(callback)] == [0, 10, 20, 30]
    assert all(0.0 <= r.report.ci <= 1.0 for r in checks(callback))
    metrics = fit.callback_metrics
    for name in ["topo/ci", "topo/betti0", "topo/betti1", "topo/anisotropy", "topo/epsilon", "topo/check_ms"]:
        assert name in metrics
    assert float(metrics["topo/ci"]) == pytest.approx(checks(callback)[-1].report.ci)
    assert model.training
    assert (tmp_path / "h.jsonl").read_text().count("\n") == 4


def test_an_induced_lr_blow_up_warns(tmp_path):
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=10, index="paper", policy=blow_up_policy("warn"), **AT_CADENCE
    )
    with pytest.warns(RuntimeWarning, match=r"topocallbacks at step \d+: index - baseline .* >= threshold 0.15"):
        trainer(tmp_path, [callback], max_steps=120).fit(
            TinyCNN(lr=0.02, scheduler="ramp", lr_growth=1.1), digits_loader()
        )
    first = interventions(callback)[0]
    assert first.action == "warn"
    healthy = [r for r in checks(callback) if r.step <= 40]
    assert all(r.decision.action.value == "none" for r in healthy)


def test_an_induced_lr_blow_up_stops_the_run_with_a_checkpoint(tmp_path):
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=10, index="paper", policy=blow_up_policy("stop"), **AT_CADENCE
    )
    fit = trainer(tmp_path, [callback], max_steps=300)
    fit.fit(TinyCNN(lr=0.02, scheduler="ramp", lr_growth=1.1), digits_loader())
    stop = interventions(callback)[-1]
    assert stop.action == "stop"
    assert fit.global_step == stop.step < 300
    assert f"checkpoint saved to {tmp_path}" in stop.detail
    saved = torch.load(tmp_path / f"topo-stop-step{stop.step}.ckpt", weights_only=False)
    assert saved["global_step"] == stop.step


def test_a_stop_from_another_callback_is_never_cleared(tmp_path):
    class StopAt5(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 5:
                trainer.should_stop = True

    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=5, **AT_CADENCE)
    fit = trainer(tmp_path, [StopAt5(), callback], max_steps=50)
    fit.fit(TinyCNN(), digits_loader())
    assert fit.global_step == 5


@pytest.mark.parametrize("scheduler", ["cosine", "warmup", "onecycle", "plateau"])
def test_the_learning_rate_stays_cut_after_the_scheduler_steps(tmp_path, scheduler):
    cut_policy = old_rule(
        action="lower_lr",
        score="value",
        threshold=-1.0,
        patience=1,
        warmup=1,
        cooldown=100,
        lr_factor=0.5,
        max_lr_cuts=1,
        after_max_lr_cuts="none",  # the rule holds at every check: one cut, then nothing (a stop would go through)
    )
    reference, cut = LearningRates(), LearningRates()
    trainer(tmp_path / "ref", [reference], max_steps=25).fit(
        TinyCNN(scheduler=scheduler, total_steps=25), digits_loader()
    )
    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, policy=cut_policy, **AT_CADENCE)
    trainer(tmp_path / "cut", [callback, cut], max_steps=25).fit(
        TinyCNN(scheduler=scheduler, total_steps=25), digits_loader()
    )
    assert [r.step for r in interventions(callback)] == [10]
    for step in range(10, 26):  # from the cut on, including 5+ steps later, at half the reference rate
        assert cut.rates[step] == pytest.approx([0.5 * lr for lr in reference.rates[step]], rel=1e-6), step
    assert cut.rates[9] == pytest.approx(reference.rates[9])


def test_a_background_check_cuts_the_learning_rate_at_the_announced_step(tmp_path):
    policy = old_rule(
        action="lower_lr",
        score="value",
        threshold=-1.0,
        patience=1,
        warmup=1,
        lr_factor=0.5,
        max_lr_cuts=1,
        after_max_lr_cuts="none",
    )
    reference, cut = LearningRates(), LearningRates()
    trainer(tmp_path / "ref", [reference], max_steps=25).fit(
        TinyCNN(scheduler="cosine", total_steps=25), digits_loader()
    )
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=10, policy=policy, background=True, lag=3, **AT_CADENCE
    )
    trainer(tmp_path / "cut", [callback, cut], max_steps=25).fit(
        TinyCNN(scheduler="cosine", total_steps=25), digits_loader()
    )
    records = checks(callback)
    assert [(r.step, r.applied_step) for r in records] == [(0, 3), (10, 13), (20, 23)]
    assert [r.step for r in interventions(callback)] == [13]  # decided on step 10's features, applied 3 later
    assert cut.rates[12] == pytest.approx(reference.rates[12])
    for step in range(13, 26):
        assert cut.rates[step] == pytest.approx([0.5 * lr for lr in reference.rates[step]], rel=1e-6), step
    assert callback.monitor.runner._worker is None  # stopped at teardown


def test_resume_restores_history_and_never_refires(tmp_path):
    policy = {
        **OLD_RULE,
        "action": "lower_lr",
        "score": "value",
        "threshold": -1.0,
        "patience": 1,
        "warmup": 1,
        "cooldown": 100,
        "max_lr_cuts": 1,
        "after_max_lr_cuts": "none",  # the rule holds at every check: one cut, then nothing
    }
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=20, save_top_k=-1)
    first = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, policy=Policy(**policy), **AT_CADENCE)
    trainer(tmp_path, [first, saver], max_steps=20, enable_checkpointing=True).fit(
        TinyCNN(scheduler="cosine"), digits_loader()
    )
    assert [r.step for r in interventions(first)] == [10]
    path = next((tmp_path / "ckpt").glob("*step=20*.ckpt"))
    second = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, policy=Policy(**policy), **AT_CADENCE)
    rates = LearningRates()
    trainer(tmp_path, [second, rates], max_steps=40).fit(
        TinyCNN(scheduler="cosine"), digits_loader(), ckpt_path=str(path)
    )
    # The cut at step 10 came back with the checkpoint and was not made again (its count is in the state).
    assert [r.step for r in interventions(second)] == [10]
    assert second.monitor.lr_factor_ == 0.5
    assert [r.step for r in checks(second)] == [0, 10, 20, 30, 40]  # step 20 not checked twice
    reference = LearningRates()
    trainer(tmp_path / "ref", [reference], max_steps=40).fit(TinyCNN(scheduler="cosine"), digits_loader())
    assert rates.rates[30] == pytest.approx([0.5 * lr for lr in reference.rates[30]], rel=1e-6)


def test_the_callback_state_round_trip_is_idempotent_and_json(tmp_path):
    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, **AT_CADENCE)
    trainer(tmp_path, [callback], max_steps=20).fit(TinyCNN(), digits_loader())
    state = json.loads(json.dumps(callback.state_dict()))
    twin = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, **AT_CADENCE)
    twin.load_state_dict(state)
    assert json.dumps(twin.state_dict()) == json.dumps(state)  # the engine marker survives before any check
    again = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, **AT_CADENCE)
    again.load_state_dict(twin.state_dict())
    assert json.dumps(again.state_dict()) == json.dumps(state)


def test_a_resume_with_another_probe_is_refused(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    first = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, **AT_CADENCE)
    trainer(tmp_path, [first, saver], max_steps=10, enable_checkpointing=True).fit(TinyCNN(), digits_loader())
    other = TopoCollapseCallback(probe=PROBE[:100] + 1.0, layer="avgpool", check_every=10, **AT_CADENCE)
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    with pytest.raises(InputError, match="the probe differs"):
        trainer(tmp_path, [other], max_steps=20).fit(TinyCNN(), digits_loader(), ckpt_path=str(path))


def test_early_stopping_and_model_checkpoint_can_monitor_the_index(tmp_path):
    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=5, **AT_CADENCE)
    stopping = EarlyStopping(monitor="topo/ci", mode="min", patience=1000, check_on_train_epoch_end=True, strict=True)
    saver = ModelCheckpoint(dirpath=tmp_path / "best", monitor="topo/ci", mode="min")
    trainer(tmp_path, [callback, stopping, saver], max_steps=60, enable_checkpointing=True).fit(
        TinyCNN(), digits_loader()
    )
    assert saver.best_model_path
    # ModelCheckpoint reads topo/ci at epoch ends: its best score is one of the values the callback logged.
    logged = [r.report.ci for r in checks(callback) if r.step > 0]
    assert any(float(saver.best_model_score) == pytest.approx(ci, abs=1e-6) for ci in logged)


def test_checks_at_validation_end(tmp_path):
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=10_000, check_on_validation_end=True, **AT_CADENCE
    )
    images, labels = digits(128)
    validation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=64)
    fit = trainer(
        tmp_path, [callback], max_steps=60, val_check_interval=20, check_val_every_n_epoch=None, num_sanity_val_steps=1
    )
    fit.fit(TinyCNN(), digits_loader(), validation)
    assert [r.step for r in checks(callback)] == [0, 20, 40, 60]  # train start, then after each validation


def test_two_callbacks_on_two_layers_coexist_and_pickle(tmp_path):
    a = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, **AT_CADENCE)
    b = TopoCollapseCallback(probe=PROBE, layer="backbone.1", check_every=10, **AT_CADENCE)
    assert a.state_key != b.state_key
    fit = trainer(tmp_path, [a, b], max_steps=10)
    fit.fit(TinyCNN(), digits_loader())
    assert len(checks(a)) == len(checks(b)) == 2
    restored = pickle.loads(pickle.dumps(a))
    assert restored.history == a.history


def test_a_bad_layer_name_fails_in_setup_with_close_matches(tmp_path):
    callback = TopoCollapseCallback(probe=PROBE, layer="avg_pool", **AT_CADENCE)
    with pytest.raises(InputError, match=r"`layer` 'avg_pool' is not a module of TinyCNN; closest: \['avgpool'"):
        trainer(tmp_path, [callback], max_steps=2).fit(TinyCNN(), digits_loader())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"probe": PROBE[:0], "layer": "avgpool"}, "`probe` is empty"),
        ({"probe": torch.zeros(4, 1, 8, 8, device="meta"), "layer": "avgpool"}, "on the meta device"),
        ({"probe": PROBE, "layer": "avgpool", "check_every": 0}, "`check_every` must be an integer >= 1, got 0"),
        ({"probe": None, "layer": "avgpool"}, "`probe` is required in probe mode"),
        ({"probe": PROBE}, "`layer` is required"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        TopoCollapseCallback(**kwargs, **AT_CADENCE)


def test_streaming_mode_watches_the_training_batches(tmp_path):
    callback = TopoCollapseCallback(layer="avgpool", mode="stream", window=256, check_every=5, **AT_CADENCE)
    fit = trainer(tmp_path, [callback], max_steps=20)
    fit.fit(TinyCNN(), digits_loader())
    records = checks(callback)
    assert [r.step for r in records] == [5, 10, 15, 20]
    assert records[-1].n_points == 256
    assert "topo/ci" in fit.callback_metrics


class Drift(torch.nn.Module):
    """The watched layer: features times a gain that grows 100x over 2,000 steps, shifted by a moving offset.

    The head undoes both (:meth:`undo`), so training is that of a healthy MLP while the watched features drift in
    scale and position the way a real network's can (a real MLP trained hard enough to grow its features 100x by
    itself dies on some CPUs and not on others: its trajectory is chaotic).
    """

    def __init__(self, steps=2000, width=32):
        super().__init__()
        self.steps = steps
        self.register_buffer("step", torch.zeros(()))
        self.register_buffer("direction", torch.randn(width, generator=torch.Generator().manual_seed(1)))

    def gain(self):
        return 100.0 ** (self.step / self.steps)

    def forward(self, x):
        return self.gain() * (x + 3.0 * (self.step / self.steps) * self.direction)

    def undo(self, y):
        return y / self.gain() - 3.0 * (self.step / self.steps) * self.direction


class DigitsMLP(pl.LightningModule):
    """A healthy MLP on digits whose watched layer (``drift``) grows 100x in scale during 2,000 steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU()
        )
        self.drift = Drift()
        self.head = torch.nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(
            self.head(self.drift.undo(self.drift(self.body(images.flatten(1))))), labels
        )

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.drift.step += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.slow
def test_a_streaming_window_stays_meaningful_over_2000_steps_of_drifting_features(tmp_path):
    callback = TopoCollapseCallback(layer="drift", mode="stream", check_every=100, **AT_CADENCE)
    model = DigitsMLP()
    trainer(tmp_path, [callback], max_steps=2000).fit(model, digits_loader())
    assert float(model.drift.gain()) > 90  # the drift this is about
    records = checks(callback)
    assert len(records) == 20
    full = [r for r in records if r.n_points == r.window]
    assert len(full) >= 15
    low, high = DEGREE_BAND  # neither every point isolated nor one blob, whatever the trajectory on this CPU
    assert all(1 < r.report.betti0 < r.n_points and low <= r.density * (r.n_points - 1) <= high for r in full)
    assert not any(r.decision.fired for r in records)  # healthy
    assert callback.monitor.pipeline.transform.reframes_ >= 1


def test_import_without_lightning_gives_an_install_hint():
    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
        "import topocallbacks.lightning"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert result.returncode != 0
    assert "pip install 'topocallbacks[lightning]'" in result.stderr


def test_lightning_tensorboard_logger_receives_every_check_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, **AT_CADENCE)
    # log_every_n_steps=50 never falls on a check step here: the checks must reach the logger anyway.
    fit = trainer(tmp_path, [callback], 30, logger=TensorBoardLogger(str(tmp_path), name="run"), log_every_n_steps=50)
    fit.fit(TinyCNN(), digits_loader())
    events = EventAccumulator(fit.logger.log_dir).Reload()
    assert {"topo/ci", "topo/index", "topo/betti0", "topo/anisotropy_term"} <= set(events.Tags()["scalars"])
    logged = events.Scalars("topo/ci")
    assert [event.step for event in logged] == [0, 10, 20, 30]  # the start check included, each once
    assert [event.value for event in logged] == pytest.approx([r.report.ci for r in checks(callback)])
    assert next(event.value for event in events.Scalars("topo/index")) == 0.0  # no drift at the first check


def test_the_index_is_available_at_every_epoch_end_with_checks_rarer_than_epochs(tmp_path):
    # 29 batches per epoch, a check every 100 steps: before the fix the first epoch end found no topo/index.
    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=100, **AT_CADENCE)
    stopping = EarlyStopping(
        monitor="topo/index", mode="max", patience=1000, check_on_train_epoch_end=True, strict=True
    )
    saver = ModelCheckpoint(dirpath=tmp_path / "best", monitor="topo/index", mode="max")
    seen = []

    class EpochEnds(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen.append((trainer.global_step, float(trainer.callback_metrics["topo/index"])))

    fit = trainer(tmp_path, [callback, stopping, saver, EpochEnds()], max_steps=-1, max_epochs=5,
                  enable_checkpointing=True)  # fmt: skip
    fit.fit(TinyCNN(), digits_loader())
    assert [r.step for r in checks(callback)] == [0, 100]
    # Every epoch end saw the latest check's value: the start check's 0.0, then the drift at step 100.
    drift = checks(callback)[1].index_value
    assert seen == [(29, 0.0), (58, 0.0), (87, 0.0), (116, pytest.approx(drift)), (145, pytest.approx(drift))]
    assert saver.best_model_path


def test_two_callbacks_on_two_layers_log_under_their_layer(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, **AT_CADENCE)
    b = TopoCollapseCallback(
        probe=PROBE, layer="*.1", check_every=10, **AT_CADENCE
    )  # a pattern: the resolved name is used
    mine = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=10, prefix="mine", mode="probe", **AT_CADENCE)
    stopping = EarlyStopping(monitor="topo/backbone.1/index", mode="max", patience=1000, check_on_train_epoch_end=True)
    fit = trainer(tmp_path, [a, b, mine, stopping], 30, logger=TensorBoardLogger(str(tmp_path), name="run"))
    fit.fit(TinyCNN(), digits_loader())
    assert (a.prefix, b.prefix, mine.prefix) == ("topo/avgpool", "topo/backbone.1", "mine")
    metrics = fit.callback_metrics
    assert "topo/index" not in metrics  # no ambiguous name
    assert float(metrics["topo/avgpool/ci"]) == pytest.approx(checks(a)[-1].report.ci)
    assert float(metrics["topo/backbone.1/ci"]) == pytest.approx(checks(b)[-1].report.ci)
    assert float(metrics["mine/ci"]) == pytest.approx(checks(mine)[-1].report.ci)
    assert checks(a)[-1].report.ci != checks(b)[-1].report.ci
    tags = set(EventAccumulator(fit.logger.log_dir).Reload().Tags()["scalars"])
    assert {"topo/avgpool/index", "topo/backbone.1/index", "mine/index"} <= tags
    assert fit.progress_bar_metrics.keys() >= {"topo/avgpool/index", "topo/backbone.1/index", "mine/index"}


def test_an_end_of_run_summary_names_the_checks_and_the_interventions(tmp_path, caplog):
    history = tmp_path / "h.jsonl"
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=5, policy=always("lower_lr"), history_path=str(history), **AT_CADENCE
    )
    with caplog.at_level("INFO"):
        trainer(tmp_path, [callback], max_steps=10).fit(TinyCNN(), digits_loader())
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("topocallbacks:")]
    assert len(summaries) == 1
    lines = summaries[0].splitlines()
    assert lines[0] == (
        "topocallbacks: 3 checks (steps 0-10) at layer avgpool of diagram_drift; 0 warning(s), 2 intervention(s):"
    )
    cut = "learning rate x 0.5 in 1 optimizer(s) and 0 scheduler(s), now 0.025"
    assert lines[1].startswith(f"  step 5: lower_lr ({cut}), because index ")
    # The rule can stop (a diverged check stops), so healthy checks keep snapshots: the summary says how many.
    assert lines[-2] == f"  history: {history}"
    assert lines[-1].startswith("  rollback snapshots: 1 of 2 snapshot(s) of ")  # the warm-up check's
    quiet = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=5, summary=False, **AT_CADENCE)
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer(tmp_path, [quiet], max_steps=5).fit(TinyCNN(), digits_loader())
    assert not [r for r in caplog.records if r.getMessage().startswith("topocallbacks:")]


def test_the_callback_writes_a_report_of_its_run(tmp_path):
    callback = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=5, policy=always("lower_lr"), **AT_CADENCE
    )
    trainer(tmp_path, [callback], max_steps=10).fit(TinyCNN(), digits_loader())
    page = callback.report(tmp_path / "report")
    assert {"index.png", "composite_0.png", "diagrams.png"} <= {p.name for p in page.parent.iterdir()}
    html = page.read_text()
    assert html.count("src='index.png'") == 1
    assert html.count("src='diagrams.png'") == 1
    assert [r.step for r in callback.history if r.kind == "intervention"] == [5, 10]
    assert "lower_lr at 5, lower_lr at 10" in html  # the summary's decisions
    assert "Step 5: decision" in html  # each one diagnosed
    assert "Step 10: decision" in html


def test_streaming_with_gradient_accumulation_checks_once_per_check_step(tmp_path):
    callback = TopoCollapseCallback(layer="avgpool", mode="stream", window=1024, check_every=5, **AT_CADENCE)
    fit = trainer(tmp_path, [callback], max_steps=20, accumulate_grad_batches=4)
    fit.fit(TinyCNN(), digits_loader())
    assert [r.step for r in checks(callback)] == [5, 10, 15, 20]  # one record per check, not one per micro-batch
    # Every micro-batch's features reached the window: 4 micro-batches x 32 points per optimizer step.
    assert checks(callback)[0].n_points == 5 * 4 * 32


class NaNAfter(TinyCNN):
    """TinyCNN whose pooled features turn NaN from optimizer step ``start`` on (a diverged run)."""

    def __init__(self, start):
        super().__init__()
        self.start = start
        self.avgpool.register_forward_hook(self._poison)

    def _poison(self, module, inputs, output):
        if self.training and self.trainer.global_step >= self.start:
            return output * float("nan")
        return None


def test_streaming_with_nan_decides_once_per_check_and_cuts_the_rate_at_check_steps(tmp_path):
    history = tmp_path / "h.jsonl"
    policy = {"on_diverged": "lower_lr", "max_lr_cuts": 2, "after_max_lr_cuts": "stop"}
    callback = TopoCollapseCallback(
        layer="avgpool",
        mode="stream",
        window=256,
        check_every=5,
        policy=policy,
        history_path=str(history),
        **AT_CADENCE,
    )
    rates = LearningRates()
    fit = trainer(tmp_path, [callback, rates], max_steps=30)
    fit.fit(NaNAfter(start=7), digits_loader())
    records = checks(callback)
    assert [(r.step, r.status) for r in records] == [(5, "ok"), (10, "diverged"), (15, "diverged"), (20, "diverged")]
    done = interventions(callback)
    assert [(r.step, r.action) for r in done] == [(10, "lower_lr"), (15, "lower_lr"), (20, "stop")]
    # Cut at check steps only, not at every diverged step; the cuts spent, the third diverged check stops the run.
    assert [rates.rates[step][0] for step in (9, 10, 14, 15, 19)] == [0.05, 0.025, 0.025, 0.0125, 0.0125]
    assert "2 learning-rate cuts made already, so stop" in done[-1].reason
    assert fit.global_step == 20
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(lines) == len(records) + len(done)  # one line per check and per intervention, not per step


def test_the_default_rule_rolls_an_induced_lr_blow_up_back_four_times_then_stops_at_the_last_healthy_state(tmp_path):
    # The loud path under test: the silent path (which also warns here, as the ramp moves the features away from
    # their warm-up before the loss confirms) is off; tests/unit/test_silent_path.py covers it.
    callback = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=2, silent_path=False, **AT_CADENCE)
    assert callback.monitor.settings.index.name == "diagram_drift"
    rates = LearningRates()
    fit = trainer(tmp_path, [callback, rates], max_steps=300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(TinyCNN(lr=0.02, scheduler="ramp", lr_growth=1.1), digits_loader())
    assert not [w for w in caught if str(w.message).startswith("topocallbacks at step")]  # it acts, it never warns
    records = checks(callback)
    assert records[0].index_value is None  # nothing to drift from at the first check
    # The warm-up is 10 checks (steps 0-18). At the first check after it (step 20) the drift jumps (the ramp, x1.1
    # per step), but the loss does not: the index alone does not act, the loss must confirm it.
    assert records[10].step == 20
    assert records[10].decision.flagged == ("index",)
    assert records[10].decision.scores["loss"] < 4.5
    assert not records[10].decision.fired
    # The ramp is structural (the schedule multiplies the rate by 1.1 at every step, cut or not): the rule rolls back
    # max_rollbacks = 4 times, each time skipping the next 2 x check_every = 4 updates, then stops. The first rollback
    # does not cut the rate; a later one cuts it by 0.5 more (compounding) when it fires within two checks (4 steps)
    # of the previous one: the fault outlived the skip.
    done = interventions(callback)
    assert [r.action for r in done] == ["rollback"] * 4 + ["stop"]
    assert all(r.step > 20 for r in done)
    cut = [False] + [later.step - earlier.step <= 2 * 2 for earlier, later in itertools.pairwise(done[:4])]
    factors = [0.5 ** sum(cut[: i + 1]) for i in range(4)]
    assert [r.lr_factor for r in done] == pytest.approx([*factors, factors[-1]])
    for number, (rollback, cuts) in enumerate(zip(done[:4], cut, strict=True), start=1):
        assert rollback.snapshot_step < rollback.step
        why = "x 0.5 as it fired again within two checks of the last rollback" if cuts else "no cut (no rollback in"
        assert why in rollback.reason
        assert rollback.reason.endswith(f"(rollback {number} of 4)")
        assert rollback.detail.startswith(f"rolled back to the snapshot of step {rollback.snapshot_step}: ")
        assert "the next 4 optimizer update(s) skipped" in rollback.detail
    # The dead ReLUs of the blow-up are constant features: the absolute sentinels name them.
    assert any(r.reason.startswith("the features are constant") for r in done)
    # The stop restores the newest healthy snapshot first, keeping the four rollbacks' compounded cut.
    stop = done[-1]
    assert fit.global_step == stop.step < 300
    assert "4 rollbacks made already" in stop.reason
    assert "structural" in stop.reason
    assert stop.reason.endswith(f"the last healthy state (step {stop.snapshot_step}) is restored first")
    healthy = [r.step for r in records if r.decision.healthy and r.step < stop.step]
    assert stop.snapshot_step == healthy[-1]
    assert stop.detail.startswith(f"restored the last healthy state, the snapshot of step {stop.snapshot_step} ")
    # The cuts made after the snapshot are kept (which checks were healthy varies); the snapshot's rate holds the
    # others.
    kept = sum(c for r, c in zip(done[:4], cut, strict=True) if r.step > stop.snapshot_step)
    if kept:
        assert f"the rollbacks' cut kept: learning rate x {0.5**kept}" in stop.detail
    else:
        assert "cut kept" not in stop.detail
    expected = rates.rates[stop.snapshot_step][0] * 0.5**kept
    assert fit.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    assert (tmp_path / f"topo-stop-step{stop.step}.ckpt").is_file()


def test_a_budgeted_fit_plans_once_and_a_second_fit_given_that_plan_checks_and_decides_the_same(tmp_path, caplog):
    # A budget far below what checks every 2 steps cost: the plan (made at the third check, step 4, from this
    # machine's timings: its content may differ from one machine to another) changes the cadence, the probe, where
    # the checks run. The summary gives it as `plan=`; a second fit given it, with no budget, measures nothing and
    # checks and decides exactly as the first.
    policy = always("lower_lr", max_lr_cuts=100)
    first = TopoCollapseCallback(probe=PROBE, layer="avgpool", check_every=2, overhead_budget=0.001, policy=policy)
    with caplog.at_level("INFO", logger="topocallbacks"):
        trainer(tmp_path / "a", [first], max_steps=60).fit(TinyCNN(), digits_loader())
    (made,) = [r.plan for r in checks(first) if r.plan is not None]
    assert made.at_step == 4
    assert f"rerun with plan={made.settings}" in caplog.text
    second = TopoCollapseCallback(
        probe=PROBE, layer="avgpool", check_every=2, policy=policy, plan=made.settings, **AT_CADENCE
    )
    assert second.monitor.settings.schedule.overhead_budget is None
    trainer(tmp_path / "b", [second], max_steps=60).fit(TinyCNN(), digits_loader())

    def what(callback):
        return [(r.step, r.n_points, r.applied_step, r.index_value, r.decision.action.value) for r in checks(callback)]

    assert what(second) == what(first)
    assert [(r.step, r.action) for r in interventions(second)] == [(r.step, r.action) for r in interventions(first)]
    assert len(checks(first)) < 31  # the plan did change the cadence (a check every 2 steps would give 31)
