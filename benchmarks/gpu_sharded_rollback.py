"""Rollback under the sharded strategies that only run on a GPU: Lightning's FSDPStrategy (FSDP1) and
ModelParallelStrategy (FSDP2) on CUDA, and the Hugging Face ``Trainer`` with accelerate's FSDP (versions 1 and 2).

Each case trains the small transformer of ``tests/integration/fsdp_rollback.py`` on digits, collapses its watched
``encoder`` at step 12, and must roll back at the check of step 15 to step 10's snapshot on every rank: the rank's
shards and the gathered state equal the snapshot's bit for bit, the optimizer's step counters too, the learning rate
is the snapshot's x 0.5, and the next 3 updates are skipped. The CPU cases (FSDP1 and FSDP2 in a plain loop,
ModelParallelStrategy) are tests of ``make test``; this script is their GPU counterpart.

    python benchmarks/gpu_sharded_rollback.py            # every GPU of the machine (1 is enough)
    python benchmarks/gpu_sharded_rollback.py --cases lightning_fsdp hf_fsdp2

It writes ``benchmarks/results/gpu_sharded_rollback.json`` (the GPU's name, and per case: passed, the checks, the
output's tail on failure) and prints one line per case. Without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "gpu_sharded_rollback.json"
CASES = ("lightning_model_parallel", "lightning_fsdp", "hf_fsdp1", "hf_fsdp2")


def command(case: str, out: str, devices: int) -> list[str]:
    """The process that runs ``case`` with ``devices`` GPUs, writing <out>/rank<r>.json."""
    if case.startswith("lightning"):
        strategy = "model_parallel" if case == "lightning_model_parallel" else "fsdp"
        script = ROOT / "tests" / "integration" / "lightning_sharded_rollback.py"
        return [sys.executable, str(script), out, strategy, "gpu", str(devices)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(devices)]
    return [*launcher, __file__, "--hf-worker", out, case[-1]]


def checks(ranks: list[dict[str, Any]]) -> dict[str, bool]:
    """The properties every case must have (the same as the CPU tests')."""
    found: dict[str, bool] = {}
    for rank in ranks:
        r = rank["rank"]
        actions = [(x["step"], x["action"]) for x in rank["history"] if x["kind"] == "intervention"]
        local, full, lr = rank["local"], rank["full"], rank["lr"]
        found[f"rank{r}: one rollback, at step 15"] = actions == [(15, "rollback")]
        found[f"rank{r}: shards and gathered state equal step 10's"] = (
            local["15"] == local["10"] and full["15"] == full["10"]
        )
        found[f"rank{r}: step counters equal step 10's"] = rank["steps"]["15"] == rank["steps"]["10"]
        found[f"rank{r}: rate x 0.5"] = lr["15"] == lr["10"] * 0.5
        skipped = len({local[str(s)] for s in range(15, 19)}) == 1 and local["19"] != local["18"]
        found[f"rank{r}: 3 updates skipped"] = skipped
    found["every rank has the same history"] = all(r["history"] == ranks[0]["history"] for r in ranks)
    return found


def run(case: str, devices: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command(case, out, devices), capture_output=True, text=True, env=env, timeout=900)
        files = sorted(Path(out).glob("rank*.json"))
        if len(files) != devices:
            return {"passed": False, "tail": (done.stdout + done.stderr)[-3000:]}
        found = checks([json.loads(f.read_text()) for f in files])
        return {"passed": all(found.values()), "checks": found}


# --- the Hugging Face case, one process per GPU under torchrun ------------------------------------------------------


def fsdp_args(version: str) -> dict[str, Any]:
    """accelerate's FSDP through ``TrainingArguments``, version 1 or 2."""
    return {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": int(version)}}


def hf_worker(out: str, version: str) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tests.cadence import AT_CADENCE
    from tests.integration.fsdp_rollback import MONITOR, Classifier, collapse, record_state
    from tests.integration.models import digits
    from tests.integration.ranks import write_result
    from topocallbacks.hf import TopoCollapseTrainerCallback

    images, labels = digits()
    x = images.flatten(1)

    class Model(Classifier):
        def forward(self, x, labels=None):  # type: ignore[override]
            logits = super().forward(x)
            loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
            return {"loss": loss, "logits": logits}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": x[i], "labels": labels[i]}

    class Fault(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 12:
                collapse(trainer.model_wrapped)

    class Report(TrainerCallback):
        def __init__(self) -> None:
            self.seen: dict[str, dict] = {"local": {}, "full": {}, "lr": {}, "steps": {}}

        def on_step_end(self, args, state, control, **kw):
            record_state(self.seen, state.global_step, trainer.model_wrapped, trainer.optimizer.optimizer)

    # The checks as the CPU test's (fsdp_rollback.py), at exactly their cadence: the case asserts what they decide.
    watcher = TopoCollapseTrainerCallback(probe=x[:96], layer="encoder", summary=False, **MONITOR, **AT_CADENCE)
    args = TrainingArguments(
        output_dir=out, max_steps=20, per_device_train_batch_size=32, learning_rate=3e-3, lr_scheduler_type="linear",
        report_to=[], save_strategy="no", logging_steps=1000, seed=0,
        # version "0": DDP on CPU, the same script without FSDP (what the CPU test runs to check this script)
        **({"use_cpu": True} if version == "0" else fsdp_args(version)),
    )  # fmt: skip
    report = Report()
    trainer = Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[watcher, Fault(), report])
    trainer.train()
    rank = trainer.args.process_index
    data = {"rank": rank, "history": [r.as_dict() for r in watcher.history], **report.seen}
    write_result(out, rank, data)
    if torch.distributed.is_initialized():  # c10d's threads joined before exit (else a rare abort at teardown)
        torch.distributed.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-worker":
        sys.path.insert(0, str(ROOT))
        hf_worker(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--devices", type=int, default=None, help="GPUs per case (default: all of them)")
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_sharded_rollback: no GPU here; these cases need one (their CPU counterparts run in `make test`)")
        raise SystemExit(2)
    devices = options.devices or torch.cuda.device_count()
    results = {"gpu": torch.cuda.get_device_name(0), "devices": devices, "cases": {}}
    for case in options.cases:
        results["cases"][case] = outcome = run(case, devices)
        print(f"{case}: {'passed' if outcome['passed'] else 'FAILED'}")
    RESULT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
