"""Two CPU processes (gloo) train a small transformer sharded with FSDP2 (``fully_shard``) or FSDP1
(``FullyShardedDataParallel``) in a plain loop, with a ``TopoMonitor`` that rolls back; each rank writes what it saw
to <out>/rank<r>.json.

The watched ``encoder`` (a linear layer after the transformer block) is collapsed at steps 12 and 22 (every weight
row made equal to the first: rank-one features), so the checks at 15 and 25 roll back, to the snapshots of 10 and
20, with a learning-rate cut of 0.5 that compounds and a skip of 3 updates. In ``fail`` mode rank 1's copy of the
snapshot at step 20 fails: both ranks then go back to step 10, the newest snapshot every rank holds. In ``disk``
mode the snapshots are files (``snapshot_dir``), one per rank; in ``kill`` mode too, and rank 1 is killed
(SIGKILL) in the middle of its snapshot at step 20.

At every step, after the monitor acted, each rank records a hash of its own shards (parameters, optimizer state) and
of the gathered full state, the step counters and the learning rate. Run by the tests as
``torchrun --nproc_per_node 2 tests/integration/fsdp_rollback.py OUT {fsdp2,fsdp1} {plain,fail,disk,kill}``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE, digits
from tests.integration.ranks import write_result
from topocallbacks import TopoMonitor
from topocallbacks.interventions import LoopActuator, current_learning_rates

RULE = {**OLD_RULE, "action": "rollback", "score": "value", "threshold": -4.0, "patience": 1, "warmup": 1}
RULE |= {"cooldown": 0, "sentinels": False, "rollback_lr_factor": 0.5, "rollback_skip": 3, "max_rollbacks": 2}
#: The monitor the sharded scripts build (here and `lightning_sharded_rollback.py`): a check of the effective rank
#: every 5 steps under `RULE`, 16 probe samples a pass.
MONITOR = {"check_every": 5, "index": "rankme", "policy": RULE, "batch_size": 16}
COLLAPSE_AT = (12, 22)
STEPS = 30


class Classifier(torch.nn.Module):
    """Digits as 8 tokens of 8 pixels: embedding, one transformer block, mean over tokens, ``encoder``, head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 32)
        self.block = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.block(self.embed(x.view(-1, 8, 8)))
        return self.head(torch.relu(self.encoder(tokens.mean(1))))


def sharded(kind: str) -> torch.nn.Module:
    net = Classifier()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(net.block)
        return fully_shard(net)
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(net, device_id=torch.device("cpu"), use_orig_params=True)


def tensors(tree: Any, local: bool):
    """The tensors of a state tree in a fixed order (a sharded tensor as this rank's shards, or gathered)."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield str(key), None
            yield from tensors(tree[key], local)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from tensors(item, local)
    elif type(tree).__name__ == "DTensor":
        yield "", tree.to_local() if local else tree.full_tensor()
    elif type(tree).__name__ == "ShardedTensor":
        if local:
            for shard in tree.local_shards():
                yield "", shard.tensor
        else:
            full = torch.zeros(tree.size(), dtype=tree.dtype) if dist.get_rank() == 0 else None
            tree.gather(0, full)
            full = full if full is not None else torch.zeros(tree.size(), dtype=tree.dtype)
            dist.broadcast(full, 0)
            yield "", full
    elif isinstance(tree, torch.Tensor):
        yield "", tree
    else:
        yield repr(tree), None


def digest(tree: Any, local: bool) -> str:
    out = hashlib.sha256()
    for text, tensor in tensors(tree, local):
        out.update(text.encode())
        if tensor is not None:
            out.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return out.hexdigest()


def record_state(seen: dict[str, Any], step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """Into ``seen`` at ``step``: hashes of this rank's shards and of the gathered state (parameters, optimizer
    state), the learning rate and the optimizer's step counters; returns the model's sharded state dict.

    The optimizer state is read only once it exists: the helper would create it with a step of zero gradients.
    """
    options = StateDictOptions(full_state_dict=False)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else {"state": {}}
    state = {"model": model_state, "optimizer": optim_state["state"]}
    seen["local"][step] = digest(state, local=True)
    seen["full"][step] = digest(state, local=False)
    seen["lr"][step] = current_learning_rates([optimizer])[0]
    seen["steps"][step] = sorted({float(v["step"]) for v in optim_state["state"].values()})
    return model_state


def collapse(net: torch.nn.Module) -> None:
    """Every row of ``encoder.weight`` made equal to its first (on the rank that holds it, broadcast to the rest)."""
    options = StateDictOptions(full_state_dict=False)
    state = get_model_state_dict(net, options=options)
    key = next(k for k in state if k.endswith("encoder.weight"))
    weight = state[key]
    full = next(tensors(weight, local=False))[1].clone()
    collapsed = full[:1].expand_as(full).contiguous()
    state[key] = _like(weight, collapsed)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(net, state, options=options)


def _like(sharded_value: Any, full: torch.Tensor) -> Any:
    if type(sharded_value).__name__ == "DTensor":
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, sharded_value.device_mesh, sharded_value.placements)
    if type(sharded_value).__name__ != "ShardedTensor":
        return full  # not sharded (DDP)
    for shard in sharded_value.local_shards():  # ShardedTensor: write this rank's rows
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[offsets[0] : offsets[0] + sizes[0]])
    return sharded_value


def main(out: str, kind: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    images, labels = digits()
    x = images.flatten(1)
    net = sharded(kind)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
    on_disk = {"snapshot_dir": str(Path(out, "snapshots"))} if mode in ("disk", "kill") else {}
    monitor = TopoMonitor(probe=x[:96], layer="encoder", **MONITOR, **on_disk, **AT_CADENCE)
    actuator = LoopActuator(optimizer, scheduler, model=net)
    now = [0]  # the step being acted on
    if mode in ("fail", "kill") and rank == 1:
        take = actuator.snapshot

        def failing() -> Any:
            if now[0] == 20 and mode == "kill":
                take()
                os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of its snapshot, before it is kept
            if now[0] == 20:
                raise MemoryError("injected: no room for this copy")
            return take()

        actuator.snapshot = failing  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(100 + rank)
    options = StateDictOptions(full_state_dict=False)
    seen: dict[str, Any] = {"local": {}, "full": {}, "lr": {}, "steps": {}, "local_numel": {}}
    caught = warnings.catch_warnings(record=True)
    said = caught.__enter__()
    warnings.simplefilter("always", RuntimeWarning)
    for step in range(STEPS + 1):
        if step:
            if step - 1 in COLLAPSE_AT:
                collapse(net)
            batch = torch.randint(0, len(x), (32,), generator=generator)
            loss = torch.nn.functional.cross_entropy(net(x[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        now[0] = step
        for record in monitor.on_step(step, model=net):
            monitor.act(record, actuator)
        model_state = record_state(seen, step, net, optimizer)
        seen["local_numel"][step] = sum(t.numel() for _, t in tensors(model_state, local=True) if t is not None)
    caught.__exit__(None, None, None)
    seen["warnings"] = [str(w.message) for w in said if "topocallbacks" in str(w.message)]
    full_numel = sum(
        t.numel() for _, t in tensors(get_model_state_dict(net, options=options), local=False) if t is not None
    )
    data = {
        "rank": rank,
        "history": [r.as_dict() for r in monitor.history],
        "full_numel": full_numel,
        "snapshots": monitor.rescuer.healthy.store.describe(),
        "files": sorted(p.name for p in Path(out, "snapshots").glob("*")) if mode == "disk" else [],
        **seen,
    }
    write_result(out, rank, data)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:4])
