"""``topocallbacks report`` and ``topocallbacks analyze`` from the command line (the library is tested elsewhere)."""

import csv
import subprocess
import sys

import numpy as np
import pytest

from tests.cadence import AT_CADENCE
from topocallbacks import TopoMonitor
from topocallbacks.cli import main


def history_file(folder):
    path = folder / "history.jsonl"
    monitor = TopoMonitor(check_every=1, history_path=str(path), **AT_CADENCE)
    cloud = np.random.default_rng(0).normal(size=(60, 6))
    for step in range(4):
        monitor.process(cloud * (1 + 0.1 * step), step * 10)
    return path


def test_report_command_writes_the_page(tmp_path, capsys):
    history = history_file(tmp_path)
    assert main(["report", str(history), "--out", str(tmp_path / "out"), "--title", "from the CLI"]) == 0
    page = tmp_path / "out" / "index.html"
    assert capsys.readouterr().out.strip() == f"report: {page}"
    assert "<title>from the CLI</title>" in page.read_text(encoding="utf-8")
    assert (tmp_path / "out" / "index.png").is_file()


def test_report_command_names_a_missing_history(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("topocallbacks: error: `history`")
    assert "missing.jsonl' does not exist" in error
    assert not (tmp_path / "out").exists()


def test_analyze_command_on_feature_arrays(tmp_path, capsys):
    rng = np.random.default_rng(1)
    folder = tmp_path / "features"
    folder.mkdir()
    for step in (0, 50, 100):
        np.save(folder / f"features-step{step}.npy", rng.normal(size=(40, 5)) * (1 + step / 100))
    out = tmp_path / "out"
    assert main(["analyze", str(folder), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"table:  {out / 'analysis.csv'}" in printed
    assert f"report: {out / 'index.html'}" in printed
    # What it found, in sentences: the features spread with the step, so no drift stands out, and there is no loss.
    assert "layers: features" in printed
    assert "No loss was found in the checkpoints" in printed
    assert "No loss was found in the checkpoints" in (out / "index.html").read_text()  # at the top of the report
    with (out / "analysis.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r["layer"], r["source"]) for r in rows] == [
        ("0", "features", "features"),
        ("50", "features", "features"),
        ("100", "features", "features"),
    ]
    assert sorted(p.name for p in folder.iterdir()) == [f"features-step{s}.npy" for s in (0, 100, 50)]  # untouched


def test_analyze_command_reports_an_empty_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["analyze", str(tmp_path / "empty"), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "empty' holds no checkpoints" in error
    assert not (tmp_path / "out").exists()


def test_help_lists_every_command():
    result = subprocess.run([sys.executable, "-m", "topocallbacks", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert all(command in result.stdout for command in ("demo", "report", "analyze"))
    result = subprocess.run(
        [sys.executable, "-m", "topocallbacks", "analyze", "--help"], capture_output=True, text=True, check=True
    )
    for option in ("--probe", "--out", "--layer", "--factory", "--weights", "--trust-checkpoints"):
        assert option in result.stdout


@pytest.mark.slow
def test_version_and_help_without_markup():
    from topocallbacks import __version__

    result = subprocess.run([sys.executable, "-m", "topocallbacks", "--version"], capture_output=True, text=True)
    assert result.stdout.strip() == f"topocallbacks {__version__}"
    for command in ([], ["demo"], ["report"], ["analyze"]):
        shown = subprocess.run(
            [sys.executable, "-m", "topocallbacks", *command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert not [mark for mark in ("``", ":class:", ":func:", ":meth:") if mark in shown], command


def test_analyze_names_a_missing_probe_file_before_loading_anything(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "model-step10.pt").write_bytes(b"")
    missing = tmp_path / "probe.npy"
    assert main(["analyze", str(folder), "--probe", str(missing), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert f"--probe: no such file: {missing}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_analyze_names_the_command_line_flag_when_layers_are_needed(capsys):
    from topocallbacks.cli import _reporting_errors
    from topocallbacks.exceptions import InputError

    def needs_layers():
        raise InputError("`layers` is required: name the module(s) of Net to analyse; some names: ['encoder']")

    assert _reporting_errors(needs_layers, flags={"layers": "--layer"}) == 2
    error = capsys.readouterr().err
    assert "`--layer` is required: name the module(s) of Net to analyse" in error
    assert "`layers`" not in error
