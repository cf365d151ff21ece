"""``topocallbacks demo``: a transient fault wrecks a training run, and a rollback rescues it.

The same small MLP is trained three times on scikit-learn's bundled 8x8 digits (no download) with a plain PyTorch
loop, from the same seed: the same initial weights and the same stream of batches.

* *healthy*: no fault, the reference;
* *unprotected*: a transient fault hits a stretch of steps (a corrupted shard whose labels are shuffled, and a
  learning-rate spike); [`TopoMonitor`][topocallbacks.TopoMonitor] with ``policy={"action": "warn"}`` warns, nobody
  acts, and the network collapses for good (all but one of the 64 ReLUs of its feature layer die: chance accuracy);
* *protected*: the same fault, the same monitor at its default rule (no rule option overridden): when the
  probe's index and the training loss jump together it restores the newest healthy snapshot of the model, optimizer and
  scheduler, halves the learning rate (the cuts compound) and skips the next two check intervals' updates, and
  training goes on with the next batch, so the batches since the snapshot are not seen again. The fault comes back
  until it has passed, and so do the rollbacks; then training goes on as usual.

Every run's monitor says ``overhead_budget=None``: its checks run exactly every ten steps, so that every machine
tells the same story; the default budget would plan them from the machine's timings (`topocallbacks.budget`).

`train` is the example to copy: the monitor needs two lines in the loop (``on_step`` and ``act``) and a
[`LoopActuator`][topocallbacks.interventions.LoopActuator] that holds the model. `run` prints the table, writes the
curves (``curves.csv``), the protected run's history (``protected-history.jsonl``) and, with matplotlib
(``pip install "topocallbacks[report]"``), their picture (``rescue.png``) and the HTML report of the protected run's
history (``report/index.html``, [`TopoMonitor.report`][topocallbacks.TopoMonitor.report]).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import textwrap
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# The public API, as in your own code.
from topocallbacks import MonitorSettings, TopoMonitor
from topocallbacks.check import CheckRecord, InterventionRecord
from topocallbacks.interventions import LoopActuator

__all__ = ["DigitsMLP", "Fault", "Run", "run", "train"]

#: The healthy and unprotected runs' rule: the default alarm, answered by a warning only (nobody acts). Written out,
#: so that the story stays the same whatever the library's default action is.
WARN_POLICY: Mapping[str, Any] = {"action": "warn"}
#: Steps between the monitor's checks.
CHECK_EVERY = 10


@dataclasses.dataclass(frozen=True)
class Fault:
    """A transient fault: from ``start`` for ``length`` steps, shuffled labels and the learning rate x ``lr_spike``.

    It is tied to the data stream's position (the loop's step), as a corrupted shard is: a rollback does not bring
    it back, and rolling back while it lasts does not make it end sooner.
    """

    start: int = 200
    length: int = 30
    lr_spike: float = 40.0

    def hits(self, step: int) -> bool:
        """Whether the fault hits ``step``."""
        return self.start <= step < self.start + self.length

    def corrupt(self, labels: torch.Tensor, step: int, seed: int) -> torch.Tensor:
        """The batch's labels, shuffled (the same shuffle at the same step in every run)."""
        shuffle = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return labels[torch.randperm(len(labels), generator=shuffle)]

    @contextlib.contextmanager
    def spiked(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """The learning rate x ``lr_spike`` for the optimizer steps taken inside."""
        for group in optimizer.param_groups:
            group["lr"] *= self.lr_spike
        try:
            yield
        finally:
            for group in optimizer.param_groups:
                group["lr"] /= self.lr_spike

    @property
    def last(self) -> int:
        """The last step it hits."""
        return self.start + self.length - 1


@dataclasses.dataclass(frozen=True)
class Digits:
    """scikit-learn's 8x8 digits, split once (the same split for every seed) and standardised per pixel."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @classmethod
    def load(cls, test_size: int = 540) -> Digits:
        """The bundled data set (1,797 images): ``test_size`` for testing, the rest for training."""
        from sklearn.datasets import load_digits

        data = load_digits()
        order = np.random.default_rng(0).permutation(len(data.target))
        test, train = order[:test_size], order[test_size:]
        pixels = data.data.astype(np.float32)
        mean, spread = pixels[train].mean(axis=0), pixels[train].std(axis=0)
        pixels = (pixels - mean) / np.where(spread > 0, spread, 1.0)
        labels = torch.as_tensor(data.target, dtype=torch.long)
        return cls(torch.as_tensor(pixels[train]), labels[train], torch.as_tensor(pixels[test]), labels[test])


class DigitsMLP(nn.Module):
    """64 pixels -> 128 -> 64 -> 10 classes; ``features`` (the 64 ReLU units before the head) is watched."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    @classmethod
    def seeded(cls, seed: int) -> DigitsMLP:
        """A model whose initial weights come from ``seed``; the caller's global random state is left as it was."""
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return cls()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        logits: torch.Tensor = self.head(self.features(inputs))
        return logits


@dataclasses.dataclass
class Run:
    """One training run: its test accuracy after every step and what its monitor saw and did."""

    name: str
    accuracy: list[float]  # after every step (and after the monitor acted on it)
    monitor: TopoMonitor
    warned: list[str]  # the warnings the monitor raised (action "warn")
    stopped_at: int | None = None

    @property
    def final_accuracy(self) -> float:
        """Test accuracy at the end of training."""
        return self.accuracy[-1]

    @property
    def interventions(self) -> list[InterventionRecord]:
        """What the monitor did: warnings, rollbacks, stops."""
        return [r for r in self.monitor.history if isinstance(r, InterventionRecord)]

    @property
    def rollbacks(self) -> list[InterventionRecord]:
        """The rollbacks."""
        return [r for r in self.interventions if r.action == "rollback"]

    @property
    def checks(self) -> list[CheckRecord]:
        """Every check record."""
        return [r for r in self.monitor.history if isinstance(r, CheckRecord)]


def train(
    name: str,
    data: Digits,
    *,
    seed: int,
    fault: Fault | None = None,
    policy: Mapping[str, Any] | None = None,
    steps: int = 600,
    check_every: int = CHECK_EVERY,
    history_path: Path | None = None,
) -> Run:
    """Train `DigitsMLP` with SGD for ``steps`` steps, watched by a [`TopoMonitor`][topocallbacks.TopoMonitor].

    Args:
        name: the run's name.
        data: the data set.
        seed: the initial weights and the batches (the same seed, the same stream of batches, fault or not).
        fault: the fault to inject, or None.
        policy: the monitor's rule (None: the library's default).
        steps: training steps (64 images each).
        check_every: steps between the monitor's checks.
        history_path: where the monitor writes its history (None: nowhere).
    """
    model = DigitsMLP.seeded(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    stream = torch.Generator().manual_seed(seed)  # the data position: it only moves forward, rollback or not

    # The actuator carries the monitor's decisions out; with the model it can take snapshots and restore them.
    monitor = _monitor(data, seed=seed, policy=policy, check_every=check_every, history_path=history_path)
    actuator = LoopActuator(optimizer, scheduler, model=model)
    accuracy: list[float] = []
    with warnings.catch_warnings(record=True) as caught:  # the "warn" action's warnings, kept for the table
        warnings.simplefilter("always", RuntimeWarning)
        for step in range(steps):
            batch = torch.randint(len(data.train_y), (64,), generator=stream)
            faulty = fault if fault is not None and fault.hits(step) else None
            loss, grad_norm = _sgd_step(model, optimizer, data.train_x[batch], data.train_y[batch], faulty, step, seed)
            scheduler.step()

            # The two lines the monitor needs: check when due, and act on every record (a healthy one leaves a
            # snapshot; an alarm warns, or rolls back).
            for record in monitor.on_step(step, model=model, loss=loss.detach(), grad_norm=grad_norm):
                monitor.act(record, actuator)

            accuracy.append(_accuracy(model, data))
            if actuator.stop_requested:  # a stop decision (after max_rollbacks rollbacks)
                break
    monitor.close()
    warned = [str(w.message) for w in caught if str(w.message).startswith("topocallbacks")]
    stopped_at = step if actuator.stop_requested else None
    return Run(name=name, accuracy=accuracy, monitor=monitor, warned=warned, stopped_at=stopped_at)


def _monitor(
    data: Digits, *, seed: int, policy: Mapping[str, Any] | None, check_every: int, history_path: Path | None
) -> TopoMonitor:
    """`train`'s monitor: the features at ``features`` of a fixed probe of 256 training images.

    It checks them every ``check_every`` steps, with no overhead budget (the checks as written, on every machine),
    under ``policy`` (None: the library's default rule) and writes its history to ``history_path`` (None: nowhere).
    """
    return TopoMonitor(
        probe=data.train_x[:256],
        layer="features",
        check_every=check_every,
        policy=policy,
        history_path=history_path,
        seed=seed,
        # The checks exactly as written, so that every machine tells the same story. By default the monitor keeps
        # to an overhead budget (a share of the step time): on this step of about a millisecond it would plan, from
        # this machine's timings, fewer checks on fewer points, and the story would follow the machine.
        overhead_budget=None,
    )


def _sgd_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    fault: Fault | None,
    step: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on a batch (``fault``: the fault hitting this step, or None); the loss and gradient norm.

    The gradient norm is measured, not clipped.
    """
    spike: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if fault is not None:
        labels = fault.corrupt(labels, step, seed)
        spike = fault.spiked(optimizer)
    loss = nn.functional.cross_entropy(model(inputs), labels)
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf)
    with spike:
        optimizer.step()
    return loss, grad_norm


@torch.no_grad()
def _accuracy(model: nn.Module, data: Digits) -> float:
    was_training = model.training
    model.eval()
    correct = (model(data.test_x).argmax(dim=1) == data.test_y).float().mean().item()
    model.train(was_training)
    return float(correct)


def run(
    out_dir: str | Path = "topocallbacks-demo", *, seed: int = 0, steps: int = 600, fault: Fault | None = None
) -> int:
    """The demo: the three runs, their table, the protected monitor's summary, and the files in ``out_dir``.

    The files: ``curves.csv``, ``protected-history.jsonl`` and, with matplotlib, ``rescue.png`` (the three runs'
    test accuracy and alarm scores) and ``report/index.html`` (the protected run's report); their paths are printed
    last.

    Returns:
        0 if the protected run ended within 2 points of the healthy one's accuracy and the unprotected one did not,
        1 otherwise.
    """
    fault = Fault() if fault is None else fault
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    history = out / "protected-history.jsonl"
    history.unlink(missing_ok=True)  # the history file is appended to: start afresh

    print(_introduction(fault, steps=steps, seed=seed))
    data = Digits.load()
    runs = [
        train("healthy", data, seed=seed, steps=steps, policy=WARN_POLICY),
        train("unprotected", data, seed=seed, steps=steps, fault=fault, policy=WARN_POLICY),
        # The library's default rule, nothing overridden: when the probe's diagram drift and the training loss jump
        # together, roll back to the last healthy snapshot, halve the rate, skip the next two check intervals'
        # updates; at most 4 rollbacks, then stop at the last healthy state.
        train("protected", data, seed=seed, steps=steps, fault=fault, policy=None, history_path=history),
    ]
    healthy, unprotected, protected = runs
    print(_table(runs))
    if unprotected.warned:
        print(f"\nThe unprotected run's first warning: {unprotected.warned[0]}")
    verdict, usual = _verdict(healthy, unprotected, protected)
    print("\n" + textwrap.fill(verdict, width=110))
    print("\nThe protected monitor's summary:")
    print(protected.monitor.summary())
    print()
    print(f"curves:  {_write_curves(runs, fault, out / 'curves.csv')}")
    print(f"history: {history}")
    picture = _draw(runs, fault, out / "rescue.png")
    if picture is None:
        print('picture: none, it needs matplotlib: pip install "topocallbacks[report]", then run the demo again')
        print("report:  none, for the same reason")
    else:
        # The protected run's history as the HTML report (as `topocallbacks report HISTORY --out DIR` writes it).
        report = protected.monitor.report(out / "report", title="topocallbacks demo: the protected run")
        print(f"picture: {picture}")
        print(f"report:  {report}")
    return 0 if usual else 1


def _introduction(fault: Fault, *, steps: int, seed: int) -> str:
    """The demo's opening lines: the three runs, and what the monitor watches."""
    return (
        f"topocallbacks demo: a small MLP learns scikit-learn's digits ({steps} SGD steps, seed {seed}), three times:\n"
        "  healthy      no fault\n"
        f"  unprotected  a transient fault at steps {fault.start}-{fault.last}: a corrupted shard (labels shuffled) "
        f"and the\n               learning rate x{fault.lr_spike:g}; TopoMonitor(policy={dict(WARN_POLICY)}) warns, "
        "nobody acts\n"
        "  protected    the same fault; TopoMonitor() at its default rule rolls back\n"
        f"TopoMonitor watches the diagram drift of 256 training images' features, every {CHECK_EVERY} steps, with\n"
        "overhead_budget=None: the checks as written, the same on every machine (by default the monitor keeps to "
        f"{_default_budget()}\nof the step time, planned from the machine's timings).\n"
    )


def _default_budget() -> str:
    """The shipped overhead budget, as a percentage (the demo's monitor says ``overhead_budget=None``)."""
    budget = MonitorSettings().schedule.overhead_budget
    return "no budget" if budget is None else f"{100 * budget:g} %"


def _verdict(healthy: Run, unprotected: Run, protected: Run) -> tuple[str, bool]:
    """What the three runs show, in words, and whether it is the usual outcome.

    The usual outcome: the protected run ended within 2 points of the healthy one's accuracy and the unprotected one
    did not.
    """
    rescued = protected.final_accuracy >= healthy.final_accuracy - 0.02
    lost = unprotected.final_accuracy < healthy.final_accuracy - 0.02
    if rescued and lost:
        verdict = (
            f"The fault wrecked the unprotected run for good ({100 * unprotected.final_accuracy:.1f} % at the end; "
            f"chance is 10 %). The protected run went back to its last healthy state at each alarm while the fault "
            f"lasted ({len(protected.rollbacks)} rollbacks) and ended at {100 * protected.final_accuracy:.1f} %, "
            f"the healthy run at {100 * healthy.final_accuracy:.1f} %."
        )
        return verdict, True
    verdict = "Not the usual outcome:"
    if not lost:
        verdict += " the unprotected run ended within 2 points of the healthy one."
    if not rescued:
        verdict += " The protected run ended more than 2 points below the healthy one (see the summary below)."
    return verdict, False


def _table(runs: list[Run]) -> str:
    """Final accuracy, alarms and rollbacks of each run."""
    lines = [f"{'run':<12} {'test acc':>8}  {'alarms':<17} rollbacks (step -> snapshot step, updates undone)"]
    lines.append("-" * len(lines[0]))
    for r in runs:
        fired = r.interventions
        alarms = "none" if not fired else f"{len(fired)}, first at {fired[0].step}"
        if r.rollbacks:
            undone = sum(x.steps_lost or 0 for x in r.rollbacks)
            back = ", ".join(f"{x.step}->{x.snapshot_step} ({x.steps_lost})" for x in r.rollbacks)
            back += f"; {undone} updates undone"
        else:
            back = "-" if not fired else "- (warned only)"
        if r.stopped_at is not None:
            back += f"; stopped at step {r.stopped_at}"
        lines.append(f"{r.name:<12} {100 * r.final_accuracy:6.1f} %  {alarms:<17} {back}")
    return "\n".join(lines)


def _write_curves(runs: list[Run], fault: Fault, path: Path) -> Path:
    """``step, fault, <run>_accuracy...`` after every step (empty after a run stopped)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "fault", *(f"{r.name}_accuracy" for r in runs)])
        for step in range(max(len(r.accuracy) for r in runs)):
            values = [f"{r.accuracy[step]:.4f}" if step < len(r.accuracy) else "" for r in runs]
            writer.writerow([step, int(fault.hits(step)), *values])
    return path


def _draw(runs: list[Run], fault: Fault, path: Path) -> Path | None:
    """Test accuracy over steps, and the rule's score at each check, with the fault, the alarms and the rollbacks.

    Returns:
        The picture's path, or None without matplotlib.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display
    except ImportError:
        return None
    colours = {"healthy": "tab:green", "unprotected": "tab:red", "protected": "tab:blue"}
    figure = Figure(figsize=(9, 6.5), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for axes in (top, bottom):
        axes.axvspan(fault.start, fault.last + 1, color="0.85", label="fault")
    for r in runs:
        top.plot(np.arange(len(r.accuracy)), 100 * np.asarray(r.accuracy), color=colours[r.name], label=r.name)
        scored = [(c.step, max(c.decision.score, 0.0)) for c in r.checks if c.decision.score is not None]
        if scored:
            steps, scores = zip(*scored, strict=True)
            bottom.plot(steps, scores, ".-", color=colours[r.name], markersize=3, label=r.name)
    unprotected, protected = runs[1], runs[2]
    for warning in unprotected.interventions:
        top.plot(warning.step, 103, "v", color=colours["unprotected"], markersize=6)
    for rollback in protected.rollbacks:
        for axes in (top, bottom):
            axes.axvline(rollback.step, color=colours["protected"], linestyle=":", linewidth=1)
    if protected.rollbacks:
        back = "\n".join(f"step {x.step}: back to step {x.snapshot_step}" for x in protected.rollbacks)
        top.text(fault.last + 15, 60, f"protected, rolled back at\n{back}", fontsize=8, color=colours["protected"])
    top.set(ylabel="test accuracy (%)", ylim=(0, 108), title="A transient fault: unprotected vs rolled back")
    top.plot([], [], "v", color=colours["unprotected"], label="warning (unprotected)")
    top.plot([], [], ":", color=colours["protected"], label="rollback (protected)")
    top.legend(loc="lower right", fontsize=8)
    threshold = protected.monitor.policy.settings.threshold
    bottom.axhline(threshold, color="black", linewidth=0.8, linestyle="--", label=f"threshold {threshold:g}")
    bottom.set_yscale("symlog", linthresh=1.0)
    bottom.set(xlabel="training step", ylabel="alarm score\n(z of diagram drift, >= 0)", ylim=(0, None))
    bottom.legend(loc="upper right", fontsize=8)
    figure.savefig(path, dpi=110)
    return path
