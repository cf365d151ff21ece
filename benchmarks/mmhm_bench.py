"""MMHM engine against from-scratch Betti numbers, on the same inputs, with exact agreement checked.

Run from the repository root (after `make test` or `make demo` created .venv):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mmhm_bench.py            # full run, ~6 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mmhm_bench.py --quick    # smaller, for a smoke test

Baselines, each from scratch on the same points and ε:
  gudhi      GUDHI's RipsComplex(points, max_edge_length=ε) -> edge collapse -> expansion(2) -> persistence
  ripser     ripser(points, maxdim=1, thresh=ε)
  scratch    topocallbacks.functional.betti_numbers: BLAS ε-graph, strong-collapse core, GUDHI on the core

Real data first (benchmarks/real_features.py records it from offline data into benchmarks/traces/ when missing;
the GPT-2 probes are committed in benchmarks/data/gpt_probe.npz):
  stream     a CNN on Fashion-MNIST and an MLP on scikit-learn's digits: 32 points of each training batch pushed
             into a 1,024-point window at every step through the monitor's own pipeline (CheckPipeline.push:
             the running frame, its reframes and their rebuilds included), 400 steps
  probe      the same CNN's 512-image probe checked every 1, 5 and 20 steps, and a tiny GPT-2's 512-sequence probe
             (the collapse suite's gpt_high_lr recording, healthy twin and collapse run) checked every 10 steps:
             every point moves at every check, so these edits are not sparse
Synthetic after:
  clustered  Gaussian blobs around well separated centres (d = 64): at ε nearly disjoint dense clusters, the easy
             regime for the engine; probe updates moving 1 %, 25 % or 100 % of the points, windows of 1,024

Prints a table and writes benchmarks/results/mmhm.json.
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
from collections.abc import Callable
from pathlib import Path

import gudhi
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_features  # noqa: E402

from topocallbacks import MMHM  # noqa: E402
from topocallbacks.functional import betti_numbers, epsilon_heuristic  # noqa: E402
from topocallbacks.functional.collapse import calibrate_epsilon  # noqa: E402
from topocallbacks.pipeline import CheckPipeline  # noqa: E402
from topocallbacks.settings import MonitorSettings  # noqa: E402

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
        self.moved: list[float] = []  # share of the points that moved (probe) or arrived (stream) per update
        self.flipped: list[float] = []  # edges that appeared or disappeared, over the edges after the update

    def measure_memory(self, engine: MMHM, update: Callable[[], object]) -> None:
        """One more update under tracemalloc (after the timed ones: tracing slows allocation)."""
        tracemalloc.start()
        update()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.memory.append((engine.last_stats.predicted_bytes, peak))

    def record_engine(self, engine: MMHM, seconds: float, moved: float | None = None) -> None:
        stats = engine.last_stats
        self.engine_s.append(seconds)
        self.paths.append(stats.path)
        self.predicted_s.append(stats.predicted_ms / 1e3)
        if moved is not None:
            self.moved.append(moved)
        self.flipped.append((stats.edges_added + stats.edges_removed) / max(stats.edges, 1))

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
        moved = statistics.median(self.moved) if self.moved else None
        flipped = statistics.median(self.flipped)
        return {
            "scenario": self.name,
            "kind": self.kind,
            **self.params,
            "moved_median": None if moved is None else round(moved, 4),
            "flipped_median": round(flipped, 4),
            # Sparse: a few points moved or arrived, or (all of them moving) a few per cent of the edges flipped.
            "sparse_edit": bool((moved is not None and moved <= 0.25) or flipped <= 0.05),
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


def real_stream_scenario(
    label: str, stream: np.ndarray, compare_every: int, baselines: list[str], window: int = 1024
) -> Run:
    """Push a network's per-step features ``(steps, b, d)`` through the monitor's streaming pipeline."""
    settings = MonitorSettings().merged({"schedule": {"mode": "stream", "window": window, "points_per_batch": None}})
    pipeline = CheckPipeline(settings)
    run = Run(label, "real stream", window=window, batch=stream.shape[1], d=stream.shape[2])
    for step, batch in enumerate(stream.astype(np.float64)):
        start = time.perf_counter()
        pipeline.push([(step, batch)])
        seconds = time.perf_counter() - start
        engine = pipeline.engine_
        assert engine is not None
        if engine.n_points < window:  # the window is still filling
            continue
        run.record_engine(engine, seconds, moved=batch.shape[0] / window)
        if len(run.engine_s) % compare_every == 1:
            run.compare(engine, engine.points, engine.epsilon, baselines)
    return run


def real_probe_scenario(label: str, frames: np.ndarray, baselines: list[str], **params: object) -> Run:
    """Probe checks of real features: the same inputs at every check, normalised as the monitor does."""
    pipeline = CheckPipeline(MonitorSettings())
    clouds = [pipeline.transform(frame.astype(np.float64)) for frame in frames]
    epsilon = calibrate_epsilon(clouds[0], pipeline.settings.index)
    run = Run(label, "real probe", n=frames.shape[1], d=frames.shape[2], **params)
    engine = MMHM(epsilon=epsilon)
    engine.update(clouds[0])
    for cloud in clouds[1:]:
        moved = float(np.mean(np.any(cloud != engine.points, axis=1)))
        seconds, _ = timed(lambda cloud=cloud: engine.update(cloud))
        run.record_engine(engine, seconds, moved=moved)
        run.compare(engine, cloud, epsilon, baselines)
    return run


def real_runs(quick: bool, baselines: list[str]) -> list[Run]:
    steps = 120 if quick else 400
    runs = []
    for name in ("cnn", "mlp"):
        data = real_features.load(name)
        label = f"stream {name} ({data['source']})"
        runs.append(real_stream_scenario(label, data["stream"][:steps], 5 if quick else 10, baselines))
    probe = real_features.load("cnn")["probe"]
    checks = 6 if quick else 16
    for every in (1, 5, 20):
        frames = probe[: every * checks : every]
        runs.append(real_probe_scenario(f"probe cnn every {every}", frames, baselines, interval=every))
    gpt = real_features.gpt_probe()
    if gpt is None:
        print("no GPT-2 probe extract (benchmarks/data/gpt_probe.npz) and no collapse recordings: skipped")
    else:
        for kind in ("healthy", "collapse"):
            frames = gpt[kind][: checks + 1]
            runs.append(real_probe_scenario(f"probe gpt2 {kind} every 10", frames, baselines, interval=10))
    return runs


def probe_scenario(fraction: float, n: int, dim: int, updates: int, baselines: list[str]) -> Run:
    source = ClusteredSource(dim, 10, seed=1)
    cloud = source.sample(n)
    epsilon = epsilon_heuristic(cloud)
    run = Run(f"clustered probe {fraction:.0%} move", "synthetic probe", n=n, d=dim, moved_fraction=fraction)
    engine = MMHM(epsilon=epsilon)
    engine.update(cloud)
    rng = np.random.default_rng(2)
    for _ in range(updates):
        cloud = cloud.copy()
        moved = rng.choice(n, size=max(1, round(fraction * n)), replace=False)
        cloud[moved] += rng.normal(scale=0.4, size=(moved.size, dim))
        seconds, _ = timed(lambda cloud=cloud: engine.update(cloud))
        run.record_engine(engine, seconds, moved=moved.size / n)
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
    run = Run(f"clustered stream W={window} b={batch}", "synthetic stream", window=window, batch=batch, d=dim)
    engine = MMHM(epsilon=epsilon, window=window)
    engine.push(first)
    for i in range(updates):
        new = source.sample(batch)
        seconds, _ = timed(lambda new=new: engine.push(new))
        run.record_engine(engine, seconds, moved=batch / window)
        if i % compare_every == 0:
            run.compare(engine, engine.points, epsilon, baselines)
    for _ in range(3):
        new = source.sample(batch)
        run.measure_memory(engine, lambda new=new: engine.push(new))
    return run


def format_table(rows: list[dict[str, object]]) -> str:
    header = (
        f"| {'scenario':<34} | {'edit (moved / flipped)':<22} | {'paths':<26} | {'engine ms':>9} | "
        f"{'scratch ms':>10} | {'gudhi ms':>8} | {'ripser ms':>9} | {'x best':>6} | {'x total':>7} | "
        f"{'pred ±30%':>9} | exact |"
    )
    lines = [header, "|" + "|".join("-" * (len(part)) for part in header.split("|")[1:-1]) + "|"]
    for row in rows:
        b = row["baseline_median_ms"]
        assert isinstance(b, dict)
        paths = ", ".join(f"{k} {v}" for k, v in row["paths"].items())  # type: ignore[attr-defined]
        pred = row["predictions_within_30pct"]
        moved = row["moved_median"]
        edit = f"{'-' if moved is None else f'{moved:.0%}'} / {row['flipped_median']:.1%}"
        if not row["sparse_edit"]:
            edit += " NOT SPARSE"
        lines.append(
            f"| {row['scenario']:<34} | {edit:<22} | {paths:<26} | {row['engine_median_ms']:>9.2f} | "
            f"{b.get('scratch', float('nan')):>10.2f} | {b.get('gudhi', float('nan')):>8.2f} | "
            f"{b.get('ripser', float('nan')):>9.2f} | {row['speedup_vs_best']:>6.2f} | "
            f"{row['total_speedup_vs_best']:>7.2f} | "
            f"{'-' if pred is None else f'{pred:.0%}':>9} | "
            f"{'yes' if row['exact'] else 'NO':<5} |"
        )
    return "\n".join(lines)


def summary_lines(rows: list[dict[str, object]]) -> list[str]:
    """Medians of the real scenarios' speed-ups, and the worst one."""
    real = [row for row in rows if str(row["kind"]).startswith("real")]
    if not real:
        return []
    speedups = [float(row["speedup_vs_best"]) for row in real]  # type: ignore[arg-type]
    worst = min(real, key=lambda row: float(row["speedup_vs_best"]))  # type: ignore[arg-type]
    streams = [float(row["speedup_vs_best"]) for row in real if row["kind"] == "real stream"]  # type: ignore[arg-type]
    return [
        f"real scenarios: median x best {statistics.median(speedups):.2f}, worst {worst['speedup_vs_best']} "
        f"({worst['scenario']})",
        f"real streams: median x best {statistics.median(streams):.2f}" if streams else "real streams: none",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and smaller runs (a smoke test)")
    parser.add_argument("--output", type=Path, default=RESULTS / "mmhm.json")
    parser.add_argument("--only", choices=("real", "synthetic"), help="run one half of the scenarios")
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 for the figures in the README (one thread, as measured there)")
    baselines = list(BASELINES)
    try:
        import ripser  # noqa: F401
    except ImportError:
        baselines.remove("ripser")
    quick = args.quick
    runs = []
    for run in real_runs(quick, baselines) if args.only != "synthetic" else []:
        runs.append(run)
        print(f"done: {run.name}", flush=True)
    n, updates = (256, 4) if quick else (1024, 10)
    for fraction in (0.01, 0.25, 1.0) if args.only != "real" else ():
        runs.append(probe_scenario(fraction, n, 64, updates, baselines))
        print(f"done: {runs[-1].name}", flush=True)
    for batch in ((32,) if quick else (32, 64)) if args.only != "real" else ():
        window = 256 if quick else 1024
        runs.append(stream_scenario(window, batch, 64, 10 if quick else 60, 5 if quick else 10, baselines))
        print(f"done: {runs[-1].name}", flush=True)
    rows = [run.summary() for run in runs]
    table = format_table(rows)
    summary = summary_lines(rows)
    print()
    print(table)
    print()
    print("\n".join(summary))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mmhm_bench.py"
        + (" --quick" if quick else "")
        + (f" --only {args.only}" if args.only else ""),
        "numba": importlib.util.find_spec("numba") is not None,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": os.getloadavg(),
    }
    payload = {"meta": meta, "runs": rows, "table": table, "summary": summary}
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")
    return 0 if all(row["exact"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
