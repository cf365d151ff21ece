"""Command line: ``topocallbacks demo``, ``report`` and ``analyze`` (or ``python -m topocallbacks ...``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

__all__ = ["main"]

#: Where ``topocallbacks demo`` writes its files unless told otherwise (``--out``).
DEMO_DIR = "topocallbacks-demo"


def _digits_probe(n_points: int, seed: int) -> NDArray[np.float64]:
    """A fixed probe of scikit-learn's bundled 8x8 digits (no download), standardised per pixel (report tests)."""
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


def run_demo(out: str = DEMO_DIR, seed: int = 0) -> int:
    """``topocallbacks demo``: a transient fault, unprotected and rolled back (`topocallbacks.demo`).

    Returns:
        0 if the protected run ended within 2 points of the healthy run's test accuracy and the unprotected one
        did not, 1 otherwise.
    """
    from .demo import run

    return run(out, seed=seed)


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
    print(f"layers: {', '.join(result.layers)}")
    for sentence in result.findings:
        print(sentence)
    print(f"table:  {result.csv_path}")
    print(f"json:   {result.json_path}")
    print(f"report: {result.report_path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line: the ``demo``, ``report`` and ``analyze`` commands and their options."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="topocallbacks",
        description="Watch representational collapse with topology: the demo, a run's HTML report, and the offline "
        "analysis of saved checkpoints (also as python -m topocallbacks ...).",
    )
    parser.add_argument("--version", action="version", version=f"topocallbacks {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="a transient fault wrecks a small training run; TopoMonitor rolls it back (under a minute on a CPU)",
        description="Train a small MLP on scikit-learn's bundled digits three times with a plain PyTorch loop: "
        "healthy, hit by a transient fault (shuffled labels and a learning-rate spike) and left alone, and hit by "
        "the same fault but watched by TopoMonitor with policy action 'rollback'. Prints a table and the monitor's "
        "summary; writes the curves (CSV), the protected run's history (JSONL) and, with matplotlib, a picture (PNG) "
        "and the protected run's HTML report, and prints where.",
    )
    demo.add_argument(
        "--out",
        default=DEMO_DIR,
        help=f"folder to write the curves, history, picture and report into (default: ./{DEMO_DIR})",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches (default: 0)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``topocallbacks`` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        return _reporting_errors(lambda: run_report(args.history, args.out, args.title))
    if args.command == "analyze":
        if args.probe is not None and not Path(args.probe).is_file():  # before any checkpoint is loaded
            print(f"topocallbacks: error: --probe: no such file: {args.probe}", file=sys.stderr)
            return 2
        return _reporting_errors(lambda: run_analyze(args), flags={"layers": "--layer", "probe": "--probe"})
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    return run_demo(args.out, seed=args.seed)


def _reporting_errors(command: Callable[[], int], flags: Mapping[str, str] | None = None) -> int:
    """Run a command; a bad input is one line on stderr and exit status 2 (argparse's for usage errors).

    ``flags`` maps the Python argument names an error may quote (`` `layers` ``) to the command line's flags
    (``--layer``), so the message names what the user typed.
    """
    from .exceptions import InputError

    try:
        return command()
    except InputError as exc:
        message = str(exc)
        for name, flag in (flags or {}).items():
            message = message.replace(f"`{name}`", f"`{flag}`")
        print(f"topocallbacks: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
