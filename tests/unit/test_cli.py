import subprocess
import sys

import pytest

from topocallbacks.cli import main


def test_demo_runs_on_real_digits_and_agrees_with_gudhi(capsys):
    assert main(["demo", "--points", "120"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip() and line.split()[0].replace(".", "").isdigit()]
    assert len(rows) == 7
    assert all(row.endswith("agrees") for row in rows)
    # The collapse shows: anisotropy at the strongest collapse is above its value on the raw digits.
    first_aniso, last_aniso = float(rows[0].split()[4]), float(rows[-1].split()[4])
    assert last_aniso > first_aniso
    # The default index: no drift at the first check (nothing to drift from), some as the cloud collapses.
    drifts = [row.split()[8] for row in rows]
    assert drifts[0] == "-"
    assert all(float(d) > 0 for d in drifts[1:])


def test_demo_rejects_a_probe_larger_than_the_data_set(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--points", "5000"])
    assert exit_info.value.code == 2
    assert "--points must be between 2 and 1797" in capsys.readouterr().err


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "topocallbacks", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "demo" in result.stdout
