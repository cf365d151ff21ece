"""Command line: ``topocallbacks demo``, ``report`` and ``analyze`` (or ``python -m topocallbacks ...``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["main"]


def _digits_probe(n_points: int, seed: int) -> NDArray[np.float64]:
    """A fixed probe of scikit-learn's bundled 8x8 digits (no download), standardised per pixel."""
    from sklearn.datasets import load_digits

    data = load_digits().data.astype(np.float64)
    rng = np.random.default_rng(seed)
    probe = data[np.sort(rng.choice(len(data), size=n_points, replace=False))]
    spread = probe.std(axis=0)
    result: NDArray[np.float64] = (probe - probe.mean(axis=0)) / np.where(spread > 0, spread, 1.0)
    return result


def _dimensional_collapse(features: NDArray[np.float64], strength: float) -> NDArray[np.float64]:
    """Shrink the k-th principal direction by ``exp(-strength * k)``: strength 0 is the cloud, large is a line."""
    centred = features - features.mean(axis=0)
    u, s, vt = np.linalg.svd(centred, full_matrices=False)
    result: NDArray[np.float64] = (u * (s * np.exp(-strength * np.arange(s.size)))) @ vt
    return result


def _gudhi_reference(points: NDArray[np.float64], epsilon: float) -> tuple[int, int]:
    """β0, β1 from GUDHI's own Rips pipeline (its own distances), independent of topocallbacks' ε-graph."""
    import gudhi

    tree = gudhi.RipsComplex(points=points, max_edge_length=epsilon).create_simplex_tree(max_dimension=1)
    tree.collapse_edges(nb_iterations=10)
    tree.expansion(2)
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=True)
    betti = tree.betti_numbers()
    return int(betti[0]), int(betti[1]) if len(betti) > 1 else 0


def run_demo(n_points: int = 512, seed: int = 0) -> int:
    """Watch the Collapse Index as a real feature cloud collapses, with ε fixed at the first check.

    Returns:
        0 if every Betti pair agreed with GUDHI's own computation, 1 otherwise.
    """
    from .collapse_index import CollapseIndex
    from .functional import effective_rank
    from .monitor import TopoMonitor

    probe = _digits_probe(n_points, seed)
    index = CollapseIndex(seed=seed)
    monitor = TopoMonitor(check_every=1, seed=seed)  # the default watched index: diagram drift
    print(f"topocallbacks demo: {n_points} scikit-learn digits (64 pixels), collapsing onto fewer directions")
    print("ε is calibrated at the first check (0.5 x median distance) and kept, as the training callbacks do.\n")
    header = (
        f"{'strength':>8} {'CI':>6} {'betti':>6} {'entropy':>8} {'aniso':>6} {'β0':>5} {'β1':>4} "
        f"{'RankMe':>7} {'drift':>6} {'ms':>6}  GUDHI"
    )
    print(header)
    print("-" * len(header))
    failures = 0
    for step, strength in enumerate((0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)):
        cloud = _dimensional_collapse(probe, strength)
        drift = monitor.process(cloud, step).index_value  # None at the first check: nothing to drift from
        tick = time.perf_counter()
        report = index(cloud)
        elapsed = (time.perf_counter() - tick) * 1e3
        reference = _gudhi_reference(cloud, report.epsilon)
        agrees = reference == (report.betti0, report.betti1)
        failures += not agrees
        print(
            f"{strength:8.2f} {report.ci:6.3f} {report.betti_term:6.3f} {report.entropy_term:8.3f} "
            f"{report.anisotropy_term:6.3f} {report.betti0:5d} {report.betti1:4d} {effective_rank(cloud):7.2f} "
            f"{'-' if drift is None else format(drift, '6.3f'):>6} "
            f"{elapsed:6.1f}  {'agrees' if agrees else f'DIFFERS {reference}'}"
        )
    print(f"\nε = {index.epsilon_:.4f}; weights {index.weights_} (the paper's).")
    print("Every component is reported beside the composite, so you can see why the index moved.")
    print(
        "drift: the index the callbacks watch by default (Wasserstein distance between the persistence diagrams of\n"
        "consecutive checks of the normalised cloud, none at the first); they warn when it jumps 4.5 robust standard\n"
        "deviations above its last 10 checks, after a 10-check warm-up (longer than this demo). Why this index, and\n"
        "how little warning any index gave on real training runs: README, 'Does it warn early?'."
    )
    return 1 if failures else 0


def run_report(history: str, out: str, title: str | None = None) -> int:
    """``topocallbacks report``: write the HTML report of a history file; prints where it went."""
    from .report import write_report

    path = write_report(history, out, title=title)
    print(f"report: {path}")
    return 0


def run_analyze(args: argparse.Namespace) -> int:
    """``topocallbacks analyze``: measure every checkpoint in a folder; prints where the results went."""
    from .analyze import analyze

    overrides = {} if args.max_probe_samples is None else {"max_probe_samples": args.max_probe_samples}
    result = analyze(
        args.path,
        out_dir=args.out,
        probe=args.probe,
        layers=args.layer,
        factory=args.factory,
        trust_checkpoints=args.trust_checkpoints,
        weights=args.weights,
        title=args.title,
        progress=not args.no_progress,
        **overrides,
    )
    print(f"table:  {result.csv_path}")
    print(f"json:   {result.json_path}")
    print(f"report: {result.report_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``topocallbacks`` command."""
    parser = argparse.ArgumentParser(prog="topocallbacks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="watch the Collapse Index on a collapsing real feature cloud")
    demo.add_argument("--points", type=int, default=512, help="probe size (default: 512)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the probe subsample (default: 0)")
    report = commands.add_parser(
        "report", help="write an HTML report (index, composite, warnings, diagnosis) of a history JSONL file"
    )
    report.add_argument("history", help="the history JSONL file a monitor or callback wrote (history_path=)")
    report.add_argument("--out", required=True, help="folder to write index.html and its figures into")
    report.add_argument("--title", default=None, help="the report's title")
    analyze = commands.add_parser(
        "analyze",
        help="measure saved checkpoints (Lightning .ckpt, Hugging Face checkpoint-N) or feature arrays offline",
    )
    analyze.add_argument("path", help="folder of .ckpt files, checkpoint-N folders, or feature arrays named by step")
    analyze.add_argument("--out", required=True, help="folder to write analysis.csv, analysis.json and the report")
    analyze.add_argument("--probe", default=None, help="probe inputs for model checkpoints: a .pt or .npy file")
    analyze.add_argument(
        "--layer", action="append", default=None, help="module name or pattern to analyse (repeat for several)"
    )
    analyze.add_argument("--factory", default=None, help="module:function (or file.py:function) building the model")
    analyze.add_argument("--weights", action="store_true", help="add weight-space topology of Linear/Conv layers")
    analyze.add_argument(
        "--trust-checkpoints",
        action="store_true",
        help="load files that need arbitrary unpickling (torch.load weights_only=False); only for trusted files",
    )
    analyze.add_argument("--max-probe-samples", type=int, default=None, help="use at most this many probe samples")
    analyze.add_argument("--title", default=None, help="the report's title")
    analyze.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "report":
        return _reporting_errors(lambda: run_report(args.history, args.out, args.title))
    if args.command == "analyze":
        return _reporting_errors(lambda: run_analyze(args))
    if not 2 <= args.points <= 1797:
        parser.error(f"--points must be between 2 and 1797 (the digits set), got {args.points}")
    return run_demo(n_points=args.points, seed=args.seed)


def _reporting_errors(command: Callable[[], int]) -> int:
    """Run a command; a bad input is one line on stderr and exit status 2 (argparse's for usage errors)."""
    from .exceptions import InputError

    try:
        return command()
    except InputError as exc:
        print(f"topocallbacks: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
