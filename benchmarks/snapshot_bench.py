"""What a rollback snapshot costs the training loop: the copy of the model and optimizer state, and its restore.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/snapshot_bench.py            # about a minute on one core
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/snapshot_bench.py --quick    # a smoke run

For MLPs of 0.04 M (the digits MLP of ``budget_bench.py``), 0.5 M, 6 M and 42 M parameters with AdamW's state
(parameters + two moments: 12 bytes a parameter in float32): the time ``capture_state`` holds the loop, the time
until the host copy is complete (the same on CPU; on a GPU the copies go to pinned memory without blocking, and the
difference is what the asynchronous copy hides), the restore, and the copy's bandwidth (median of 5 each). On a GPU
it runs on the GPU too. Writes benchmarks/results/snapshot.json and snapshot.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from topocallbacks.snapshots import SnapshotStore, capture_state, restore_state, state_nbytes  # noqa: E402

#: (input width, width, hidden layers): the digits MLP of budget_bench.py, then about 0.5 M, 6 M and 42 M parameters.
SIZES = {"digits MLP": (64, 512, 1), "small": (512, 1024, 1), "medium": (1024, 2048, 2), "large": (2048, 4096, 3)}


def model_and_optimizer(width_in: int, width: int, depth: int, device: str):
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(width_in, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.randn(8, width_in, device=device)).sum()
    loss.backward()
    optimizer.step()  # the moments exist
    return model, optimizer


def measure(name: str, device: str, repeats: int) -> dict:
    model, optimizer = model_and_optimizer(*SIZES[name], device)
    held, complete, restored = [], [], []
    nbytes = 0
    for _ in range(repeats):
        store = SnapshotStore(keep=1)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        payload = capture_state(model, [optimizer], [])
        held.append(time.perf_counter() - start)
        snapshot = store.add(0, payload, None)
        snapshot.wait()
        complete.append(time.perf_counter() - start)
        nbytes = snapshot.nbytes
        start = time.perf_counter()
        restore_state(snapshot.load(), model, [optimizer], [])
        if device == "cuda":
            torch.cuda.synchronize()
        restored.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    ms = {k: 1e3 * statistics.median(v) for k, v in (("held", held), ("complete", complete), ("restore", restored))}
    return {
        "model": name,
        "device": device,
        "parameters": params,
        "snapshot_mb": nbytes / 2**20,
        "loop_held_ms": ms["held"],
        "copy_complete_ms": ms["complete"],
        "restore_ms": ms["restore"],
        "gb_per_s": nbytes / 2**30 / (ms["complete"] / 1e3),
        "live_mb": state_nbytes(model.state_dict()) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the two smallest models, 2 repeats")
    options = parser.parse_args()
    names = list(SIZES)[:2] if options.quick else list(SIZES)
    repeats = 2 if options.quick else 5
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = [measure(name, device, repeats) for device in devices for name in names]
    where = f"{platform.machine()}, torch {torch.__version__}" + (
        f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    )
    out = ROOT / "benchmarks" / "results"
    if not options.quick:
        (out / "snapshot.json").write_text(json.dumps({"where": where, "rows": rows}, indent=2) + "\n")
    lines = [
        "# What a rollback snapshot costs the loop",
        "",
        f"`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/snapshot_bench.py` ({where}); MLPs with AdamW's state, "
        f"median of {repeats}.",
        "",
        "| model | parameters | device | snapshot | loop held | copy complete | restore | copy GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.2f} M | {r['device']} | {r['snapshot_mb']:.1f} MiB | "
            f"{r['loop_held_ms']:.2f} ms | "
            f"{r['copy_complete_ms']:.2f} ms | {r['restore_ms']:.2f} ms | {r['gb_per_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    if not options.quick:
        (out / "snapshot.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
