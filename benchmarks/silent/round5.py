"""Round 5 of the silent suite (``benchmarks/silent/ROUND5.md``): round 4's scenarios chosen on, new ones held out.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round5.py --split design
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round5.py --split held_out --record --jobs 2

The design split is round 4's recordings, both of its splits (``round4.py --record`` records them); the held-out
split is round 5's new scenarios (``embeddings.ROUND5``). Round 4's evaluation, unchanged (admission, every candidate
and anchor at the watched embedding, the replayed rules, the choice by ROUND5.md's rule), and on the held-out split
round 4's choice judged too. Writes ``benchmarks/results/silent_r5_<split>.{json,md}``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import round4 as r4  # noqa: E402
import silent_evaluate as r1  # noqa: E402

CLASSES = {**r4.CLASSES, "H3": ("barlow_redundancy_fade",), "H4": ("simclr_views_identical",),
           "H5": ("supcon_labels_shuffled",)}  # fmt: skip
TRAPS = {**r4.TRAPS, "T7": "trap_barlow_redundancy_rise"}
SPLITS = {"design": (("D1", "D2", "H1", "H2"), ("T5", "T6")), "held_out": (("H3", "H4", "H5"), ("T7",))}
LAYOUT = r4.Layout(5, CLASSES, TRAPS, SPLITS)
ROUND5 = HERE / "ROUND5.md"
STAGE_2 = "## Stage 2: the choice (round 5)"


#: Round 4's stored choice judged on the held-out split (ROUND5.md), and the paragraph that says so.
report = functools.partial(r4.report_with_earlier, layout=LAYOUT, earlier=4, key="round4_choice")
markdown = functools.partial(
    r4.markdown_with_earlier,
    key="round4_choice",
    what="Round 4's choice (`geometry`, frozen_r, k 4.5, p 2, fixed before these scenarios existed)",
)


def main(argv: list[str] | None = None) -> int:
    evaluate = functools.partial(r4.evaluate_layout, layout=LAYOUT, reported=report)
    return r1.round_main(argv, __doc__, SPLITS, LAYOUT.stem, ROUND5, STAGE_2, evaluate, markdown)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
