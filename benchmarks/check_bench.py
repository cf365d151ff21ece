"""The whole check's CPU cost, features given: real probe features at n = 512 ... 4,096, healthy and collapsed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/check_bench.py            # about 1 minute
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/check_bench.py --quick    # n = 512 and 1,024 only

A last row times the same kind of checks on a wide layer: 512 points of 512-d features (the hidden layer of
``budget_bench.py``'s digits MLP after 300 SGD steps), the layer the overhead budget's 1-ms case watches.

What is timed is :meth:`topocallbacks.pipeline.CheckPipeline.evaluate` at the monitor's defaults (normalised
features, ε calibrated at the first check, the MMHM engine, the composite with its 256-point diagrams, diagram
drift against the previous check, the policy): the work a background worker does per probe check. The features
are a small CNN's pooled 64-d features of Fashion-MNIST test images after 300 training steps (digits when
Fashion-MNIST is not installed). Per n: a first check (ε calibrated on it), then three checks of the same images
a few steps of training later (every point moved: a real probe check), then three checks of a *collapsed* cloud:
the same points pulled 99.9 % of the way onto 4 of them, so that at the calibrated ε the graph is a few cliques,
the regime that made GUDHI's edge collapse cubic. The three checks of a kind differ only by a noise of 1e-6
(healthy) or 1e-9 (collapsed) added to each: the first of a kind flips hundreds (healthy) or tens of thousands
(collapsed) of the ε-graph's edges, the next two none, so that the engine's update then has nothing to apply (its
edge path costs the ε-graph pass alone); each row records the engine's path per check (``healthy_paths``,
``collapsed_paths``). Reported: the median time of each kind, and the peak of the Python-visible allocations
(``tracemalloc``; neither GUDHI's C++ memory nor numba's is included). Times and peaks come from two runs of the
same sequence of checks: tracing every allocation slows a check by 30-50 % at n = 512, so the timed run is not
traced. A warm-up check on 64 points first pays the process's one-off costs (lazy imports such as scipy.optimize,
loading the compiled kernels), which belong to no check. Writes ``benchmarks/results/check_bench.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from topocallbacks.pipeline import CheckPipeline  # noqa: E402
from topocallbacks.settings import MonitorSettings  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def images() -> tuple[torch.Tensor, torch.Tensor, str]:
    try:
        from data import fashion_mnist

        x, y = fashion_mnist("test")
        return torch.tensor(x).unsqueeze(1), torch.tensor(y), "Fashion-MNIST"
    except FileNotFoundError:
        from sklearn.datasets import load_digits

        data = load_digits()
        x = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
        return x, torch.tensor(data.target), "digits"


def feature_snapshots(n: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Pooled features of the first ``n`` images after 300 training steps, and after 5 more."""
    x, y, source = images()
    n = min(n, len(x))
    torch.manual_seed(0)
    from data import small_cnn_body

    body = small_cnn_body()
    head = torch.nn.Linear(64, 10)
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(0)

    def train(steps: int) -> None:
        for _ in range(steps):
            batch = torch.randint(0, len(x), (64,), generator=generator)
            loss = torch.nn.functional.cross_entropy(head(body(x[batch])), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def features() -> np.ndarray:
        with torch.no_grad():
            return body(x[:n]).double().numpy()

    train(300)
    first = features()
    train(5)
    return first, features(), source


def wide_snapshots(n: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """The 512-d hidden features of ``n`` digits after 300 SGD steps of ``budget_bench``'s MLP, and after 5 more."""
    from budget_bench import DigitsMLP, data

    loader, _ = data()
    model = DigitsMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = loader.dataset.tensors[0]
    generator = torch.Generator().manual_seed(0)

    def train(steps: int) -> None:
        for _ in range(steps):
            batch = torch.randint(0, len(x), (64,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x[batch]), loader.dataset.tensors[1][batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def features() -> np.ndarray:
        with torch.no_grad():
            return model.hidden(x[:n]).double().numpy()

    train(300)
    first = features()
    train(5)
    return first, features()


def collapsed(cloud: np.ndarray) -> np.ndarray:
    """The points pulled 99.9 % of the way onto 4 of them (cluster cores a thousand times tighter)."""
    centres = cloud[np.arange(len(cloud)) % 4]
    return centres + 1e-3 * (cloud - centres)


def timed(pipeline: CheckPipeline, cloud: np.ndarray, step: int, trace: bool) -> tuple[float, str]:
    """Milliseconds of one check, or (``trace``) the peak bytes of its Python allocations; and the engine's path."""
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    record = pipeline.evaluate(cloud, step).record
    elapsed = time.perf_counter() - start
    path = "?" if record is None or record.engine is None else record.engine.path
    if not trace:
        return elapsed * 1e3, path
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return float(peak), path


Checks = list[tuple[float, str]]


def checks(first: np.ndarray, later: np.ndarray, n: int, trace: bool) -> tuple[Checks, Checks]:
    """The healthy and collapsed checks' times (or peaks) and paths for ``n`` points, after a check calibrating ε."""
    rng = np.random.default_rng(n)
    pipeline = CheckPipeline(MonitorSettings())
    pipeline.evaluate(first[:n], 0)  # calibrates ε
    dim = later.shape[1]
    healthy = [timed(pipeline, later[:n] + 1e-6 * rng.normal(size=(n, dim)), step, trace) for step in range(1, 4)]
    squeezed = [timed(pipeline, collapsed(later[:n]) + 1e-9 * rng.normal(size=(n, dim)), s, trace) for s in range(4, 7)]
    return healthy, squeezed


def row_of(n: int, healthy: Checks, squeezed: Checks, healthy_peaks: Checks, squeezed_peaks: Checks) -> dict[str, Any]:
    """One row of the table: the medians, every check's time and path, the peaks."""
    return {
        "n": n,
        "healthy_ms": statistics.median(t for t, _ in healthy),
        "collapsed_ms": statistics.median(t for t, _ in squeezed),
        "healthy_all_ms": [round(t, 1) for t, _ in healthy],
        "collapsed_all_ms": [round(t, 1) for t, _ in squeezed],
        "healthy_paths": [path for _, path in healthy],
        "collapsed_paths": [path for _, path in squeezed],
        "healthy_peak_mib": max(peak for peak, _ in healthy_peaks) / 2**20,
        "collapsed_peak_mib": max(peak for peak, _ in squeezed_peaks) / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "check_bench.json")
    args = parser.parse_args(argv)
    sizes = (512, 1024) if args.quick else (512, 1024, 2048, 4096)
    first, later, source = feature_snapshots(max(sizes))
    warm = CheckPipeline(MonitorSettings())
    for step in range(3):  # one-off costs of the process: lazy imports, compiled kernels
        warm.evaluate(later[:64] * (1 + step), step)
    rows = []
    for n in sizes:
        if n > len(first):
            print(f"n = {n}: only {len(first)} images in {source}; skipped")
            continue
        row = row_of(n, *checks(first, later, n, trace=False), *checks(first, later, n, trace=True))
        rows.append(row)
        print(
            f"n = {n:5d}: healthy {row['healthy_ms']:8.1f} ms (peak {row['healthy_peak_mib']:6.1f} MiB), "
            f"collapsed {row['collapsed_ms']:8.1f} ms (peak {row['collapsed_peak_mib']:6.1f} MiB)",
            flush=True,
        )
    table = ["| n | healthy check ms | collapsed check ms | peak MiB (healthy / collapsed) |", "|---|---|---|---|"]
    table += [
        f"| {r['n']} | {r['healthy_ms']:.1f} | {r['collapsed_ms']:.1f} | "
        f"{r['healthy_peak_mib']:.1f} / {r['collapsed_peak_mib']:.1f} |"
        for r in rows
    ]
    print("\n".join(table))
    wide = None
    if not args.quick:  # the wide layer: 512 points of 512-d features
        wide_first, wide_later = wide_snapshots(512)
        timed_checks = checks(wide_first, wide_later, 512, trace=False)
        wide = {"dim": wide_first.shape[1], **row_of(512, *timed_checks, *checks(wide_first, wide_later, 512, True))}
        print(
            f"n = 512, d = {wide['dim']}: healthy {wide['healthy_ms']:.1f} ms, collapsed {wide['collapsed_ms']:.1f} ms"
        )
    payload = {
        "features": source,
        "machine": platform.platform(),
        "load_average": os.getloadavg(),
        "numba": importlib.util.find_spec("numba") is not None,
        "rows": rows,
        "wide": wide,
        "table": "\n".join(table),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
