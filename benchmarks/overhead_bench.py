"""Wall-time overhead of TopoCollapseCallback on a real Lightning training loop (tiny ResNet, Fashion-MNIST).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead_bench.py          # about 4 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead_bench.py --quick  # a smoke run

Three configurations are timed on the same model, data and steps, interleaved over repeats so that a busy
neighbour affects them alike: no callback, probe mode at the defaults (a check every 100 steps, 512-point probe),
and streaming mode at the defaults (32 of each training batch's points pushed into a 1,024-point window, a check
every 100 steps). Needs Fashion-MNIST: apt-get install -y dataset-fashion-mnist. Writes
benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from data import fashion_mnist  # noqa: E402

from topocallbacks.lightning import TopoCollapseCallback  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class TinyResNet(pl.LightningModule):
    def __init__(self, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(1, width, 3, padding=1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU()
        )
        self.layer1 = Block(width)
        self.down = torch.nn.Sequential(torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), torch.nn.ReLU())
        self.layer2 = Block(2 * width)
        self.avgpool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(2 * width, 10)

    def forward(self, x):
        x = self.layer2(self.down(self.layer1(self.stem(x))))
        return self.fc(self.avgpool(x).flatten(1))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def timed_fit(callbacks, loader, steps: int) -> float:
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(TinyResNet(), loader)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "overhead.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    x, y = fashion_mnist("train")
    images = torch.from_numpy(x).unsqueeze(1)
    labels = torch.from_numpy(y)
    probe = torch.from_numpy(fashion_mnist("test")[0][:512]).unsqueeze(1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images, labels),
        batch_size=128,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    steps, repeats = (60, 1) if args.quick else (300, 3)
    configs = {
        "no callback": lambda: [],
        "probe mode (defaults)": lambda: [TopoCollapseCallback(probe=probe, layer="avgpool")],
        "streaming mode (defaults)": lambda: [TopoCollapseCallback(layer="avgpool", mode="stream")],
    }
    timed_fit([], loader, 10)  # warm-up: imports, allocator
    times: dict[str, list[float]] = {name: [] for name in configs}
    for repeat in range(repeats):
        for name, make in configs.items():
            times[name].append(timed_fit(make(), loader, steps))
            print(f"repeat {repeat + 1}/{repeats}: {name}: {times[name][-1]:.2f} s")
    base = statistics.median(times["no callback"])
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(
            {
                "config": name,
                "seconds": round(median, 3),
                "ms_per_step": round(1e3 * median / steps, 2),
                "overhead_pct": round(100 * (median - base) / base, 2),
            }
        )
    print(f"\n| {'configuration':<26} | {'s / run':>8} | {'ms / step':>9} | {'overhead':>8} |")
    print(f"|{'-' * 28}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
    for row in rows:
        print(
            f"| {row['config']:<26} | {row['seconds']:>8.2f} | {row['ms_per_step']:>9.2f} | "
            f"{row['overhead_pct']:>7.2f}% |"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead_bench.py"
        + (" --quick" if args.quick else ""),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "steps": steps,
        "repeats": repeats,
        "batch_size": 128,
        "probe_size": 512,
    }
    args.output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
