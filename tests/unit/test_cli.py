import csv
import json
import subprocess
import sys

import pytest

from topocallbacks import demo
from topocallbacks.cli import main


def table(out):
    """The demo's table: run name -> (final test accuracy in %, the rest of its row)."""
    rows = {}
    for line in out.splitlines():
        name, _, rest = line.partition(" ")
        if name in ("healthy", "unprotected", "protected") and "%" in rest:
            accuracy, _, rest = rest.strip().partition(" %")
            rows[name] = (float(accuracy), rest.strip())
    return rows


@pytest.mark.slow
def test_demo_rolls_the_fault_back_and_ends_healthy(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--out", "out"]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert set(rows) == {"healthy", "unprotected", "protected"}
    (healthy, quiet), (unprotected, warned), (protected, rolled) = (rows[n] for n in rows)
    assert healthy > 90
    assert unprotected < 20  # collapsed: chance is 10 %
    assert protected > unprotected + 50
    assert abs(protected - healthy) <= 2
    assert quiet.startswith("none")  # no false alarm on the healthy run
    assert "warned only" in warned
    assert "->" in rolled
    assert out.count("The fault wrecked the unprotected run for good") == 1
    assert "The protected monitor's summary:\ntopocallbacks: 60 checks" in out

    folder = tmp_path / "out"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing written beside --out
    assert sorted(p.name for p in folder.iterdir()) == ["curves.csv", "protected-history.jsonl", "report", "rescue.png"]
    assert out.rstrip().splitlines()[-2:] == [
        f"picture: {folder / 'rescue.png'}",
        f"report:  {folder / 'report' / 'index.html'}",
    ]
    assert (folder / "rescue.png").read_bytes().startswith(b"\x89PNG")
    page = (folder / "report" / "index.html").read_text()
    assert "topocallbacks demo: the protected run" in page
    assert "rollback" in page
    assert (folder / "report" / "index.png").read_bytes().startswith(b"\x89PNG")

    records = [json.loads(line) for line in (folder / "protected-history.jsonl").read_text().splitlines()]
    rollbacks = [r for r in records if r["kind"] == "intervention"]
    assert rollbacks
    assert all(r["action"] == "rollback" and r["steps_lost"] > 0 for r in rollbacks)
    fault = demo.Fault()
    # Seen at the first check the fault hit, and rolled back to a state from before it, until it had passed.
    assert rollbacks[0]["step"] < fault.start + demo.CHECK_EVERY
    assert all(r["snapshot_step"] < fault.start for r in rollbacks)
    assert fault.last < rollbacks[-1]["step"] <= fault.last + demo.CHECK_EVERY

    with (folder / "curves.csv").open(newline="") as handle:
        curves = list(csv.DictReader(handle))
    assert len(curves) == 600
    assert sum(int(row["fault"]) for row in curves) == fault.length
    assert round(100 * float(curves[-1]["protected_accuracy"]), 1) == protected


def test_demo_without_matplotlib_writes_the_curves_and_says_how_to_get_the_picture(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # importing it fails, as without matplotlib
    demo.run(tmp_path / "out", steps=30, fault=demo.Fault(start=20, length=5))
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["curves.csv", "protected-history.jsonl"]
    assert 'picture: none, it needs matplotlib: pip install "topocallbacks[report]"' in out
    assert "report:  none, for the same reason" in out
    with (tmp_path / "out" / "curves.csv").open(newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "fault", "healthy_accuracy", "unprotected_accuracy", "protected_accuracy"]
    assert len(rows) == 31
    assert [row[1] for row in rows[1:]] == ["1" if 20 <= step < 25 else "0" for step in range(30)]


def test_demo_training_is_deterministic_and_a_rollback_restores_the_snapshot():
    data = demo.Digits.load()
    fault = demo.Fault(start=120, length=10)
    policy = {"warmup": 3}  # the default rule with a short warm-up: alarms from the fifth check on
    first, second = (demo.train("protected", data, seed=1, steps=150, fault=fault, policy=policy) for _ in range(2))
    assert first.accuracy == second.accuracy
    assert [(r.step, r.snapshot_step) for r in first.rollbacks] == [(120, 110)]
    # Right after the rollback the model is the snapshot's, and stays so while the next 20 updates are skipped (the
    # fault's steps among them): the accuracy of step 110 again, 21 times.
    assert first.accuracy[120:141] == [first.accuracy[110]] * 21
    (rollback,) = first.rollbacks
    assert rollback.steps_lost == 10
    assert "the next 20 optimizer update(s) skipped" in rollback.detail
    assert first.final_accuracy > 0.9


def test_demo_rejects_a_negative_seed(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--seed", "-1"])
    assert exit_info.value.code == 2
    assert "--seed must be >= 0, got -1" in capsys.readouterr().err


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "topocallbacks", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "demo" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "topocallbacks", "demo", "--help"], capture_output=True, text=True, check=True
    )
    assert "(default: ./topocallbacks-demo)" in " ".join(result.stdout.split())  # argparse wraps the help
