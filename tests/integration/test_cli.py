import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.waiting import HANG_SECONDS

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_demo_command_writes_into_its_default_folder_only(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "topocallbacks", "demo", "--seed", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_SECONDS,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "topocallbacks-demo"
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    written = sorted(p.name for p in folder.iterdir())
    assert written in (
        ["curves.csv", "protected-history.jsonl", "report", "rescue.png"],
        ["curves.csv", "protected-history.jsonl"],
    )
    assert f"history: {folder / 'protected-history.jsonl'}" in result.stdout
    assert "picture: " in result.stdout
    assert "report:  " in result.stdout
    if "report" in written:
        assert (folder / "report" / "index.html").is_file()
    protected = next(line for line in result.stdout.splitlines() if line.startswith("protected "))
    assert "->" in protected  # rolled back
    assert "rollback (rolled back to the snapshot of step" in result.stdout  # the summary


@pytest.mark.slow
def test_lightning_cli_configures_the_callback_from_yaml(tmp_path):
    pytest.importorskip("jsonargparse")
    (tmp_path / "config.yaml").write_text(
        textwrap.dedent(
            """
            trainer:
              max_steps: 10
              accelerator: cpu
              devices: 1
              logger: false
              enable_checkpointing: false
              enable_progress_bar: false
              callbacks:
                - class_path: topocallbacks.lightning.TopoCollapseCallback
                  init_args:
                    preset: resnet
                    probe: train
                    settings:
                      check_every: 5
                      max_probe_samples: 64
                      policy:
                        patience: 4
            """
        )
    )
    (tmp_path / "cli.py").write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            from lightning.pytorch.cli import LightningCLI
            from tests.integration.models import DigitsData, TinyCNN
            cli = LightningCLI(TinyCNN, DigitsData, save_config_kwargs={{"overwrite": True}})
            callback = next(c for c in cli.trainer.callbacks if type(c).__name__ == "TopoCollapseCallback")
            print("CHECKS", [r.step for r in callback.history if r.kind == "check"])
            print("PATIENCE", callback.monitor.policy.settings.patience, callback.monitor.policy.settings.threshold)
            print("PROBE", callback.monitor.probe.spec.source, callback.monitor.probe.spec.n_samples)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "cli.py", "fit", "--config", "config.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_SECONDS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CHECKS [0, 5, 10]" in result.stdout
    assert "PATIENCE 4 4.5" in result.stdout  # the override merged into the preset's policy
    assert "PROBE dataset:TensorDataset 64" in result.stdout
