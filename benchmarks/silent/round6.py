"""Round 6 of the silent suite (``benchmarks/silent/ROUND6.md``): rounds 4 and 5's scenarios chosen on, with a new
candidate family (``neighbours``: how the probe's neighbourhoods change); new mechanisms held out.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round6.py --split design
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/silent/round6.py --split held_out --record --jobs 2

The design split is rounds 4 and 5's recordings, both splits of each (``round4.py``/``round5.py --record`` record
them); the held-out split is round 6's new scenarios (``embeddings.ROUND6``). Round 4's evaluation, unchanged, with
the new family beside round 2's (``Layout.extra``), and on the held-out split round 5's choice judged too. Writes
``benchmarks/results/silent_r6_<split>.{json,md}``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import round4 as r4  # noqa: E402
import round5 as r5  # noqa: E402
import silent_evaluate as r1  # noqa: E402
from silent_signals import NEIGHBOURS  # noqa: E402

CLASSES = {**r5.CLASSES, "H6": ("supcon_watermark",), "H7": ("simclr_narrow_finetune",)}
TRAPS = {**r5.TRAPS, "T8": "trap_simclr_full_finetune"}
SPLITS = {"design": (("D1", "D2", "H1", "H2", "H3", "H4", "H5"), ("T5", "T6", "T7")),
          "held_out": (("H6", "H7"), ("T8",))}  # fmt: skip
LAYOUT = r4.Layout(6, CLASSES, TRAPS, SPLITS, {"neighbours": NEIGHBOURS})
ROUND6 = HERE / "ROUND6.md"
STAGE_2 = "## Stage 2: the choice (round 6)"


#: Round 5's stored choice judged on the held-out split (ROUND6.md), and the paragraph that says so.
report = functools.partial(r4.report_with_earlier, layout=LAYOUT, earlier=5, key="previous_choice")
markdown = functools.partial(
    r4.markdown_with_earlier,
    key="previous_choice",
    what="Round 5's choice (`geometry`, frozen_r, k 4.5, p 3, fixed before these scenarios existed)",
)


def main(argv: list[str] | None = None) -> int:
    evaluate = functools.partial(r4.evaluate_layout, layout=LAYOUT, reported=report)
    return r1.round_main(argv, __doc__, SPLITS, LAYOUT.stem, ROUND6, STAGE_2, evaluate, markdown)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
