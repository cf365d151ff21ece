"""A 2-process CPU DDP (ddp_spawn, gloo) fit that rolls back once; each rank writes what it saw to <out>/rank<r>.json.

Both ranks collapse their encoder at step 12 (the same weights on both, so the same rank-1 rows); rank 0's check at
step 15 decides the rollback to step 10's snapshot and every rank restores its own copy. Each rank writes its
history and a hash of its training state (module, optimizer, scheduler) at every step. Run as a script by the tests
(under a timeout, so that a hang fails instead of blocking the suite).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.models import quiet_trainer
from tests.integration.ranks import write_result
from tests.integration.test_rollback_lightning import CollapsingMLP, loader, watcher


def state_hash(trainer: pl.Trainer, module: pl.LightningModule) -> str:
    """SHA-256 of every tensor's bytes and every other value of the module, optimizer and scheduler states."""
    digest = hashlib.sha256()

    def feed(tree):
        if isinstance(tree, torch.Tensor):
            digest.update(tree.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(tree, dict):
            for key in sorted(tree, key=str):
                digest.update(str(key).encode())
                feed(tree[key])
        elif isinstance(tree, (list, tuple)):
            for item in tree:
                feed(item)
        else:
            digest.update(repr(tree).encode())

    feed(module.state_dict())
    feed(trainer.optimizers[0].state_dict())
    feed(trainer.lr_scheduler_configs[0].scheduler.state_dict())
    return digest.hexdigest()


class Report(pl.Callback):
    """After the topology callback: the state's hash at every step, then the history at the end."""

    def __init__(self, out: str, watched) -> None:
        self.out, self.watched, self.hashes = out, watched, {}

    def on_train_start(self, trainer, pl_module):
        self.hashes[trainer.global_step] = state_hash(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.hashes[trainer.global_step] = state_hash(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        data = {
            "rank": trainer.global_rank,
            "world": trainer.world_size,
            "global_step": trainer.global_step,
            "history": [record.as_dict() for record in self.watched.history],
            "hashes": self.hashes,
        }
        write_result(self.out, trainer.global_rank, data)


def main(out: str) -> None:
    callback = watcher()
    trainer = quiet_trainer(out, [callback, Report(out, callback)], 20, devices=2, strategy="ddp_spawn")
    trainer.fit(CollapsingMLP(collapse_at={12}), loader())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing

    # Sharing tensors with child processes through file descriptors fails on some sandboxed machines (even for a
    # plain Lightning ddp_spawn fit without this package); the file-system strategy works everywhere.
    torch.multiprocessing.set_sharing_strategy("file_system")
    main(sys.argv[1])
