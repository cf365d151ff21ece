"""The first check's one-off costs, paid in the loop or before it (issue 37).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_check.py     # about a minute

A monitor starts paying the checks' one-off costs (numba's import and kernels, scipy's assignment solver:
`topocallbacks.check.prepare`) in a background thread when it is built. Each run is a fresh Python process that
imports the package, builds a monitor (``check_every=1``), spends ``setup`` seconds on other work (a sleep: the
user's own set-up of model, data and trainer, which releases the interpreter) and then times its first check of
512 x 64 features, then a second one. ``setup`` 0 is the worst case (the first check waits for the thread); 3 s is
a set-up long enough to hide them. Interleaved repeats; the minimum of each. Writes
``benchmarks/results/first_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SETUPS = (0.0, 3.0)

CHILD = """
import json, sys, time
import numpy as np
from topocallbacks import TopoMonitor
monitor = TopoMonitor(check_every=1)
time.sleep(float(sys.argv[1]))
rng = np.random.default_rng(0)
features = rng.normal(size=(512, 64))
started = time.perf_counter()
monitor.process(features, step=0, loss=1.0)
first = time.perf_counter() - started
started = time.perf_counter()
monitor.process(features + 0.01 * rng.normal(size=features.shape), step=1, loss=1.0)
print(json.dumps({"first_ms": first * 1e3, "second_ms": (time.perf_counter() - started) * 1e3}))
"""


def one(setup: float) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(setup)], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {f"{s:g}": [] for s in SETUPS}
    for _ in range(args.repeats):
        for setup in SETUPS:
            runs[f"{setup:g}"].append(one(setup))
    rows = [{"setup_s": float(s), "first_ms": min(r["first_ms"] for r in found),
             "second_ms": min(r["second_ms"] for r in found), "runs": found} for s, found in runs.items()]  # fmt: skip
    payload = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average": list(os.getloadavg()),
               "repeats": args.repeats, "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_check.json").write_text(json.dumps(payload, indent=1) + "\n")
    for row in rows:
        print(f"set-up {row['setup_s']:g} s: first check {row['first_ms']:.0f} ms, second {row['second_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
