"""A 2-process CPU DDP (ddp_spawn, gloo) fit with the callback; each rank writes what it saw to <out>/rank<r>.json.

Run as a script by the tests (under a timeout, so that a hang fails instead of blocking the suite).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.models import OLD_RULE, TinyCNN, digits, digits_loader, quiet_trainer
from tests.integration.ranks import write_result
from topocallbacks import Policy
from topocallbacks.lightning import TopoCollapseCallback


class Report(pl.Callback):
    def __init__(self, out: str, watched: TopoCollapseCallback):
        self.out, self.watched = out, watched

    def on_train_end(self, trainer, pl_module):
        data = {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "history": [record.as_dict() for record in self.watched.history],
            "logged_ci": float(trainer.callback_metrics["topo/ci"]),
        }
        write_result(self.out, trainer.global_rank, data)


def main(out: str, action: str, probe_size: int, mode: str) -> None:
    """``mode``: "inline" or "background" (decisions 3 steps later), or "budget" (a budget far below what the checks
    cost, `background` and `lag` automatic: rank 0 plans once and every rank follows its plan)."""
    probe, _ = digits(probe_size)
    rule = {"action": action, "threshold": 0.15, "score": "baseline", "patience": 2, "warmup": 2, "cooldown": 5}
    policy = Policy(**{**OLD_RULE, **rule})
    budget = mode == "budget"
    callback = TopoCollapseCallback(
        probe=probe,
        layer="avgpool",
        check_every=10,
        policy=policy,
        history_path=str(Path(out, "history.jsonl")),
        background=None if budget else mode == "background",
        lag=None if budget else 3,
        overhead_budget=0.001 if budget else None,  # None: the checks exactly as configured (tests/cadence.py)
    )
    trainer = quiet_trainer(out, [callback, Report(out, callback)], 200, devices=2, strategy="ddp_spawn")
    trainer.fit(TinyCNN(lr=0.02, scheduler="ramp", lr_growth=1.1), digits_loader(batch_size=32))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing

    # Sharing tensors with child processes through file descriptors fails on some sandboxed machines (even for a
    # plain Lightning ddp_spawn fit without this package); the file-system strategy works everywhere.
    torch.multiprocessing.set_sharing_strategy("file_system")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
