"""Two CPU processes (gloo) train an MLP sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) in a plain loop
with a ``TopoMonitor``; each rank writes what it saw to <out>/rank<r>.json. (FSDP1 runs on CPU too, with
``device_id=torch.device("cpu")``: ``fsdp_rollback.py``; Lightning's FSDPStrategy and accelerate's FSDP refuse a
machine without an accelerator.)

Run by the tests as ``torchrun --nproc_per_node 2 tests/integration/fsdp_check.py OUT`` (under a timeout).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE, digits
from tests.integration.ranks import write_result
from topocallbacks import TopoMonitor
from topocallbacks.interventions import scale_learning_rate
from topocallbacks.probe import FeatureExtractor, Probe


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )


class Actuator:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def scale_learning_rate(self, factor: float) -> str:
        scale_learning_rate([self.optimizer], [], factor)
        return f"learning rate x {factor}"

    def request_stop(self) -> str:
        return "stop requested"

    def checkpoint_location(self, tag: str) -> str:
        return "no checkpoint"

    def save_checkpoint(self, tag: str) -> None:
        pass


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    images, labels = digits()
    x = images.flatten(1)
    probe = x[:33]  # 17 + 16 samples: the ranks' shards differ in size, their forward passes must not
    reference = model()
    unsharded = FeatureExtractor(layer="2")(reference, Probe(probe))
    net = model()
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer)
    fully_shard(net)
    # The probe pass through the sharded model gives the unsharded model's features (every rank runs it whole).
    sharded = FeatureExtractor(layer="2", batch_size=8)(net, Probe(probe))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    policy = {**OLD_RULE, "action": "lower_lr", "score": "value", "threshold": -1.0, "patience": 1, "warmup": 1}
    policy |= {"cooldown": 0}
    # batch_size 8: rank 0's 17 samples would take 3 forward passes and rank 1's 16 only 2 without the padding
    monitor = TopoMonitor(probe=probe, layer="2", check_every=5, policy=policy, batch_size=8, **AT_CADENCE)
    generator = torch.Generator().manual_seed(rank)
    records = []
    for step in range(11):
        if step:
            batch = torch.randint(0, len(x), (32,), generator=generator)
            loss = torch.nn.functional.cross_entropy(net(x[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        for record in monitor.on_step(step, model=net):
            monitor.act(record, Actuator(optimizer))
            records.append(record)
    data = {
        "rank": rank,
        "model": type(net).__name__,
        "watched": monitor.extractor.resolved_layer_ if monitor.extractor else None,
        "history": [r.as_dict() for r in monitor.history],
        "lr": optimizer.param_groups[0]["lr"],
        "feature_error": float(abs(sharded - unsharded).max()),
        "first_ci": records[0].report.ci,
        "unsharded_ci": TopoMonitor(check_every=1, **AT_CADENCE).process(unsharded, 0).report.ci,
    }
    write_result(out, rank, data)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
