"""MMHM engine against from-scratch Betti numbers, on the same inputs, with exact agreement checked.

Run from the repository root (after `make test` or `make demo` created .venv):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mmhm_bench.py            # full run, ~5 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mmhm_bench.py --quick    # smaller, for a smoke test

Baselines, each from scratch on the same points and ε:
  gudhi      GUDHI's RipsComplex(points, max_edge_length=ε) -> edge collapse -> expansion(2) -> persistence
  ripser     ripser(points, maxdim=1, thresh=ε)
  scratch    topocallbacks.functional.betti_numbers: BLAS ε-graph + GUDHI edge collapse (the strongest)

Scenarios:
  probe      n = 1024 clustered points in d = 64; at each update 1 %, 5 %, 25 % or 100 % of the points move
  stream     windows of 1,024 and 2,048, batches of 32 and 64, d = 64, clustered clouds
  trace      probe features recorded from real training runs of a tiny MLP on scikit-learn digits (recorded by
             this script into benchmarks/traces/ when missing), checked every 5 and every 100 steps

Prints a table and writes benchmarks/results/mmhm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gudhi
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from topocallbacks import MMHM  # noqa: E402
from topocallbacks.functional import betti_numbers, epsilon_heuristic  # noqa: E402

TRACES = ROOT / "benchmarks" / "traces"
RESULTS = ROOT / "benchmarks" / "results"


# --- inputs -------------------------------------------------------------------------------------------------


class ClusteredSource:
    """Class-structured embeddings: Gaussian blobs of varied width around well separated centres."""

    def __init__(self, dim: int, clusters: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.centres = self.rng.normal(scale=3.0, size=(clusters, dim))

    def sample(self, m: int) -> np.ndarray:
        labels = self.rng.integers(0, len(self.centres), m)
        widths = self.rng.uniform(0.6, 1.4, size=(m, 1))
        return self.centres[labels] + self.rng.normal(size=(m, self.centres.shape[1])) * widths


def record_trace(path: Path, interval: int, checks: int, seed: int = 0) -> None:
    """Train a small MLP on digits and save its 64-d penultimate features of a fixed 1,024-point probe."""
    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(seed)
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    probe = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:1024]]
    body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU())
    head = torch.nn.Linear(64, 10)
    optimiser = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.05, momentum=0.9)
    frames = []
    step = 0
    generator = torch.Generator().manual_seed(seed)
    while len(frames) < checks:
        for batch in torch.randperm(len(x), generator=generator).split(32):
            if step % interval == 0:
                with torch.no_grad():
                    frames.append(body(probe).numpy().copy())
                if len(frames) == checks:
                    break
            loss = torch.nn.functional.cross_entropy(head(body(x[batch])), y[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            step += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, features=np.stack(frames), interval=interval)


def load_trace(name: str, interval: int, checks: int, use: int) -> np.ndarray:
    """The first ``use`` frames of a recorded trace of ``checks`` frames (recorded here when missing)."""
    path = TRACES / f"{name}.npz"
    if not path.exists() or len(np.load(path)["features"]) < checks:
        print(f"recording trace {path.relative_to(ROOT)} (tiny MLP on digits, every {interval} steps)")
        record_trace(path, interval, checks)
    return np.load(path)["features"][:use].astype(np.float64)


# --- baselines ----------------------------------------------------------------------------------------------


def gudhi_betti(points: np.ndarray, epsilon: float) -> tuple[int, int]:
    tree = gudhi.RipsComplex(points=points, max_edge_length=epsilon).create_simplex_tree(max_dimension=1)
    tree.collapse_edges()
    tree.expansion(2)
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=True)
    betti = tree.betti_numbers()
    return int(betti[0]), int(betti[1]) if len(betti) > 1 else 0


def ripser_betti(points: np.ndarray, epsilon: float) -> tuple[int, int]:
    import ripser

    diagrams = ripser.ripser(points, maxdim=1, thresh=epsilon)["dgms"]
    return tuple(int(np.isinf(d[:, 1]).sum()) for d in diagrams)  # type: ignore[return-value]


def scratch_betti(points: np.ndarray, epsilon: float) -> tuple[int, int]:
    return tuple(betti_numbers(points, epsilon))  # type: ignore[return-value]


BASELINES: dict[str, Callable[[np.ndarray, float], tuple[int, int]]] = {
    "gudhi": gudhi_betti,
    "ripser": ripser_betti,
    "scratch": scratch_betti,
}


def timed(function: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


# --- runs ---------------------------------------------------------------------------------------------------


class Run:
    """Engine times, baseline times on the same inputs, and the agreement check, for one scenario."""

    def __init__(self, name: str, kind: str, **params: object) -> None:
        self.name, self.kind, self.params = name, kind, params
        self.engine_s: list[float] = []
        self.paths: list[str] = []
        self.predicted_s: list[float] = []
        self.baseline_s: dict[str, list[float]] = {name: [] for name in BASELINES}
        self.engine_s_compared: list[float] = []
        self.mismatches = 0
        self.compared = 0
        self.memory: list[tuple[int, int]] = []  # (predicted, measured) peak bytes of new arrays

    def measure_memory(self, engine: MMHM, update: Callable[[], object]) -> None:
        """One more update under tracemalloc (after the timed ones: tracing slows allocation)."""
        tracemalloc.start()
        update()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.memory.append((engine.last_stats.predicted_bytes, peak))

    def record_engine(self, engine: MMHM, seconds: float) -> None:
        self.engine_s.append(seconds)
        self.paths.append(engine.last_stats.path)
        self.predicted_s.append(engine.last_stats.predicted_ms / 1e3)

    def compare(self, engine: MMHM, points: np.ndarray, epsilon: float, baselines: list[str]) -> None:
        expected = tuple(engine.betti_numbers())
        self.engine_s_compared.append(self.engine_s[-1])
        self.compared += 1
        for name in BASELINES:
            if name not in baselines:
                continue
            seconds, result = timed(lambda name=name: BASELINES[name](points, epsilon))
            self.baseline_s[name].append(seconds)
            if tuple(result) != expected:  # type: ignore[arg-type]
                self.mismatches += 1
                print(f"  MISMATCH {self.name}: engine {expected} vs {name} {result}")

    def summary(self) -> dict[str, object]:
        engine_ms = 1e3 * statistics.median(self.engine_s)
        compared_ms = 1e3 * statistics.median(self.engine_s_compared)
        baselines = {name: 1e3 * statistics.median(v) for name, v in self.baseline_s.items() if v}
        best_name = min(baselines, key=baselines.__getitem__)
        # Prediction error after the model's first three observations of a path.
        errors = [
            abs(p - m) / m
            for i, (p, m) in enumerate(zip(self.predicted_s, self.engine_s, strict=True))
            if i >= 3 and p == p and m > 0
        ]
        paths = {path: self.paths.count(path) for path in sorted(set(self.paths))}
        return {
            "scenario": self.name,
            "kind": self.kind,
            **self.params,
            "updates": len(self.engine_s),
            "paths": paths,
            "engine_median_ms": round(engine_ms, 3),
            "baseline_median_ms": {k: round(v, 3) for k, v in baselines.items()},
            "best_baseline": best_name,
            "speedup_vs_best": round(baselines[best_name] / compared_ms, 2),
            # All engine updates (exploration and the one-off module build after a rebuild included) against the
            # best baseline's median time for as many updates.
            "total_speedup_vs_best": round(baselines[best_name] / 1e3 * len(self.engine_s) / sum(self.engine_s), 2),
            "speedup_vs": {k: round(v / compared_ms, 2) for k, v in baselines.items()},
            "predictions_within_30pct": round(sum(e <= 0.3 for e in errors) / len(errors), 3) if errors else None,
            "memory_predicted_over_measured": [round(p / m, 2) for p, m in self.memory],
            "memory_within_30pct": round(sum(abs(p - m) <= 0.3 * m for p, m in self.memory) / len(self.memory), 3)
            if self.memory
            else None,
            "compared_updates": self.compared,
            "exact": self.mismatches == 0,
        }


def probe_scenario(fraction: float, n: int, dim: int, updates: int, baselines: list[str]) -> Run:
    source = ClusteredSource(dim, 10, seed=1)
    cloud = source.sample(n)
    epsilon = epsilon_heuristic(cloud)
    run = Run(f"probe {fraction:.0%} move", "probe", n=n, d=dim, moved_fraction=fraction)
    engine = MMHM(epsilon=epsilon)
    engine.update(cloud)
    rng = np.random.default_rng(2)
    for _ in range(updates):
        cloud = cloud.copy()
        moved = rng.choice(n, size=max(1, round(fraction * n)), replace=False)
        cloud[moved] += rng.normal(scale=0.4, size=(moved.size, dim))
        seconds, _ = timed(lambda cloud=cloud: engine.update(cloud))
        run.record_engine(engine, seconds)
        run.compare(engine, cloud, epsilon, baselines)
    for _ in range(3):
        cloud = cloud.copy()
        moved = rng.choice(n, size=max(1, round(fraction * n)), replace=False)
        cloud[moved] += rng.normal(scale=0.4, size=(moved.size, dim))
        run.measure_memory(engine, lambda cloud=cloud: engine.update(cloud))
    return run


def stream_scenario(window: int, batch: int, dim: int, updates: int, compare_every: int, baselines: list[str]) -> Run:
    source = ClusteredSource(dim, 10, seed=3)
    first = source.sample(window)
    epsilon = epsilon_heuristic(first)
    run = Run(f"stream W={window} b={batch}", "stream", window=window, batch=batch, d=dim)
    engine = MMHM(epsilon=epsilon, window=window)
    engine.push(first)
    for i in range(updates):
        new = source.sample(batch)
        seconds, _ = timed(lambda new=new: engine.push(new))
        run.record_engine(engine, seconds)
        if i % compare_every == 0:
            run.compare(engine, engine.points, epsilon, baselines)
    for _ in range(3):
        new = source.sample(batch)
        run.measure_memory(engine, lambda new=new: engine.push(new))
    return run


def trace_scenario(name: str, interval: int, checks: int, use: int, baselines: list[str]) -> Run:
    frames = load_trace(name, interval, checks, use)
    epsilon = epsilon_heuristic(frames[0])
    run = Run(f"trace {name}", "trace", n=frames.shape[1], d=frames.shape[2], interval=interval)
    engine = MMHM(epsilon=epsilon)
    engine.update(frames[0])
    for frame in frames[1:]:
        seconds, _ = timed(lambda frame=frame: engine.update(frame))
        run.record_engine(engine, seconds)
        run.compare(engine, frame, epsilon, baselines)
    for frame in frames[-4:-1]:
        run.measure_memory(engine, lambda frame=frame: engine.update(frame))
    return run


def format_table(rows: list[dict[str, object]]) -> str:
    header = (
        f"| {'scenario':<25} | {'paths':<28} | {'engine ms':>9} | {'scratch ms':>10} | {'gudhi ms':>8} | "
        f"{'ripser ms':>9} | {'x best':>6} | {'x total':>7} | {'pred ±30%':>9} | {'mem ±30%':>8} | exact |"
    )
    lines = [header, "|" + "|".join("-" * (len(part)) for part in header.split("|")[1:-1]) + "|"]
    for row in rows:
        b = row["baseline_median_ms"]
        assert isinstance(b, dict)
        paths = ", ".join(f"{k} {v}" for k, v in row["paths"].items())  # type: ignore[attr-defined]
        pred = row["predictions_within_30pct"]
        lines.append(
            f"| {row['scenario']:<25} | {paths:<28} | {row['engine_median_ms']:>9.2f} | "
            f"{b.get('scratch', float('nan')):>10.2f} | {b.get('gudhi', float('nan')):>8.2f} | "
            f"{b.get('ripser', float('nan')):>9.2f} | {row['speedup_vs_best']:>6.2f} | "
            f"{row['total_speedup_vs_best']:>7.2f} | "
            f"{'-' if pred is None else f'{pred:.0%}':>9} | {row['memory_within_30pct']:>8.0%} | "
            f"{'yes' if row['exact'] else 'NO':<5} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and smaller runs (a smoke test)")
    parser.add_argument("--output", type=Path, default=RESULTS / "mmhm.json")
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 for the figures in the README (one thread, as measured there)")
    baselines = list(BASELINES)
    try:
        import ripser  # noqa: F401
    except ImportError:
        baselines.remove("ripser")
    quick = args.quick
    n, updates = (256, 4) if quick else (1024, 10)
    rows = []
    runs = []
    for fraction in (0.01, 0.05, 0.25, 1.0):
        runs.append(probe_scenario(fraction, n, 64, updates, baselines))
        print(f"done: {runs[-1].name}")
    for window in (256,) if quick else (1024, 2048):
        for batch in (32, 64):
            count = 10 if quick else 60
            runs.append(
                stream_scenario(window, batch, 64, count, compare_every=5 if quick else 10, baselines=baselines)
            )
            print(f"done: {runs[-1].name}")
    for name, interval, checks in (("mlp_digits_every5", 5, 40), ("mlp_digits_every100", 100, 25)):
        runs.append(trace_scenario(name, interval, checks, 12 if quick else checks, baselines))
        print(f"done: {runs[-1].name}")
    rows = [run.summary() for run in runs]
    table = format_table(rows)
    print()
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mmhm_bench.py" + (" --quick" if quick else ""),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "threads": os.environ.get("OMP_NUM_THREADS"),
    }
    args.output.write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    print(f"\nwrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")
    return 0 if all(row["exact"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
