"""The rule's view of every check and a marker of every intervention, where users already look: TensorBoard (through
Lightning's logger and HF's ``report_to``) and an MLflow file store, read back from what those tools wrote.

The fit is ``test_rollback_lightning``'s: the watched encoder collapses at step 12, the check at 15 rolls back. The
HF run cuts the rate at its checks (a rule that fires at every check after its warm-up).
"""

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.cadence import AT_CADENCE
from tests.integration.models import quiet_trainer
from tests.integration.test_rollback_lightning import CollapsingMLP, loader, watcher
from topocallbacks.sinks import ACTION_CODES


def events(directory):
    """Every scalar and text tag in the event files under ``directory``: ({tag: {step: value}}, {tag: {step: text}})."""
    found_scalars, found_texts = {}, {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found_scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
        for tag in accumulator.Tags()["tensors"]:
            for event in accumulator.Tensors(tag):
                if event.tensor_proto.string_val:
                    found_texts.setdefault(tag, {})[event.step] = event.tensor_proto.string_val[0].decode()
    return found_scalars, found_texts


def fit_with(logger, tmp_path):
    callback = watcher()
    trainer = quiet_trainer(tmp_path, [callback], 20, logger=logger)
    trainer.fit(CollapsingMLP(collapse_at={12}), loader())
    return callback


def test_lightning_tensorboard_logger_gets_the_scores_the_thresholds_and_a_marker_at_the_rollback(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    callback = fit_with(TensorBoardLogger(str(tmp_path), name="tb"), tmp_path)
    checks = {r.step: r for r in callback.history if r.kind == "check"}
    (rollback,) = [r for r in callback.history if r.kind == "intervention"]
    assert (rollback.step, rollback.action) == (15, "rollback")
    scalars, texts = events(tmp_path / "tb")
    # The score the threshold is compared with, at every check past the warm-up, and the threshold itself.
    scored = {s: r.decision.score for s, r in checks.items() if r.decision.score is not None}
    assert scored  # the rule scored checks
    assert scalars["topo/score/index"] == pytest.approx(scored)
    assert set(scalars["topo/threshold/index"].values()) == {-4.0}
    assert set(scalars["topo/threshold/index"]) == set(checks)
    assert scalars["topo/score/index"][15] >= -4.0  # the rollback's check reached it
    # The marker at the rollback's step only, and its reason as text there.
    assert scalars["topo/intervention"] == {15: ACTION_CODES["rollback"]}
    (text,) = texts["topo/intervention/text_summary"].items()
    assert text[0] == 15
    assert "**rollback** at step 15" in text[1]
    assert rollback.reason in text[1]
    assert "rolled back to the snapshot of step 10" in text[1]


def test_lightning_mlflow_logger_gets_the_marker_and_the_reason_as_a_text_artifact(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = f"file:{tmp_path / 'mlruns'}"
    logger = MLFlowLogger(experiment_name="topo", tracking_uri=uri)
    callback = fit_with(logger, tmp_path)
    (rollback,) = [r for r in callback.history if r.kind == "intervention"]
    client = MlflowClient(uri)
    marker = client.get_metric_history(logger.run_id, "topo/intervention")
    assert [(m.step, m.value) for m in marker] == [(15, ACTION_CODES["rollback"])]
    scores = client.get_metric_history(logger.run_id, "topo/score/index")
    assert {m.step for m in scores} == {
        r.step for r in callback.history if r.kind == "check" and r.decision.score is not None
    }
    (artifact,) = client.list_artifacts(logger.run_id, "topo/interventions")
    assert artifact.path == "topo/interventions/step15-rollback.md"
    content = Path(client.download_artifacts(logger.run_id, artifact.path, str(tmp_path))).read_text()
    assert rollback.reason in content
    assert rollback.detail in content


def test_a_logger_that_fails_is_said_once_and_training_goes_on(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    class Broken(CSVLogger):
        def log_metrics(self, metrics, step=None):
            if any(name.startswith("topo/") for name in metrics):
                raise OSError("the disk is full")
            super().log_metrics(metrics, step)

    with pytest.warns(RuntimeWarning, match=r"could not write a check's values to Broken \(OSError: the disk is full"):
        callback = fit_with(Broken(str(tmp_path)), tmp_path)
    assert [(r.step, r.action) for r in callback.history if r.kind == "intervention"] == [(15, "rollback")]
    assert max(r.step for r in callback.history if r.kind == "check") == 20  # the fit reached its end


def test_hf_report_to_tensorboard_gets_the_scores_and_a_marker_and_the_reason_at_the_cut(tmp_path):
    from transformers import Trainer

    from tests.integration.test_hf import PROBE, DigitsNet, always, arguments, digits_dataset
    from topocallbacks.hf import TopoCollapseTrainerCallback

    callback = TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", check_every=5, policy=always("lower_lr"), **AT_CADENCE
    )
    args = arguments(tmp_path, report_to="tensorboard")
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[callback]).train()
    (cut,) = [r for r in callback.history if r.kind == "intervention"]
    assert (cut.step, cut.action) == (5, "lower_lr")
    scalars, texts = events(tmp_path / "runs")
    # report_to puts its "train/" before every name.
    assert scalars["train/topo/intervention"] == {5: ACTION_CODES["lower_lr"]}
    checks = [r for r in callback.history if r.kind == "check" and r.decision.score is not None]
    assert scalars["train/topo/score/index"] == pytest.approx({r.step: r.decision.score for r in checks})
    assert set(scalars["train/topo/threshold/index"].values()) == {-1.0}
    (text,) = texts["topo/intervention/text_summary"].items()
    assert text[0] == 5
    assert cut.reason in text[1]
