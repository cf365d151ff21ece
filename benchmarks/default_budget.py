"""The default overhead budget, chosen by the pre-registered rule of ``benchmarks/DEFAULT_BUDGET.md`` (issue 37).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_budget.py --split design    # about 7 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_budget.py --split held_out  # after stage 2; ~20 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_budget.py --quick --out /tmp/x  # a smoke run (the test's)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_budget.py --stage 4 --split design    # stage 4: plans once
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_budget.py --stage 4 --split held_out  # after stage 5; ~30 min

Each case is a real Lightning fit on one training thread, timed without the callback and with it, every
configuration in turn over interleaved repeats (the minimum of each); the wall ratio is the callback's over no
callback's. Design: each candidate budget (`CANDIDATES`) as an override; the rule picks the default (`choose`). Held
out (refused before stage 2 is committed, and while the shipped default is not the design's choice): the callback at
the shipped default, whose settings' SHA-256 is stored. Writes
``benchmarks/results/default_budget_<split>.{json,md}`` (stage 1), ``default_budget_stage4_<split>.{json,md}``
(stage 4: the budget that plans once, with two new held-out cases).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import budget_bench  # noqa: E402
import gpu_overhead  # noqa: E402
import overhead_bench  # noqa: E402
from data import fashion_mnist  # noqa: E402

from topocallbacks import MonitorSettings  # noqa: E402
from topocallbacks.lightning import TopoCollapseCallback  # noqa: E402

CANDIDATES = (0.02, 0.05, 0.10)
REPEATS = 3
PREREGISTRATION = HERE / "DEFAULT_BUDGET.md"
RESULTS = HERE / "results"


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed fit: the model, its data, the callback's arguments, the steps and the wall-ratio target."""

    name: str
    split: str
    steps: int
    target: float
    check_every: int | None  # None: the shipped cadence (the preset's, with a preset)
    setting: Callable[[], tuple[Callable[[], pl.LightningModule], Any, dict[str, Any]]]
    stages: tuple[int, ...] = (1, 4)  # the pre-registration's stages that run it


def _mlp() -> tuple[Callable[[], pl.LightningModule], Any, dict[str, Any]]:
    loader, probe = budget_bench.data()
    return budget_bench.DigitsMLP, loader, {"probe": probe, "layer": "hidden"}


def _cnn() -> tuple[Callable[[], pl.LightningModule], Any, dict[str, Any]]:
    x, y = fashion_mnist("train")
    data = torch.utils.data.TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    probe = torch.from_numpy(fashion_mnist("test")[0][:512]).unsqueeze(1)
    return overhead_bench.TinyResNet, loader, {"probe": probe, "layer": "avgpool"}


class TinyGPT(pl.LightningModule):
    """``gpu_overhead.py``'s tiny GPT-2 on random tokens, 16 x 256, AdamW."""

    shape = (16, 256)

    def __init__(self) -> None:
        super().__init__()
        self.model = gpu_overhead.build("gpt2", "tiny")

    def forward(self, **kwargs: Any) -> Any:
        return self.model(**kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        vocab = self.model.config.vocab_size
        return self.model(**gpu_overhead.inputs("gpt2", self.shape, self.device, vocab)).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _gpt() -> tuple[Callable[[], pl.LightningModule], Any, dict[str, Any]]:
    probe = gpu_overhead.probe_for("gpt2", TinyGPT.shape, gpu_overhead.gpt2_config("tiny").vocab_size)
    return TinyGPT, torch.utils.data.DataLoader(range(10**6), batch_size=1), {"probe": probe, "preset": "gpt"}


class ResNet18(pl.LightningModule):
    """``gpu_overhead.py``'s ResNet-18 at the "small" widths on random 32 x 32 images, batches of 16, AdamW."""

    shape = (16, 32)

    def __init__(self) -> None:
        super().__init__()
        self.model = gpu_overhead.build("resnet18", "small")

    def forward(self, pixel_values: torch.Tensor) -> Any:  # what the probe pass calls
        return self.model(pixel_values=pixel_values)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**gpu_overhead.inputs("resnet18", self.shape, self.device, 0)).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _resnet18() -> tuple[Callable[[], pl.LightningModule], Any, dict[str, Any]]:
    probe = gpu_overhead.probe_for("resnet18", ResNet18.shape, 0)
    return ResNet18, torch.utils.data.DataLoader(range(10**6), batch_size=1), {"probe": probe, "preset": "resnet"}


CASES = (
    Case("mlp_1ms", "design", 4000, 1.50, 10, _mlp),
    Case("cnn_default", "design", 1000, 1.10, None, _cnn),
    Case("cnn_every10", "design", 300, 1.20, 10, _cnn),
    Case("resnet18_default", "held_out", 1000, 1.10, None, _resnet18, (4,)),  # held out for stage 4: never run before
    Case("resnet18_every10", "held_out", 300, 1.20, 10, _resnet18, (4,)),
    Case("gpt_default", "held_out", 1000, 1.10, None, _gpt),  # stage 4: seen in stage 2, re-run, not unseen
    Case("gpt_every10", "held_out", 300, 1.20, 10, _gpt),
)


def settings_sha(settings: MonitorSettings | None = None) -> str:
    """The SHA-256 of ``settings`` (None: the shipped default's) as measured (`as_measured`), as ``ROUND3.md``
    records it."""
    chosen = MonitorSettings() if settings is None else settings
    return hashlib.sha256(json.dumps(as_measured(chosen), sort_keys=True).encode()).hexdigest()


def as_measured(settings: MonitorSettings) -> dict[str, Any]:
    """``settings.as_dict()`` in the layout the stored runs measured: a field added later is left out where its value
    leaves the behaviour as measured. The silent path's ``family`` came with round 5 of the silent suite (2026-11-29),
    and with it ``threshold``, ``patience`` and ``sentinels`` at None meaning the family's registered rule: with
    ``family="drift"`` the family is left out and those fields take round 2's values (12, 2, True), the defaults they
    had when the runs were measured."""
    from topocallbacks.settings import SILENT_FAMILIES

    data = settings.as_dict()
    silent = data["silent"]
    if silent.get("family") == "drift":
        del silent["family"]
        for key, value in zip(("threshold", "patience", "sentinels"), SILENT_FAMILIES["drift"], strict=True):
            silent[key] = value if silent[key] is None else silent[key]
    return data


def callback(arguments: dict[str, Any], check_every: int | None, budget: Any) -> TopoCollapseCallback:
    """The callback of a case; ``budget`` "default": no override (the shipped default), else the override."""
    overrides = dict(arguments)
    preset = overrides.pop("preset", None)
    if check_every is not None:
        overrides["check_every"] = check_every
    if budget != "default":
        overrides["overhead_budget"] = budget
    if preset is not None:
        return TopoCollapseCallback.from_preset(preset, **overrides)
    return TopoCollapseCallback(**overrides)


def account(cb: TopoCollapseCallback) -> dict[str, Any]:
    """The monitor's own account of a run (`budget_bench.monitor_said`): in all, the median interval, the checks,
    the last plan, and whether the budget warned."""
    said = budget_bench.monitor_said(cb)
    return {
        "in_all": said["logged_overhead"],
        "median_interval": said["median_interval"],
        "checks": len(said["checks"]),
        "last_plan": said["plans"][-1] if said["plans"] else None,
        "warned": bool(cb.monitor.schedule.warned_),
    }


def run_case(case: Case, configs: list[Any], repeats: int, steps: int) -> dict[str, Any]:
    """Every configuration of ``case`` (None: no callback) timed over interleaved repeats."""
    make, loader, arguments = case.setting()
    budget_bench.fit([callback(arguments, case.check_every, configs[-1])], loader, 20, make)  # one-off loads
    times: dict[str, list[float]] = {str(c): [] for c in configs}
    said: dict[str, list[dict[str, Any]]] = {str(c): [] for c in configs}
    for repeat in range(repeats):
        for config in configs:
            callbacks = [] if config is None else [callback(arguments, case.check_every, config)]
            times[str(config)].append(budget_bench.fit(callbacks, loader, steps, make))
            if callbacks:
                said[str(config)].append(account(callbacks[0]))
            print(f"{case.name} {repeat + 1}/{repeats} {config}: {times[str(config)][-1]:.2f} s", flush=True)
    base = min(times["None"])
    rows = []
    for config in configs[1:]:
        best = min(times[str(config)])
        own = said[str(config)][times[str(config)].index(best)]
        ratio = best / base
        rows.append({
            "budget": config, "seconds": round(best, 3), "wall_ratio": round(ratio, 4),
            "meets": ratio <= case.target, "times": [round(t, 3) for t in times[str(config)]], **own,
        })  # fmt: skip
    return {
        "case": case.name, "steps": steps, "target": case.target, "check_every": case.check_every,
        "bare_seconds": round(base, 3), "bare_times": [round(t, 3) for t in times["None"]],
        "step_ms": round(1e3 * base / steps, 2), "rows": rows,
    }  # fmt: skip


def choose(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The pre-registered rule: the largest candidate meeting every design target, else the most met, ties smallest."""
    met = {c: sum(row["meets"] for case in cases for row in case["rows"] if row["budget"] == c) for c in CANDIDATES}
    every = [c for c in CANDIDATES if met[c] == len(cases)]
    chosen = max(every) if every else min(CANDIDATES, key=lambda c: (-met[c], c))
    return {"chosen": chosen, "targets_met": {str(c): met[c] for c in CANDIDATES}, "all_met": bool(every)}


def stem(stage: int, split: str) -> str:
    """The results' file stem of a stage's split."""
    return f"default_budget_{split}" if stage == 1 else f"default_budget_stage{stage}_{split}"


def chosen_is_shipped(stage: int = 1) -> bool:
    """Whether the shipped default's budget is the stage's design choice (what its held-out cases measure)."""
    design = json.loads((RESULTS / f"{stem(stage, 'design')}.json").read_text())
    return bool(MonitorSettings().schedule.overhead_budget == design["choice"]["chosen"])


#: The pre-registration's stage after which a stage's held-out cases may run.
SHIPPED_AT = {1: "## Stage 2", 4: "## Stage 7"}


def shipping_stage_written(stage: int = 1) -> bool:
    """Whether the pre-registration's stage that ships the choice is written (the held-out split runs only after)."""
    return SHIPPED_AT[stage] in PREREGISTRATION.read_text()


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# The default overhead budget{'' if payload.get('stage', 1) == 1 else ', stage ' + str(payload['stage'])}: "
        f"{payload['split']} cases",
        "",
        f"`{payload['command']}` ({payload['machine']}; load average {payload['load_average']}); "
        f"the minimum of {payload['repeats']} interleaved runs each.",
        "",
        "| case | step (ms) | budget | wall ratio | target | met | monitor's figure (in all) | median interval "
        "| checks | plan at the end | warned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in payload["cases"]:
        for row in case["rows"]:
            where = budget_bench.plan_text(row["last_plan"], "check_every")
            share, median = budget_bench.percent(row["in_all"]), budget_bench.percent(row["median_interval"])
            lines.append(
                f"| {case['case']} | {case['step_ms']} | {row['budget']} | {row['wall_ratio']:.3f} | "
                f"<= {case['target']:.2f} | {'yes' if row['meets'] else 'no'} | {share} | {median} | "
                f"{row['checks']} | {where} | {'yes' if row['warned'] else 'no'} |"
            )
    if "choice" in payload:
        choice = payload["choice"]
        lines += ["", f"Chosen by the rule: `overhead_budget={choice['chosen']}` (targets met per candidate: "
                  f"{choice['targets_met']}; all met: {choice['all_met']})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=["design", "held_out"], default="design")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 40 steps, the MLP only (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--stage", type=int, choices=sorted(SHIPPED_AT), default=1,
                        help="the pre-registration's stage: 1 (the budget that replanned; 0.05 chosen, withdrawn) or "
                             "4 (the budget that plans once)")  # fmt: skip
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    shipped_at = SHIPPED_AT[args.stage][3:]
    if args.split == "held_out" and not args.quick and not shipping_stage_written(args.stage):
        parser.error(f"the held-out cases of stage {args.stage} run only after {shipped_at} of "
                     "benchmarks/DEFAULT_BUDGET.md")  # fmt: skip
    if args.split == "held_out" and not args.quick and not chosen_is_shipped(args.stage):
        parser.error(
            f"the held-out cases of stage {args.stage} measure the shipped default, and that stage's design choice "
            "is not shipped" + (" (stage 3 withdrew it): check out c75f546 to run them as registered"
                                if args.stage == 1 else "")
        )  # fmt: skip
    cases = [c for c in CASES if c.split == args.split and args.stage in c.stages]
    if args.quick:
        cases = [dataclasses.replace(cases[0], setting=_mlp, check_every=10)]
    configs: list[Any] = [None, *CANDIDATES] if args.split == "design" else [None, "default"]
    repeats = 1 if args.quick else REPEATS
    results = [run_case(c, configs, repeats, 40 if args.quick else c.steps) for c in cases]
    stage = "" if args.stage == 1 else f" --stage {args.stage}"
    command = f"OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_budget.py{stage} --split {args.split}"
    payload: dict[str, Any] = {
        "stage": args.stage,
        "split": args.split,
        "command": command + (" --quick" if args.quick else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "repeats": repeats,
        "settings_sha256": settings_sha(),
        "shipped_budget": MonitorSettings().schedule.overhead_budget,
        "cases": results,
    }
    if args.split == "design":
        payload["choice"] = choose(results)
    write(args.out / stem(args.stage, args.split), payload, markdown)
    return 0


def write(path: Path, payload: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """``payload`` as ``path``.json and its rendering as ``path``.md (its folder made if needed); the table printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    text = render(payload)
    path.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
