"""Round 4's scenarios (``benchmarks/silent/ROUND4.md``): the embedding is the product.

Each trainee is an image embedding model whose output a user consumes with a cosine threshold (near-duplicate and
same-kind matching), and the monitor watches that output. The harm metric is computed from the watched embedding
itself: **pair accuracy at the operating threshold** on 256 same-class and 256 different-class pairs of the 1,024
fixed held-out Fashion-MNIST images, the threshold fixed at the fault step (`OperatingThreshold`). The probe's
features are the embedding of the first 512 of those images.

* D1 ``simclr_negatives_fade`` (design): SimCLR whose negatives' term fades out (the loss falls);
* D2 ``simsiam_stopgrad_fade`` (design): SimSiam whose stop-gradient fades out (the loss falls);
* H1 ``vicreg_variance_fade`` (held out): VICReg whose variance term's weight fades to 0 (the loss falls);
* H2 ``simsiam_predictor_fade`` (held out): SimSiam whose predictor is faded into the identity (the loss falls);
* T5 ``trap_simclr_to_supcon`` (design trap): SimCLR, then supervised contrastive training (healthy);
* T6 ``trap_temperature_anneal`` (held-out trap): SimCLR with its temperature annealed 0.5 -> 0.1 (healthy).

Round 5 (``ROUND5.md``: round 4's six scenarios are its design split) adds its held-out split:

* H3 ``barlow_redundancy_fade``: Barlow Twins whose redundancy-reduction weight fades to 0 (the loss falls);
* H4 ``simclr_views_identical``: SimCLR whose second view is, for a growing share of each batch, the first view
  itself (a data-loader bug: the loss falls);
* H5 ``supcon_labels_shuffled``: supervised contrastive training whose labels are, for a growing share of each
  batch, random (a label-pipeline bug; added after stage 1, ROUND5.md says why);
* T7 ``trap_barlow_redundancy_rise`` (held-out trap): Barlow Twins whose redundancy weight rises x4 (healthy).
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

from scenarios import PROBE_SIZE, Scenario, SelfSupervised, Trainee, augment, images, standardised  # noqa: E402

#: Same-class and different-class held-out pairs the harm metric judges (each).
PAIRS = 256


class OperatingThreshold:
    """Pair accuracy at the operating threshold (round 4's harm metric, and S2 (b)'s in ``cases.py``): before the
    fault step, each check's own best separating cosine threshold; at the first check at or after it, that check's
    best threshold, fixed from then on (the shared prefix's last check, so a run and its twin use the same one).
    Mixed into a `Trainee`: ``step_`` follows the steps trained, and the threshold travels with the trainee's state
    (the recorder branches from it)."""

    threshold: float | None = None
    step_: int = 0
    fault_step: int

    def train_step(self, step: int, kind: str) -> tuple[float, float]:
        self.step_ = step + 1
        return super().train_step(step, kind)  # type: ignore[misc]

    def pair_accuracy(self, cosine: np.ndarray, same: np.ndarray) -> float:
        threshold = self.threshold
        if threshold is None:  # the best separating threshold of this check
            candidates = np.sort(cosine)
            scores = [((cosine >= t) == same).mean() for t in candidates]
            threshold = float(candidates[int(np.argmax(scores))])
            if self.step_ >= self.fault_step:  # the operating threshold, fixed at the fault step
                self.threshold = threshold
        return float(((cosine >= threshold) == same).mean())

    def state(self) -> dict[str, Any]:
        return {**super().state(), "threshold": self.threshold, "step": self.step_}  # type: ignore[misc]

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)  # type: ignore[misc]
        self.threshold, self.step_ = state["threshold"], state["step"]


def image_pairs(labels: np.ndarray, seed: int = 4321) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``PAIRS`` same-class and ``PAIRS`` different-class index pairs into ``labels`` (a fixed draw).

    Examples:
        >>> left, right, same = image_pairs(np.arange(40) % 4)
        >>> bool(((np.arange(40)[left] % 4 == np.arange(40)[right] % 4) == same).all()), int(same.sum())
        (True, 256)
    """
    rng = np.random.default_rng(seed)
    left, right = [], []
    for want_same in (True, False):
        while len(left) < PAIRS * (1 + (not want_same)):
            i, j = rng.integers(labels.size, size=2)
            if i != j and (labels[i] == labels[j]) == want_same:
                left.append(i)
                right.append(j)
    return np.array(left), np.array(right), np.r_[np.ones(PAIRS, bool), np.zeros(PAIRS, bool)]


class ImageEmbedding(OperatingThreshold):
    """The harm metric and the probe of round 4's image embeddings (``embed``: images -> the watched embedding)."""

    eval_x: torch.Tensor
    model: nn.Module

    def _pairs(self) -> None:
        from cases import held_out_images

        self.eval_x, self.eval_y = held_out_images()
        self.left, self.right, self.same = image_pairs(self.eval_y.numpy())

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        raw = self.embed(self.eval_x)
        z = F.normalize(raw, dim=1)
        cosine = (z[self.left] * z[self.right]).sum(1).numpy()
        return self.pair_accuracy(cosine, self.same), raw[:PROBE_SIZE].numpy()

    def views(self) -> np.ndarray:
        from cases import image_views

        self.model.eval()
        return image_views(self.eval_x, self.embed)


def _two_views(trainee: Any, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two augmented views of a batch of training images (and their labels), from the step's own generator."""
    index = torch.from_numpy(trainee.rng(step).integers(0, trainee.train_x.shape[0], batch_size))
    generator = torch.Generator().manual_seed(int(trainee.rng(step).integers(2**62)))
    batch = trainee.train_x[index]
    return torch.cat([augment(batch, generator), augment(batch, generator)]), trainee.train_y[index]


def _backbone() -> nn.Module:
    """Round 4's encoder: an MLP on the flattened images (784 -> 512 -> 128, ReLU; cheap enough for 1,200-step runs
    of every seed on two cores)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU())


def _projector_net() -> nn.Module:
    """The encoder and a 128-d projector: the embedding model of the SimCLR and VICReg scenarios."""
    return nn.Sequential(_backbone(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))


class SimSiamMLP(nn.Module):
    """The collapse suite's SimSiam layout (projector with batch norm, a 4x bottleneck predictor) on the encoder."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.backbone = _backbone()
        self.projector = nn.Sequential(
            nn.Linear(128, dim, bias=False), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, dim)
        )
        self.predictor = nn.Sequential(
            nn.Linear(dim, dim // 4, bias=False), nn.BatchNorm1d(dim // 4), nn.ReLU(), nn.Linear(dim // 4, dim)
        )


def faded(step: int, fault: int, fade: int) -> float:
    """`cases.faded` (imported here: ``cases`` registers this module's scenarios at its end)."""
    from cases import faded as share

    return share(step, fault, fade)


# --- D1: SimCLR whose negatives fade out --------------------------------------------------------------------------


class SimCLRNegativesFade(ImageEmbedding, Trainee):
    """SimCLR (NT-Xent, temperature 0.5, two views of 128 images; round 1's S2 (a) model and optimiser); from the
    fault step the negatives' log-sum-exp term is weighted from 1 down to 0 over ``fade`` steps, leaving the
    positives' alignment alone."""

    batch_size = 128
    fade = 600

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = _projector_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        super().__init__(seed, model, optimizer, self._schedule_of)
        self.train_x, self.train_y = images("train")
        self._pairs()

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        gone = faded(step, fault, self.fade) if kind == "collapse" else 0.0
        return {"lr": 0.05, "negatives": 1.0 - gone, "temperature": 0.5}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        views, labels = _two_views(self, step, self.batch_size)
        z = F.normalize(self.model(views), dim=1)
        return nt_xent(
            z, settings["temperature"], settings["negatives"], labels if settings.get("supervised") else None
        )


def nt_xent(
    z: torch.Tensor, temperature: float, negatives: float = 1.0, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """NT-Xent over two stacked views ``z`` (normalised): per anchor, minus its positives' mean scaled cosine plus
    ``negatives`` times the log-sum-exp over every other sample (1: the usual cross-entropy; 0: alignment only).
    With ``labels`` (supervised contrastive), the positives are every other view of the same class.

    Examples:
        >>> z = F.normalize(torch.randn(8, 4), dim=1)
        >>> n = 4; targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
        >>> logits = (z @ z.T / 0.5).fill_diagonal_(-math.inf)
        >>> bool(torch.isclose(nt_xent(z, 0.5), F.cross_entropy(logits, targets)))
        True
    """
    n = z.shape[0] // 2
    logits = (z @ z.T / temperature).fill_diagonal_(-math.inf)
    if labels is None:
        positive = torch.zeros_like(logits, dtype=torch.bool)
        positive[torch.arange(2 * n), torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])] = True
    else:
        both = torch.cat([labels, labels])
        positive = (both[:, None] == both[None, :]) & ~torch.eye(2 * n, dtype=torch.bool)
    aligned = (logits.masked_fill(~positive, 0.0).sum(1) / positive.sum(1)).mean()
    if negatives <= 0:
        return -aligned
    return -aligned + negatives * torch.logsumexp(logits, dim=1).mean()


# --- D2 and H2: SimSiam whose stop-gradient or predictor fades out -------------------------------------------------


class SimSiamFade(ImageEmbedding, SelfSupervised):
    """The collapse suite's SimSiam (its optimiser and batches of 64) on round 4's encoder; the watched embedding is
    the projector's output. From the fault step ``part`` fades out over ``fade`` steps: ``"stop_gradient"`` (the
    target is ``z.detach() + w (z - z.detach())``: its gradient grows from 0 to the full one) or ``"predictor"``
    (the prediction is ``(1 - w) predictor(z) + w z``: the predictor becomes the identity)."""

    fade = 600

    def __init__(self, seed: int, part: str, fade: int = 600) -> None:
        super().__init__(seed)
        self.fade = fade
        torch.manual_seed(seed)
        self.model = SimSiamMLP()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        self.part = part
        self._schedule = self._schedule_of
        self._pairs()

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        return {"lr": 0.05, "fault": faded(step, fault, self.fade) if kind == "collapse" else 0.0}

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.projector(self.model.backbone(x))

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        views, _ = _two_views(self, step, self.batch_size)
        z = self.embed(views)
        w = settings["fault"]
        p = self.model.predictor(z)
        target = z.detach()
        if self.part == "stop_gradient":
            target = target + w * (z - z.detach())
        else:
            p = (1 - w) * p + w * z
        z1, z2 = target.chunk(2)
        p1, p2 = p.chunk(2)
        return -(F.cosine_similarity(p1, z2).mean() + F.cosine_similarity(p2, z1).mean()) / 2


# --- H1: VICReg whose variance term fades out ----------------------------------------------------------------------


def vicreg(z1: torch.Tensor, z2: torch.Tensor, variance: float = 25.0) -> torch.Tensor:
    """VICReg's loss (Bardes et al., 2022: invariance 25, variance ``variance``, covariance 1)."""
    invariance = F.mse_loss(z1, z2)
    spread = 0.0
    covariance = 0.0
    for z in (z1, z2):
        z = z - z.mean(0)
        spread = spread + F.relu(1 - torch.sqrt(z.var(0) + 1e-4)).mean() / 2
        cov = z.T @ z / (z.shape[0] - 1)
        covariance = covariance + (cov - torch.diag(torch.diag(cov))).pow(2).sum() / z.shape[1]
    return 25.0 * invariance + variance * spread + covariance


class VICRegVarianceFade(ImageEmbedding, Trainee):
    """VICReg on the SimCLR scenario's embedding model (two views of 128 images, Adam at 1e-3); from the fault step
    the variance term's weight falls linearly from 25 to 0 over ``fade`` steps (a configuration bug)."""

    batch_size = 128
    fade = 600

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = _projector_net()
        super().__init__(seed, model, torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.0),
                         self._schedule_of)  # fmt: skip
        self.train_x, self.train_y = images("train")
        self._pairs()

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        gone = faded(step, fault, self.fade) if kind == "collapse" else 0.0
        return {"lr": 1e-3, "variance": 25.0 * (1.0 - gone)}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        views, _ = _two_views(self, step, self.batch_size)
        z1, z2 = self.model(views).chunk(2)
        return vicreg(z1, z2, settings["variance"])


# --- traps --------------------------------------------------------------------------------------------------------


class SimCLRToSupCon(SimCLRNegativesFade):
    """T5 (design): the SimCLR scenario for ``switch`` steps, then supervised contrastive training (the same loss
    with every other view of the class as a positive): a healthy change of objective that reorganises the
    embedding (its classes tighten)."""

    switch = 300

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        return {"lr": 0.05, "negatives": 1.0, "temperature": 0.5, "supervised": step >= self.switch}


class TemperatureAnneal(SimCLRNegativesFade):
    """T6 (held out): the SimCLR scenario with its temperature annealed linearly from 0.5 to 0.1 over steps 300-600
    (a healthy schedule: the embedding spreads more uniformly, the loss's level moves)."""

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        return {"lr": 0.05, "negatives": 1.0, "temperature": 0.5 - 0.4 * faded(step, 300, 300)}


# --- round 5 (ROUND5.md), held out: Barlow Twins and a view bug ---------------------------------------------------


def barlow_twins(z1: torch.Tensor, z2: torch.Tensor, redundancy: float = 5e-3) -> torch.Tensor:
    """Barlow Twins' loss (Zbontar et al., 2021): the cross-correlation of the two views' batch-standardised
    embeddings pulled towards the identity, its diagonal with weight 1 and its off-diagonal (the redundancy) with
    weight ``redundancy``.

    Examples:
        >>> z = torch.randn(64, 8)
        >>> float(barlow_twins(z, z, 0.0)) < 1e-6  # identical views: every diagonal correlation is 1
        True
    """
    n = z1.shape[0]
    a = (z1 - z1.mean(0)) / (z1.std(0) + 1e-5)
    b = (z2 - z2.mean(0)) / (z2.std(0) + 1e-5)
    c = a.T @ b / (n - 1)
    diagonal = torch.diagonal(c)
    return (1 - diagonal).pow(2).sum() + redundancy * (c.pow(2).sum() - diagonal.pow(2).sum())


class BarlowRedundancyFade(VICRegVarianceFade):
    """H3: Barlow Twins (redundancy weight 5e-3) on H1's model and training (the SimCLR scenario's embedding model,
    two views of 128 images, Adam at 1e-3); from the fault step the redundancy weight falls linearly to 0 over
    ``fade`` steps (a configuration bug: only the invariance term is left, and nothing keeps the dimensions apart)."""

    fade = 600  # SCENARIOS.md: no 5 % point at 600-200, so frozen by the rule at the longest tried
    redundancy = 5e-3

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        gone = faded(step, fault, self.fade) if kind == "collapse" else 0.0
        return {"lr": 1e-3, "redundancy": self.redundancy * (1.0 - gone)}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        views, _ = _two_views(self, step, self.batch_size)
        z1, z2 = self.model(views).chunk(2)
        return barlow_twins(z1, z2, settings["redundancy"])


class SimCLRViewsIdentical(SimCLRNegativesFade):
    """H4: the SimCLR scenario (negatives kept); from the fault step a share of each batch, growing linearly from 0
    to 1 over ``fade`` steps, gets its first augmented view as its second one too (a data-loader bug: the two views
    are one; matching them is trivial, so the loss falls, and nothing teaches invariance any more)."""

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        same = faded(step, fault, self.fade) if kind == "collapse" else 0.0
        return {"lr": 0.05, "negatives": 1.0, "temperature": 0.5, "same_view": same}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        views, _ = _two_views(self, step, self.batch_size)
        first, second = views.chunk(2)
        if settings["same_view"] > 0:  # its own draw, so the batch and the augmentation stay the twin's
            chosen = np.random.default_rng((self.seed, step, 1)).random(first.shape[0]) < settings["same_view"]
            second = torch.where(torch.from_numpy(chosen)[:, None, None, None], first, second)
        z = F.normalize(self.model(torch.cat([first, second])), dim=1)
        return nt_xent(z, settings["temperature"])


class SupConLabelsShuffled(SimCLRNegativesFade):
    """H5: a supervised contrastive embedding (D1's model and optimiser; NT-Xent at temperature 0.5 with every other
    view of the class as a positive, from the first step); from the fault step a share of each batch, growing
    linearly from 0 to 1 over ``fade`` steps, gets a random label instead of its own (a label-pipeline bug, such as
    a misaligned join: the positives go wrong)."""

    fade = 900  # SCENARIOS.md: lengthened by the tuning rule to the range's end
    #: The schedule's key for the share of the batch the bug reaches.
    bug = "shuffled"

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        share = faded(step, fault, self.fade) if kind == "collapse" else 0.0
        return {"lr": 0.05, "negatives": 1.0, "temperature": 0.5, "supervised": True, self.bug: share}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        views, labels = _two_views(self, step, self.batch_size)
        if settings[self.bug] > 0:  # its own draw, so the batch and the augmentation stay the twin's
            views, labels = self.corrupted(views, labels, step, settings[self.bug])
        z = F.normalize(self.model(views), dim=1)
        return nt_xent(z, settings["temperature"], 1.0, labels)

    def corrupted(
        self, views: torch.Tensor, labels: torch.Tensor, step: int, share: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch with the bug on ``share`` of it: random labels."""
        rng = np.random.default_rng((self.seed, step, 2))
        chosen = rng.random(labels.shape[0]) < share
        return views, torch.where(torch.from_numpy(chosen), torch.from_numpy(rng.integers(0, 10, labels.shape[0])),
                                  labels)  # fmt: skip


class BarlowRedundancyRise(BarlowRedundancyFade):
    """T7 (held-out trap): the Barlow Twins scenario with its redundancy weight raised linearly x4 (5e-3 -> 2e-2)
    over steps 300-600 (a healthy change: the embedding's dimensions are pushed further apart)."""

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        return {"lr": 1e-3, "redundancy": self.redundancy * (1.0 + 3.0 * faded(step, 300, 300))}


# --- round 6 (ROUND6.md), held out: a leaked input shortcut and a narrow fine-tune ---------------------------------


def watermarked(x: torch.Tensor, labels: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``x`` with a label watermark on the ``chosen`` images: a 3x2 patch at the brightest pixel value of the
    standardised images, in the top rows, at column 4 + 2 x label (columns 4-23).

    Examples:
        >>> x = torch.zeros(2, 1, 28, 28)
        >>> out = watermarked(x, torch.tensor([0, 9]), torch.tensor([True, False]))
        >>> int((out[0] > 0).sum()), int((out[1] > 0).sum()), bool(out[0, 0, :3, 4:6].eq(out.max()).all())
        (6, 0, True)
    """
    brightest = standardised(1.0)
    rows = torch.arange(28)[:, None] < 3
    columns = torch.arange(28)[None, None, :]
    start = 4 + 2 * labels[:, None, None]
    patch = rows[None] & (columns >= start) & (columns < start + 2) & chosen[:, None, None]
    return x.masked_fill(patch[:, None], brightest)


class SupConWatermark(SupConLabelsShuffled):
    """H6: H5's supervised contrastive embedding, its labels right; from the fault step a share of each batch's
    images, growing linearly from 0 to 1 over ``fade`` steps, carries a label watermark stamped after augmentation
    (`watermarked`: a data-pipeline bug; the held-out images and the probe lack it). Grouping by the watermark is
    easy, so the loss falls while nothing keeps the clean images' features."""

    fade = 600
    bug = "stamped"

    def corrupted(
        self, views: torch.Tensor, labels: torch.Tensor, step: int, share: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch with the bug on ``share`` of its images (both views of each): the label watermark."""
        chosen = torch.from_numpy(np.random.default_rng((self.seed, step, 3)).random(labels.shape[0]))
        chosen = (chosen < share).repeat(2)
        return watermarked(views, torch.cat([labels, labels]), chosen), labels


#: H7's narrow task: footwear (sandal 5, sneaker 7, ankle boot 9) against the rest.
FOOTWEAR = (5, 7, 9)


class SimCLRFinetune(SimCLRNegativesFade):
    """H7 and T8: D1's SimCLR embedding with a linear head on the embedding (128 -> 2 for the narrow task, footwear
    against the rest; 128 -> 10 for the full one), trained by the same optimiser (the head in its own parameter
    group, its state branched with the model's). From the fault step (H7) or step 300 (T8) the loss moves
    linearly, over ``fade`` steps (T8: 300), from NT-Xent to the head's cross-entropy: a fine-tune. H7's task needs
    one distinction, so the features the other classes need erode while its loss falls; T8's needs them all."""

    fade = 300  # SCENARIOS.md: the tuning rule's (no value passed on every tuning seed; the most, the longer)

    def __init__(self, seed: int, task: str) -> None:
        super().__init__(seed)
        self.task = task
        torch.manual_seed(seed + 1_000)  # after the model: the model's initialisation is D1's
        self.head = nn.Linear(128, 2 if task == "narrow" else 10)
        self.optimizer.add_param_group({"params": list(self.head.parameters())})

    def _schedule_of(self, step: int, kind: str, fault: int) -> dict[str, Any]:
        if self.task == "full":
            return {"lr": 0.05, "negatives": 1.0, "temperature": 0.5, "tuned": faded(step, 300, 300)}
        tuned = faded(step, fault, self.fade) if kind == "collapse" else 0.0
        return {"lr": 0.05, "negatives": 1.0, "temperature": 0.5, "tuned": tuned}

    def loss(self, step: int, settings: dict[str, Any]) -> torch.Tensor:
        views, labels = _two_views(self, step, self.batch_size)
        raw = self.model(views)
        contrastive = nt_xent(F.normalize(raw, dim=1), settings["temperature"])
        if settings["tuned"] <= 0:
            return contrastive
        both = torch.cat([labels, labels])
        target = torch.isin(both, torch.tensor(FOOTWEAR)).long() if self.task == "narrow" else both
        task = F.cross_entropy(self.head(raw), target)
        return (1 - settings["tuned"]) * contrastive + settings["tuned"] * task

    def state(self) -> dict[str, Any]:
        return {**super().state(), "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()}}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        self.head.load_state_dict(state["head"])


ROUND4: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in [
        Scenario("simclr_negatives_fade", "SimCLR MLP (128-d embedding)", "Fashion-MNIST",
                 "the negatives fade out over 600 steps", "gradual", "pair_accuracy_at_threshold", True, steps=1200,
                 fault_step=300, check_every=10, build=SimCLRNegativesFade),
        Scenario("simsiam_stopgrad_fade", "SimSiam MLP (128-d projector)", "Fashion-MNIST",
                 "the stop-gradient fades out over 600 steps", "gradual", "pair_accuracy_at_threshold", True,
                 steps=1200, fault_step=300, check_every=10,
                 build=lambda seed: SimSiamFade(seed, "stop_gradient")),
        Scenario("vicreg_variance_fade", "VICReg MLP (128-d embedding)", "Fashion-MNIST",
                 "the variance term's weight fades 25 -> 0 over 600 steps", "gradual", "pair_accuracy_at_threshold",
                 True, steps=1200, fault_step=300, check_every=10, build=VICRegVarianceFade),
        Scenario("simsiam_predictor_fade", "SimSiam MLP (128-d projector)", "Fashion-MNIST",
                 "the predictor fades into the identity over 900 steps", "gradual", "pair_accuracy_at_threshold",
                 True, steps=1200, fault_step=300, check_every=10,
                 build=lambda seed: SimSiamFade(seed, "predictor", fade=900)),
        Scenario("trap_simclr_to_supcon", "SimCLR MLP (128-d embedding)", "Fashion-MNIST",
                 "none (SimCLR, then supervised contrastive from step 300)", "none", "pair_accuracy_at_threshold",
                 True, steps=1200, fault_step=1200, check_every=10, build=SimCLRToSupCon),
        Scenario("trap_temperature_anneal", "SimCLR MLP (128-d embedding)", "Fashion-MNIST",
                 "none (temperature 0.5 -> 0.1 over steps 300-600)", "none", "pair_accuracy_at_threshold", True,
                 steps=1200, fault_step=1200, check_every=10, build=TemperatureAnneal),
    ]
}  # fmt: skip

ROUND5: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in [
        Scenario("barlow_redundancy_fade", "Barlow Twins MLP (128-d embedding)", "Fashion-MNIST",
                 "the redundancy weight fades 5e-3 -> 0 over 600 steps", "gradual", "pair_accuracy_at_threshold",
                 True, steps=1200, fault_step=300, check_every=10, build=BarlowRedundancyFade),
        Scenario("simclr_views_identical", "SimCLR MLP (128-d embedding)", "Fashion-MNIST",
                 "the second view becomes the first for a share of the batch growing 0 -> 1 over 600 steps",
                 "gradual", "pair_accuracy_at_threshold", True, steps=1200, fault_step=300, check_every=10,
                 build=SimCLRViewsIdentical),
        Scenario("supcon_labels_shuffled", "SupCon MLP (128-d embedding)", "Fashion-MNIST",
                 "a share of each batch growing 0 -> 1 over 900 steps gets random labels", "gradual",
                 "pair_accuracy_at_threshold", True, steps=1200, fault_step=300, check_every=10,
                 build=SupConLabelsShuffled),
        Scenario("trap_barlow_redundancy_rise", "Barlow Twins MLP (128-d embedding)", "Fashion-MNIST",
                 "none (redundancy weight x4 over steps 300-600)", "none", "pair_accuracy_at_threshold", True,
                 steps=1200, fault_step=1200, check_every=10, build=BarlowRedundancyRise),
    ]
}  # fmt: skip

ROUND6: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in [
        Scenario("supcon_watermark", "SupCon MLP (128-d embedding)", "Fashion-MNIST",
                 "a share of each batch growing 0 -> 1 over 600 steps carries a label watermark", "gradual",
                 "pair_accuracy_at_threshold", True, steps=1200, fault_step=300, check_every=10,
                 build=SupConWatermark),
        Scenario("simclr_narrow_finetune", "SimCLR MLP (128-d embedding) and a linear head", "Fashion-MNIST",
                 "the loss moves from NT-Xent to a two-way task's cross-entropy over 600 steps", "gradual",
                 "pair_accuracy_at_threshold", True, steps=1200, fault_step=300, check_every=10,
                 build=lambda seed: SimCLRFinetune(seed, "narrow")),
        Scenario("trap_simclr_full_finetune", "SimCLR MLP (128-d embedding) and a linear head", "Fashion-MNIST",
                 "none (the loss moves from NT-Xent to the ten-class cross-entropy over steps 300-600)", "none",
                 "pair_accuracy_at_threshold", True, steps=1200, fault_step=1200, check_every=10,
                 build=lambda seed: SimCLRFinetune(seed, "full")),
    ]
}  # fmt: skip
