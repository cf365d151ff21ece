"""A 2-process CPU ``transformers.Trainer`` run with the callback, started by ``torchrun`` (gloo), with or without
FSDP through accelerate; each rank writes what it saw to <out>/rank<r>.json.

Run as a script by the tests (under a timeout, so that a hang fails instead of blocking the suite)::

    torchrun --nproc_per_node 2 tests/integration/hf_ddp_train.py OUT ACTION [fsdp]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE, digits
from tests.integration.ranks import write_result
from topocallbacks.hf import TopoCollapseTrainerCallback


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        logits = self.head(torch.relu(self.encoder(x)))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class Report(transformers.TrainerCallback):
    def __init__(self, out: str, watched: TopoCollapseTrainerCallback) -> None:
        self.out, self.watched = out, watched
        self.rates: dict[int, float] = {}
        self.trainer: transformers.Trainer | None = None

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
        self.rates[state.global_step] = optimizer.param_groups[0]["lr"]

    def on_train_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        rank = int(os.environ.get("RANK", "0"))
        data = {
            "rank": rank,
            "world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "global_step": state.global_step,
            "history": [record.as_dict() for record in self.watched.history],
            "rates": self.rates,
            "model": type(model).__name__,
            "wrapped": [type(m).__name__ for m in self.trainer.model_wrapped.modules()][:4] if self.trainer else None,
            "fsdp": bool(self.trainer and self.trainer.is_fsdp_enabled),
        }
        write_result(self.out, rank, data)


def main(out: str, action: str, fsdp: bool) -> None:
    images, labels = digits()
    x = images.flatten(1)
    data = [{"x": x[i], "labels": labels[i]} for i in range(512)]
    policy = {**OLD_RULE, "action": action, "score": "value", "threshold": -1.0, "patience": 1, "warmup": 1,
              "cooldown": 0, "max_lr_cuts": 2, "after_max_lr_cuts": "stop"}  # fmt: skip
    callback = TopoCollapseTrainerCallback(
        probe=x[:33],
        layer="encoder",
        check_every=3,
        policy=policy,
        history_path=str(Path(out, "history.jsonl")),
        **AT_CADENCE,
    )
    extra = {"fsdp": "full_shard", "fsdp_config": {"use_orig_params": True}} if fsdp else {}
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=30, per_device_train_batch_size=16, learning_rate=0.1, lr_scheduler_type="constant",
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0,
        dataloader_num_workers=0, **extra,
    )  # fmt: skip
    trainer = transformers.Trainer(model=Net(), args=args, train_dataset=data, callbacks=[callback])
    report = Report(out, callback)
    report.trainer = trainer
    trainer.add_callback(report)
    trainer.train()
    if torch.distributed.is_initialized():  # c10d's threads joined before exit (else a rare abort at teardown)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "fsdp")
