"""A 2-process fit under Lightning's ModelParallelStrategy (FSDP2 applied in ``configure_model``) or FSDPStrategy
(FSDP1, GPU only) that rolls back once; each rank writes what it saw to <out>/rank<r>.json.

The model and the fault are ``fsdp_rollback.py``'s: the watched ``encoder`` collapses at step 12, the check at 15
rolls back to step 10's snapshot with a cut of 0.5 and a skip of 3 updates. Each rank records hashes of its own
shards and of the gathered state at every step (after the topology callback). Lightning launches the second process
itself (this script run again), so the tests run it as a plain script, under a timeout:
``python tests/integration/lightning_sharded_rollback.py OUT [model_parallel|fsdp] [cpu|gpu] [devices]`` (defaults:
model_parallel, cpu, 2; ``benchmarks/gpu_sharded_rollback.py`` runs the GPU cases).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cadence import AT_CADENCE
from tests.integration.fsdp_rollback import MONITOR, Classifier, collapse, record_state
from tests.integration.models import digits
from tests.integration.ranks import write_result
from topocallbacks.lightning import TopoCollapseCallback

IMAGES, LABELS = digits()
X = IMAGES.flatten(1)


class Sharded(pl.LightningModule):
    def __init__(self, fsdp2: bool = True) -> None:
        super().__init__()
        self.net = Classifier()
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        if not self.fsdp2:
            return  # FSDPStrategy wraps the module itself
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net.block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 12:
            collapse(self.trainer.strategy.model)  # the module, or FSDPStrategy's FSDP root around it
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Report(pl.Callback):
    """After the topology callback: hashes of the state at every step, the rate, the history at the end."""

    def __init__(self, out: str, watched: TopoCollapseCallback) -> None:
        self.out, self.watched = out, watched
        self.seen: dict = {"local": {}, "full": {}, "lr": {}, "steps": {}}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        record_state(self.seen, trainer.global_step, trainer.strategy.model, trainer.optimizers[0])

    def on_train_end(self, trainer, pl_module):
        data = {"rank": trainer.global_rank, "history": [r.as_dict() for r in self.watched.history], **self.seen}
        write_result(self.out, trainer.global_rank, data)


def main(out: str, strategy: str = "model_parallel", accelerator: str = "cpu", devices: str = "2") -> None:
    callback = TopoCollapseCallback(probe=X[:96], layer="net.encoder", summary=False, **MONITOR, **AT_CADENCE)
    n = int(devices)
    chosen = (
        ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1)
        if strategy == "model_parallel"
        else (FSDPStrategy())
    )
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=n,
        strategy=chosen,
        max_steps=20,
        callbacks=[callback, Report(out, callback)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(X, LABELS)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer.fit(Sharded(fsdp2=strategy == "model_parallel"), loader)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:5])
