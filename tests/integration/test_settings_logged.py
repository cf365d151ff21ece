"""The monitor's settings as hyperparameters, and W&B beside TensorBoard and MLflow: read back from what TensorBoard,
an MLflow file store and an offline W&B run wrote (Lightning's loggers and HF's ``report_to``).

The fits are ``test_decisions_logged``'s: Lightning rolls back at step 15, HF cuts the rate at step 5.
"""

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.cadence import AT_CADENCE
from tests.integration.test_decisions_logged import fit_with

pytest.importorskip("wandb")


def tensorboard_hparams(directory):
    """The hparams plugin's values in the event files under ``directory``: {name: value}."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    found = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        for content in accumulator.PluginTagToContent("hparams").values():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            for name, value in data.session_start_info.hparams.items():
                found[name] = value.string_value or value.number_value or value.bool_value
    return found


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, in ``tmp_path``: nothing leaves the machine; the run is finished after the test."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    yield wandb
    wandb.finish()


def wandb_tables(run):
    """The rows of every ``topo/interventions`` table the W&B run wrote to its files."""
    tables = sorted(Path(run.dir).rglob("interventions_*.table.json"))
    return [row for path in tables for row in json.loads(path.read_text())["data"]]


def test_lightning_loggers_get_the_settings_as_hyperparameters_and_wandb_gets_the_rollback(tmp_path, offline_wandb):
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
    from mlflow.tracking import MlflowClient

    mlflow = MLFlowLogger(experiment_name="topo", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    wandb_logger = WandbLogger(project="topo", offline=True, save_dir=str(tmp_path))
    callback = fit_with([TensorBoardLogger(str(tmp_path), name="tb"), mlflow, wandb_logger], tmp_path)
    rule = callback.monitor.settings.rule
    assert tensorboard_hparams(tmp_path / "tb")["topo/policy/rollback_order"] == rule.rollback_order
    params = MlflowClient(f"file:{tmp_path / 'mlruns'}").get_run(mlflow.run_id).data.params
    assert params["topo/policy/threshold"] == str(rule.threshold)
    assert params["topo/schedule/check_every"] == str(callback.monitor.settings.schedule.check_every)
    run = wandb_logger.experiment
    assert run.config["topo/policy/channels"] == json.dumps(list(rule.channels))
    (rollback,) = [r for r in callback.history if r.kind == "intervention"]
    assert wandb_tables(run) == [[rollback.step, "rollback", rollback.reason, rollback.detail]]


def test_hf_report_to_loggers_get_the_settings_and_wandb_gets_the_cut(tmp_path, offline_wandb, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import Trainer

    from tests.integration.test_hf import PROBE, DigitsNet, always, arguments, digits_dataset
    from topocallbacks.hf import TopoCollapseTrainerCallback

    # HF's MLflowCallback keeps a tracking URI another test of this process set: this test's store, explicitly.
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "topo")
    callback = TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", check_every=5, policy=always("lower_lr"), **AT_CADENCE
    )
    args = arguments(tmp_path, report_to=["tensorboard", "mlflow", "wandb"])
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[callback]).train()
    rule = callback.monitor.settings.rule
    assert tensorboard_hparams(tmp_path / "runs")["topo/policy/action"] == "lower_lr"
    client = MlflowClient(f"file:{tmp_path / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("topo").experiment_id])
    assert run.data.params["topo/policy/action"] == "lower_lr"
    assert run.data.params["topo/policy/score"] == rule.score
    wandb_run = offline_wandb.run
    assert wandb_run.config["topo/policy/action"] == "lower_lr"
    (cut,) = [r for r in callback.history if r.kind == "intervention"]
    assert wandb_tables(wandb_run) == [[cut.step, "lower_lr", cut.reason, cut.detail]]
