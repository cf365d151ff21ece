"""The history file keeps what the report and a resume need (issue 39): the training loss and gradient norm too."""

import numpy as np

from tests.cadence import AT_CADENCE
from topocallbacks import TopoMonitor
from topocallbacks.check import CheckRecord, record_from_dict
from topocallbacks.report import write_report
from topocallbacks.sinks import JsonlSink


def run(tmp_path):
    monitor = TopoMonitor(check_every=1, summary=False, history_path=str(tmp_path / "history.jsonl"), **AT_CADENCE)
    rng = np.random.default_rng(0)
    for step in range(14):
        spread = 1.0 if step < 12 else 0.05  # a collapse at the end, with the loss jumping
        features = spread * rng.normal(size=(60, 5))
        monitor.process(features, step, loss=2.0 - 0.01 * step + (3.0 if step >= 12 else 0.0),
                        grad_norm=1.0 + 0.1 * step)  # fmt: skip
    return monitor


def test_a_check_record_round_trips_with_its_loss_and_gradient_norm(tmp_path):
    monitor = run(tmp_path)
    checks = [r for r in monitor.history if isinstance(r, CheckRecord)]
    assert checks[-1].loss is not None
    assert checks[-1].grad_norm is not None
    for record in checks:
        again = record_from_dict(record.as_dict())
        assert (again.loss, again.grad_norm) == (record.loss, record.grad_norm)
    lines = JsonlSink.read(tmp_path / "history.jsonl")
    assert [line.get("loss") for line in lines if line["kind"] == "check"] == [r.loss for r in checks]
    assert [line.get("grad_norm") for line in lines if line["kind"] == "check"] == [r.grad_norm for r in checks]
    old = {k: v for k, v in checks[-1].as_dict().items() if k not in ("loss", "grad_norm")}  # an older file
    assert record_from_dict(old).loss is None


def test_the_report_from_the_file_draws_what_the_report_from_memory_draws(tmp_path):
    monitor = run(tmp_path)
    memory = write_report(monitor.history, tmp_path / "memory")
    from_file = write_report(tmp_path / "history.jsonl", tmp_path / "file")
    assert (tmp_path / "memory" / "loss.png").is_file()
    assert sorted(p.name for p in (tmp_path / "file").glob("*.png")) == sorted(
        p.name for p in (tmp_path / "memory").glob("*.png")
    )
    assert from_file.read_text().count("loss") == memory.read_text().count("loss")
