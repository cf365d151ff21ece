"""Ship rule (c) of ROUND4.md and ROUND5.md: does the library's geometry family (``silent_family="geometry"``,
`topocallbacks.silent.GeometryWatch`) reproduce the benchmark's replay of round 5's choice check by check, on the
round's own recordings?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/library_replay.py --seeds 0

For each of round 5's scenarios (both splits) and each seed asked, both branches of the recording: the benchmark's
values and holds (``silent_signals.feature_signals``, ``round2.alarms`` at geometry, frozen_r, k 4.5, p 3) against
the library's pipeline with the geometry family turned on. Writes ``benchmarks/results/silent_r5_library_replay.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import round2  # noqa: E402
import round5  # noqa: E402
import silent_evaluate as r1  # noqa: E402
import silent_signals  # noqa: E402

from topocallbacks.pipeline import CheckPipeline  # noqa: E402
from topocallbacks.settings import MonitorSettings  # noqa: E402

ON = MonitorSettings().merged({"silent_path": True, "silent_family": "geometry"})


#: Round 5's choice (ROUND5.md, stage 2): the geometry family's score, threshold and patience.
CHOICE = ("frozen_r", 4.5, 3)


def replay(features: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The benchmark's replay of round 5's choice on one run's features: where it holds, and the signals' values."""
    values, _ = silent_signals.feature_signals(features)
    run = r1.Run("x", 0, "healthy", np.arange(len(features)) * 10, values)
    hit = np.zeros(len(features), dtype=bool)
    for signal in r1.FAMILIES["geometry"]:
        hit |= round2.alarms(run, signal, *CHOICE)
    hit[: silent_signals.WARMUP] = False
    return hit, values


def compare(features: np.ndarray) -> dict[str, Any]:
    """The benchmark's replay and the library on one branch's features: checks, holds, and whether both agree."""
    expected, values = replay(features)
    pipeline = CheckPipeline(ON)
    holding = []
    for i, frame in enumerate(features):
        pipeline.evaluate(frame, step=10 * i)
        holding.append(bool(pipeline.silent.alarming_))
    same_values = all(np.allclose(pipeline.silent.series_[name], values[name], rtol=1e-12, atol=0, equal_nan=True)
                      for name in pipeline.silent.series_)  # fmt: skip
    return {"checks": len(features), "holds": int(expected.sum()), "same_values": same_values,
            "same_holds": holding == expected.tolist()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="*", type=int, default=[0])
    parser.add_argument("--recordings", type=Path, default=r1.RECORDINGS / "evaluation")
    parser.add_argument("--out", type=Path, default=r1.RESULTS)
    args = parser.parse_args(argv)
    rows = []
    for split in ("design", "held_out"):
        for name in round5.LAYOUT.names_of(split):
            for seed in args.seeds:
                with np.load(args.recordings / f"{name}-seed{seed}.npz") as data:
                    for kind in ("collapse", "healthy"):
                        if f"{kind}/features" in data.files:
                            rows.append({"split": split, "scenario": name, "seed": seed, "branch": kind,
                                         **compare(data[f"{kind}/features"])})  # fmt: skip
                            print(rows[-1], flush=True)
    payload = {"commit": r1._commit(), "seeds": args.seeds, "rows": rows,
               "all_agree": all(r["same_values"] and r["same_holds"] for r in rows)}  # fmt: skip
    (args.out / "silent_r5_library_replay.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(rows)} branches compared; all agree: {payload['all_agree']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
