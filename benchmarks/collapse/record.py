"""Record the collapse scenarios: probe features, standard metric, loss and gradient norm at every check.

Each (scenario, seed) trains once up to the fault step, then branches into the collapse run and its healthy twin
from the same weights, optimiser state and data order. One compressed ``.npz`` per (scenario, seed) goes to
``benchmarks/collapse/recordings/`` (not committed; this command regenerates them)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collapse/record.py            # every scenario, seeds 0-5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collapse/record.py --jobs 2   # two processes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/collapse/record.py --scenario gpt_high_lr --seeds 0

Features are stored as float16 (the topology of a 512-point cloud does not see the difference; the loss of
precision is far below the movement between checks), metrics and per-step loss/gradient norm as float64.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RECORDINGS = HERE / "recordings"
KINDS = ("collapse", "healthy")


def recording_path(scenario: str, seed: int, directory: Path = RECORDINGS) -> Path:
    return directory / f"{scenario}-seed{seed}.npz"


def recordings(directory: Path = RECORDINGS) -> list[Path]:
    """The recorded pairs in ``directory`` (not the signal caches or unfinished files beside them), sorted."""
    return sorted(p for p in directory.glob("*-seed*.npz") if ".signals" not in p.name and ".tmp" not in p.name)


def _segment(trainee, scenario, kind: str, start: int, stop: int, checks: bool, progress=None) -> dict:
    """Train steps ``[start, stop)``; check at every multiple of ``check_every`` in ``[start, stop]`` if asked."""
    out: dict[str, list] = {"check_steps": [], "metric": [], "features": [], "loss": [], "grad_norm": []}
    views = getattr(trainee, "views", None)  # a trainee that gives LiDAR's views (the silent suite's) records them
    if views is not None:
        out["views"] = []
    outputs = getattr(trainee, "outputs", None)  # a classifier's probe logits (the silent suite's round 3)
    if outputs is not None:
        out["outputs"] = []
    for step in range(start, stop + 1):
        if checks and step % scenario.check_every == 0:
            metric, features = trainee.evaluate()
            out["check_steps"].append(step)
            out["metric"].append(metric)
            out["features"].append(features.astype(np.float16))
            if views is not None:
                out["views"].append(views().astype(np.float16))
            if outputs is not None:
                out["outputs"].append(outputs().astype(np.float32))
        if step == stop:
            break
        loss, norm = trainee.train_step(step, kind)
        out["loss"].append(loss)
        out["grad_norm"].append(norm)
        if progress is not None:
            progress()
    return out


def record(name: str, seed: int, directory: Path = RECORDINGS, progress=None, scenario=None) -> Path:
    """Train one (scenario, seed) pair of runs and write its recording; returns the path.

    ``scenario`` overrides the registered one of that name (the tests pass a shortened copy).
    """
    import torch
    from scenarios import SCENARIOS

    torch.set_num_threads(1)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:  # only the text scenarios need it
        pass
    scenario = scenario or SCENARIOS[name]
    started = time.perf_counter()
    trainee = scenario.build(seed)
    trainee.fault_step = scenario.fault_step
    prefix = _segment(trainee, scenario, "healthy", 0, scenario.fault_step, True, progress)
    # The check at the fault step belongs to the shared prefix: the branches start after it.
    branch_start = scenario.fault_step
    snapshot = trainee.state()
    arrays: dict[str, np.ndarray] = {}
    for kind in KINDS:
        trainee.restore(snapshot)
        branch = _segment(trainee, scenario, kind, branch_start, scenario.steps, True, progress)
        branch = {key: values[1:] if key in ("check_steps", "metric", "features", "views", "outputs") else values
                  for key, values in branch.items()}  # fmt: skip
        for key in prefix:
            arrays[f"{kind}/{key}"] = np.asarray(prefix[key] + branch[key])
    directory.mkdir(parents=True, exist_ok=True)
    path = recording_path(name, seed, directory)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(
        tmp,
        **arrays,
        scenario=name,
        seed=seed,
        fault_step=scenario.fault_step,
        steps=scenario.steps,
        check_every=scenario.check_every,
        metric_name=scenario.metric,
        higher_is_better=scenario.higher_is_better,
        seconds=time.perf_counter() - started,
    )
    os.replace(tmp, path)
    return path


def _work(job: tuple[str, int, str]) -> tuple[str, int, float]:
    name, seed, directory = job
    started = time.perf_counter()
    record(name, seed, Path(directory))
    return name, seed, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    from scenarios import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    parser.add_argument("--out", type=Path, default=RECORDINGS)
    parser.add_argument("--force", action="store_true", help="re-record runs that already have a recording")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    jobs = [
        (name, seed, str(args.out))
        for name in args.scenario
        for seed in args.seeds
        if args.force or not recording_path(name, seed, args.out).exists()
    ]
    from tqdm import tqdm

    print(f"recording {len(jobs)} (scenario, seed) pairs into {args.out} with {args.jobs} process(es)")
    with tqdm(total=len(jobs), unit="pair") as bar:
        if args.jobs == 1:
            for job in jobs:
                name, seed, seconds = _work(job)
                bar.set_postfix_str(f"{name} seed {seed}: {seconds:.0f} s")
                bar.update()
        else:
            with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
                for name, seed, seconds in (f.result() for f in concurrent.futures.as_completed(
                        [pool.submit(_work, job) for job in jobs])):  # fmt: skip
                    bar.set_postfix_str(f"{name} seed {seed}: {seconds:.0f} s")
                    bar.update()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
