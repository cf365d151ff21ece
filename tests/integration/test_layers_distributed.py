"""Several layers in a real 2-process CPU DDP fit (Lightning ``ddp_spawn``, gloo): one gathered probe pass per
check for all layers, the same records on both ranks, one action per check on both."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import ENV, finished
from tests.waiting import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pathlib import Path
import lightning.pytorch as pl
import torch.multiprocessing
sys.path.insert(0, {root!r})
from tests.integration.models import OLD_RULE, TinyCNN, digits, digits_loader, quiet_trainer
from tests.cadence import AT_CADENCE
from tests.integration.ranks import write_result
from topocallbacks.lightning import TopoCollapseCallback


class Report(pl.Callback):
    def __init__(self, out, watched):
        self.out, self.watched = out, watched

    def on_train_end(self, trainer, pl_module):
        data = {{
            "history": [record.as_dict() for record in self.watched.history],
            "metrics": {{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("topo/")}},
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }}
        write_result(self.out, trainer.global_rank, data)


if __name__ == "__main__":
    torch.multiprocessing.set_sharing_strategy("file_system")
    out = sys.argv[1]
    probe, _ = digits(33)
    policy = {{**OLD_RULE, "action": "lower_lr", "score": "value", "threshold": -1.0, "patience": 1, "warmup": 1,
               "cooldown": 100, "max_lr_cuts": 1, "after_max_lr_cuts": "none", "layer_rule": "any"}}
    callback = TopoCollapseCallback(probe=probe, layer="avgpool", layers=["backbone.1", "backbone.3"], check_every=10,
                                    policy=policy, background=sys.argv[2] == "background", lag=3, **AT_CADENCE)
    trainer = quiet_trainer(out, [callback, Report(out, callback)], 30, devices=2, strategy="ddp_spawn")
    trainer.fit(TinyCNN(lr=0.02), digits_loader(batch_size=32))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inline", "background"])
def test_two_ranks_agree_on_every_layer_and_cut_once(tmp_path, mode):
    script = tmp_path / "ddp_layers.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    env = {**os.environ, **ENV}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=HANG_SECONDS,
        env=env,
    )
    ranks = finished(result, tmp_path)
    assert ranks[0]["history"] == ranks[1]["history"]  # every layer's values and the decisions, on both ranks
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    checks = [r for r in ranks[0]["history"] if r["kind"] == "check"]
    assert [(r["step"], r["layer"]) for r in checks[:3]] == [(0, "backbone.1"), (0, "backbone.3"), (0, "avgpool")]
    assert {r["layer"] for r in checks} == {"avgpool", "backbone.1", "backbone.3"}
    assert all(r["n_points"] == 33 for r in checks)  # 17 + 16 probe samples gathered, the padding row dropped
    cuts = [r for r in ranks[0]["history"] if r["kind"] == "intervention"]
    assert [(r["step"], r["action"]) for r in cuts] == [(10 + (3 if mode == "background" else 0), "lower_lr")]
    assert ranks[0]["lr"] == ranks[1]["lr"] == pytest.approx(0.01)
    assert {"topo/avgpool/index", "topo/backbone.1/index", "topo/backbone.3/index"} <= set(ranks[0]["metrics"])
