"""Overhead of the callbacks on a training loop at GPU speed (and, smaller and slower, on a CPU).

    python benchmarks/gpu_overhead.py                     # on a GPU: GPT-2 small and ResNet-18, both frameworks
    python benchmarks/gpu_overhead.py --only lightning:resnet18:256x64
    OMP_NUM_THREADS=1 python benchmarks/gpu_overhead.py --device cpu   # tiny models, a smoke-sized run

Models are built from configs (random initialisation, no download) and fed random inputs generated on the device
inside the training step, so the measurement is the training loop's own: GPT-2 small (124M, ``transformers``) at
16 x 256 and 32 x 1024 tokens, ResNet-18 (``transformers``' ``ResNetForImageClassification`` with ResNet-18's
layout) at 256 x 64 x 64 and 128 x 224 x 224, in bf16 mixed precision on a GPU. For each model and batch, with
Lightning and (GPT-2) with Hugging Face's ``Trainer``, the runs are: no callback; the preset at its defaults, in
probe mode and in streaming mode; the preset with ``check_every=10``; the preset watching 4 layers in one probe
pass (``probe_4layers``: the preset's layer and three earlier ones, see :func:`four_layers`). Runs are interleaved
over repeats so that a busy neighbour affects all configurations alike.

Step times come from CUDA events recorded at the end of every step (the GPU's own timeline: a step the loop spent
waiting for a check shows as a longer step), or the wall clock on a CPU. Per run: the mean, median and p99 step
after a warm-up, the slowest step, and the checks' own figures (the worker's evaluation time, the loop's waits, the
time to take the features, and the monitor's own measure of its share, as the end-of-run summary gives it).
``probe_budget`` is the preset with ``overhead_budget=0.02``. The probe pass's GPU time is measured on its own (the
callback's extractor, the trainer's precision). Writes ``benchmarks/results/gpu_overhead.json`` (``--out``) with
the device's name, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ("none", "probe", "stream", "probe_every10", "probe_4layers", "probe_budget")
PROBE_SEQUENCE = 256  # probe sequences of the GPT-2 runs, whatever the training sequence length


class StepClock:
    """End-of-step timestamps: CUDA events on a GPU (no synchronisation during training), the wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.marks)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.marks)]


def gpt2_config(size: str) -> Any:
    import transformers

    if size == "small":
        return transformers.GPT2Config()  # 124M parameters
    return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=1024, n_positions=256)


def resnet18_config(size: str) -> Any:
    import transformers

    widths = [64, 128, 256, 512] if size == "small" else [8, 16, 32, 64]
    return transformers.ResNetConfig(
        embedding_size=widths[0], hidden_sizes=widths, depths=[2, 2, 2, 2], layer_type="basic", num_labels=1000
    )


class DigitsMLP(torch.nn.Module):
    """A CPU-sized model with a fast step: 8x8 digits through two wide layers; the 512-d one is watched."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
        self.act = torch.nn.ReLU()
        self.head = torch.nn.Linear(512, 10)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(self.act(self.encoder(pixel_values.flatten(1))))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return type("Output", (), {"loss": loss, "logits": logits})()


def build(model: str, size: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if model == "gpt2":
        return transformers.GPT2LMHeadModel(gpt2_config(size))
    if model == "mlp":
        return DigitsMLP()
    return transformers.ResNetForImageClassification(resnet18_config(size))


def inputs(model: str, shape: tuple[int, ...], device: torch.device, vocab: int) -> dict[str, torch.Tensor]:
    if model == "gpt2":
        ids = torch.randint(0, vocab, shape, device=device)
        return {"input_ids": ids, "labels": ids}
    if model == "mlp":
        return {"pixel_values": torch.rand(shape[0], 64, device=device), "labels": torch.randint(0, 10, shape[:1])}
    batch, size = shape[0], shape[1]
    return {
        "pixel_values": torch.randn(batch, 3, size, size, device=device),
        "labels": torch.randint(0, 1000, (batch,), device=device),
    }


def probe_for(model: str, shape: tuple[int, ...], vocab: int) -> Any:
    generator = torch.Generator().manual_seed(1)
    if model == "gpt2":
        ids = torch.randint(0, vocab, (512, PROBE_SEQUENCE), generator=generator)
        return [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
    if model == "mlp":
        return torch.rand(512, 64, generator=generator)
    return torch.randn(512, 3, shape[1], shape[1], generator=generator)


def preset_of(model: str) -> str:
    return "gpt" if model == "gpt2" else "resnet"


def four_layers(model: str, size: str) -> list[str]:
    """The layers ``probe_4layers`` watches besides the preset's (the primary one): 4 in all.

    Patterns with a leading ``*`` match the model bare (Hugging Face) and inside the LightningModule (``model.``).
    GPT-2: three blocks spread over the depth (the tiny model's two blocks and the embeddings' dropout); ResNet-18:
    the last three stages before the pooler; the CPU MLP: its two encoder layers' outputs and the last ReLU.
    """
    if model == "gpt2":
        blocks = ["*transformer.h.3", "*transformer.h.7", "*transformer.h.11"]
        return blocks if size == "small" else ["*transformer.drop", "*transformer.h.0", "*transformer.h.1"]
    if model == "mlp":
        return ["*encoder.0", "*encoder.1", "*act"]
    return ["*encoder.stages.1", "*encoder.stages.2", "*encoder.stages.3"]


def callback_overrides(model: str, config: str, background: bool | None, size: str = "tiny") -> dict[str, Any]:
    overrides: dict[str, Any] = {"background": background}
    if model == "mlp":
        overrides["layer"] = "*.encoder"  # the resnet preset's probe size and schedule, the 512-d layer watched
    if config == "stream":
        overrides["mode"] = "stream"
    if config == "probe_every10":
        overrides["check_every"] = 10
    if config == "probe_4layers":
        overrides["layers"] = four_layers(model, size)
    if config == "probe_budget":
        overrides["overhead_budget"] = 0.02
    return overrides


# --- Lightning --------------------------------------------------------------------------------------------------


def topo_callback(
    kind: Any,
    model: str,
    config: str,
    shape: tuple[int, ...],
    vocab: int,
    background: bool | None,
    size: str = "tiny",
) -> Any:
    """The callback of class ``kind`` for ``config`` (the model's preset with the config's overrides), or None."""
    if config == "none":
        return None
    overrides = callback_overrides(model, config, background, size)
    return kind.from_preset(preset_of(model), probe=probe_for(model, shape, vocab), **overrides)


def lightning_run(
    model: str, size: str, shape: tuple[int, ...], config: str, steps: int, device: torch.device, background: Any
) -> dict[str, Any]:
    import lightning.pytorch as pl

    from topocallbacks.lightning import TopoCollapseCallback

    network = build(model, size)
    vocab = getattr(getattr(network, "config", None), "vocab_size", 0)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = network

        def forward(self, *args: Any, **kwargs: Any) -> Any:  # what the probe pass calls
            return self.model(pixel_values=args[0]) if args else self.model(**kwargs)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**inputs(model, shape, self.device, vocab)).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=device.type == "cuda")

    clock = StepClock(device)

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.mark()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            clock.mark()

    topo = topo_callback(TopoCollapseCallback, model, config, shape, vocab, background, size)
    callbacks: list[Any] = [Clock()] if topo is None else [topo, Clock()]
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=os.environ.get("TMPDIR", "/tmp"),
    )
    loader = torch.utils.data.DataLoader(range(steps), batch_size=1)
    start = time.perf_counter()
    trainer.fit(Module(), loader)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    probe_ms = probe_pass_ms(topo, trainer.lightning_module, device) if topo is not None else None
    return summarise(clock.step_ms(), wall, topo, probe_ms)


# --- Hugging Face --------------------------------------------------------------------------------------------------


def hf_run(
    model: str, size: str, shape: tuple[int, ...], config: str, steps: int, device: torch.device, background: Any
) -> dict[str, Any]:
    import transformers

    from topocallbacks.hf import TopoCollapseTrainerCallback

    network = build(model, size)
    vocab = network.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (steps * shape[0], shape[1]), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in ids]
    clock = StepClock(device)

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.mark()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.mark()

    topo = topo_callback(TopoCollapseTrainerCallback, model, config, shape, vocab, background, size)
    callbacks: list[Any] = [Clock()] if topo is None else [topo, Clock()]
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_overhead_hf"),
        per_device_train_batch_size=shape[0],
        max_steps=steps,
        learning_rate=1e-4,
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
    )
    trainer = transformers.Trainer(model=network, args=args, train_dataset=data, callbacks=callbacks)
    start = time.perf_counter()
    trainer.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    probe_ms = probe_pass_ms(topo, trainer.model, device) if topo is not None else None
    return summarise(clock.step_ms(), wall, topo, probe_ms)


# --- measurement --------------------------------------------------------------------------------------------------


def probe_pass_ms(callback: Any, module: torch.nn.Module, device: torch.device) -> float | None:
    """The probe pass's own time (GPU events, or the wall clock), median of 5, in the trainer's precision."""
    monitor = callback.monitor
    if monitor.probe is None:
        return None
    if monitor.autocast is None and device.type == "cuda":
        monitor.autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    module.to(device)
    times = []
    for _ in range(6):
        clock = StepClock(device)
        clock.mark()
        monitor.features(module)
        clock.mark()
        times.append(clock.step_ms()[0])
    return statistics.median(times[1:])


def summarise(step_ms: list[float], wall: float, callback: Any, probe_ms: float | None) -> dict[str, Any]:
    warmup = min(10, len(step_ms) // 4)
    measured = step_ms[warmup:]
    result: dict[str, Any] = {
        "steps": len(step_ms),
        "warmup_steps": warmup,
        "mean_step_ms": statistics.fmean(measured),
        "median_step_ms": statistics.median(measured),
        "p99_step_ms": statistics.quantiles(measured, n=100, method="inclusive")[98] if len(measured) > 1 else None,
        "max_step_ms": max(measured),
        "first_step_ms": step_ms[0],
        "wall_s": wall,
        "probe_pass_ms": probe_ms,
    }
    if callback is not None:
        from topocallbacks.check import CheckRecord
        from topocallbacks.summary import overhead_of

        records = [r for r in callback.history if isinstance(r, CheckRecord)]
        primary = [r for r in records if r.layer == records[-1].layer]  # the deciding records carry the cost
        per_check: dict[int, float] = {}  # a check's evaluation time, all its layers together
        for r in records:
            per_check[r.step] = per_check.get(r.step, 0.0) + r.check_ms
        result.update(
            checks=len(per_check),
            layers=len({r.layer for r in records}),
            background=callback.monitor.background,
            check_ms=statistics.median(per_check.values()) if records else None,
            wait_ms_max=max((r.wait_ms for r in records), default=None),
            wait_ms_total=sum(r.wait_ms for r in records),
            features_ms=statistics.median([r.probe_ms for r in records]) if records else None,
            lag=sorted({r.applied_step - r.step for r in records if r.applied_step is not None}),
            logged_overhead=None if (measured_share := overhead_of(primary)) is None else measured_share[0],
            window=records[-1].window if records else None,
        )
    return result


def workload(model: str, size: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(label, shape, steps) per batch: ``shape`` is (batch, sequence) or (batch, image side)."""
    if size == "small":
        if model == "gpt2":
            return [("16x256", (16, 256), 130), ("32x1024", (32, 1024), 110)]
        return [("256x64", (256, 64), 230), ("128x224", (128, 224), 220)]
    if model == "gpt2":
        return [("4x64", (4, 64), 60)]
    if model == "mlp":
        return [("512", (512,), 420)]
    return [("16x32", (16, 32), 60)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="framework:model:batch labels to run")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument(
        "--background", default="auto", choices=["auto", "on", "off"],
        help="where checks are evaluated: the preset's default (in the background on a GPU), or forced",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_overhead.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device)
    if args.device == "auto" and not torch.cuda.is_available():
        device = torch.device("cpu")
    size = "small" if device.type == "cuda" else "tiny"
    background = {"auto": None, "on": True, "off": False}[args.background]
    jobs = []
    models = ("gpt2", "resnet18") if device.type == "cuda" else ("mlp", "gpt2", "resnet18")
    for model in models:
        for label, shape, steps in workload(model, size):
            for framework in ("lightning", "hf") if model == "gpt2" else ("lightning",):
                name = f"{framework}:{model}:{label}"
                if args.only is None or name in args.only:
                    jobs.append((name, framework, model, shape, steps))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {c: [] for c in args.configs} for name, *_ in jobs}
    warnings.filterwarnings("ignore")
    command = "python benchmarks/gpu_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    total, done = args.repeats * len(jobs) * len(args.configs), 0
    for repeat in range(args.repeats):
        for name, framework, model, shape, steps in jobs:
            for config in args.configs:  # interleaved: every configuration once per repeat
                run = lightning_run if framework == "lightning" else hf_run
                outcome = run(model, size, shape, config, steps, device, background)
                results[name][config].append(outcome)
                print(f"repeat {repeat + 1}/{args.repeats} {name} {config}: mean {outcome['mean_step_ms']:.2f} ms, "
                      f"max {outcome['max_step_ms']:.1f} ms", flush=True)  # fmt: skip
                done += 1
                # Written after every run: a run cut short (a lent machine's time limit) keeps what it measured.
                write(args.out, device, command, args.background, results, complete=done == total)
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()
    print(table(results))
    return 0


def write(
    out: Path, device: torch.device, command: str, background: str, results: dict[str, Any], complete: bool
) -> None:
    """The results so far, with the table of their medians (``complete``: every planned run is in)."""
    payload = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "command": command,
        "background": background,
        "cpu_count": os.cpu_count(),
        "complete": complete,
        "results": results,
        "table": table(results),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_text(json.dumps(payload, indent=1) + "\n")
    out.with_suffix(".tmp").replace(out)


def table(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """Median over repeats: mean, median and p99 step, the overhead over no callback (and the monitor's own
    measure), slowest step / median step, check figures."""
    lines = [
        "| run | configuration | mean step ms | median step ms | p99 step ms | overhead | monitor's measure "
        "| max/median step | probe pass ms | check ms | max wait ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, configs in results.items():
        base = statistics.median(r["mean_step_ms"] for r in configs.get("none", [])) if configs.get("none") else None
        for config, runs in configs.items():
            if not runs:
                continue
            mean = statistics.median(r["mean_step_ms"] for r in runs)
            ratio = statistics.median(r["max_step_ms"] / r["median_step_ms"] for r in runs)
            overhead = "" if base is None else f"{(mean / base - 1) * 100:+.1f}%"

            def cell(key: str, runs: list[dict[str, Any]] = runs) -> str:
                values = [r[key] for r in runs if r.get(key) is not None]
                return f"{statistics.median(values):.1f}" if values else "-"

            logged = [r["logged_overhead"] for r in runs if r.get("logged_overhead") is not None]
            said = f"{statistics.median(logged) * 100:.1f}%" if logged else "-"
            lines.append(
                f"| {name} | {config} | {mean:.2f} | {cell('median_step_ms')} | {cell('p99_step_ms')} | {overhead} | "
                f"{said} | {ratio:.2f} | {cell('probe_pass_ms')} | {cell('check_ms')} | {cell('wait_ms_max')} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
