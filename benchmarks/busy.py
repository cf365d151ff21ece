"""Run a command (by default the test suite) on a busy machine: CPU-bound processes beside it, ended when it ends.

`make test-busy` runs ``python benchmarks/busy.py -- python -m pytest``: two plain Python busy loops hold the two
cores of a developer's machine while the suite runs, as a laptop with a build and a browser open would. A test
that passes idle and fails here depends on how fast the machine is that day (issue 34); none may.

    python benchmarks/busy.py [--load N] -- COMMAND [ARGS...]

It prints the command's wall-clock time and exits with the command's exit code. The busy loops are separate
processes (not threads: the GIL would serialise them with nothing), started before the command and killed when it
ends, also when it fails or this script is interrupted.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from typing import Any


def spin(parent: int, started: Any) -> None:  # pragma: no cover - runs in a child process until killed
    """A plain Python busy loop: one core's worth of work, no memory, no I/O; it ends when its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it; a ^C is for the command
    started.put(os.getpid())
    x = 0
    while os.getppid() == parent:  # checked every 100,000 turns (a few ms): an orphan stops by itself
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM (``kill``, a CI time-out) ends the command and the load as ^C does."""
    raise KeyboardInterrupt


def parse(argv: list[str]) -> argparse.Namespace:
    """The options before ``--`` and the command after it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=2, help="how many busy processes run beside the command (2)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the command to run after --, e.g. -- python -m pytest")
    if args.load < 0:
        parser.error(f"--load must be 0 or more, got {args.load}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Start the load, run the command, end the load; the command's exit code."""
    args = parse(sys.argv[1:] if argv is None else argv)
    context = mp.get_context("spawn")
    signal.signal(signal.SIGTERM, interrupt)
    started = context.SimpleQueue()
    load = [
        context.Process(target=spin, args=(os.getpid(), started), daemon=True, name=f"busy-{i}")
        for i in range(args.load)
    ]
    for process in load:
        process.start()
    for _ in load:  # the load is on before the command starts
        started.get()
    print(f"busy.py: {args.load} busy processes beside: {' '.join(args.command)}", flush=True)
    start = time.perf_counter()
    command = subprocess.Popen(args.command)
    try:
        code = command.wait()
    except KeyboardInterrupt:  # ^C or SIGTERM: the command gets SIGTERM and 30 s to end (pytest cleans up)
        command.terminate()
        try:
            command.wait(timeout=30)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait()
        code = 130
    finally:
        for process in load:
            process.kill()
        for process in load:
            process.join()
    minutes, seconds = divmod(time.perf_counter() - start, 60)
    print(f"busy.py: exit code {code} after {int(minutes)} min {seconds:.0f} s with {args.load} busy processes")
    return code


if __name__ == "__main__":
    sys.exit(main())
