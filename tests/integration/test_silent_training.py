"""The geometry family of the silent path (``silent_family="geometry"``) in real ``Trainer.fit`` and
``Trainer.train`` runs, on three silent classes of issue 36: a pretrained embedding model whose objective a
configuration bug changes at one step (VICReg's variance term switched off, round 4's H1; SimCLR's negatives
dropped, leaving alignment only, S2; SimSiam's stop-gradient dropped, S1) is warned about after the fault and not
before, while its loss falls and the loud path stays quiet; its healthy twin, the same run without the bug, is never
warned about."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from tests.cadence import AT_CADENCE
from tests.integration.models import digits, digits_loader
from tests.integration.models import quiet_trainer as trainer
from topocallbacks.hf import TopoCollapseTrainerCallback
from topocallbacks.lightning import TopoCollapseCallback

FAULT_STEP = 150
STEPS = 300
SILENT = {"silent_path": True, "silent_family": "geometry", "check_every": 10}
#: Each objective's bug, and the signal the warning names: VICReg's embedding shrinks (its RMS radius against the
#: warm-up's, ``spread``); SimCLR's and SimSiam's directions converge (the std of the normalised embedding drops).
OBJECTIVES = {"vicreg_variance": "spread", "simclr_negatives": "norm_std", "simsiam_stop_gradient": "norm_std"}


def vicreg(z1: torch.Tensor, z2: torch.Tensor, variance: float) -> torch.Tensor:
    """VICReg's loss (invariance 25, variance ``variance``, covariance 1)."""
    spread = covariance = torch.zeros(())
    for z in (z1, z2):
        z = z - z.mean(0)
        spread = spread + F.relu(1 - torch.sqrt(z.var(0) + 1e-4)).mean() / 2
        cov = z.T @ z / (z.shape[0] - 1)
        covariance = covariance + (cov - torch.diag(torch.diag(cov))).pow(2).sum() / z.shape[1]
    return 25.0 * F.mse_loss(z1, z2) + variance * spread + covariance


def simclr(z1: torch.Tensor, z2: torch.Tensor, negatives: float) -> torch.Tensor:
    """SimCLR's NT-Xent at temperature 0.5, its log-sum-exp over the other samples weighted by ``negatives``."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    logits = (z @ z.T / 0.5).fill_diagonal_(-torch.inf)
    aligned = logits[torch.arange(2 * n), torch.cat([torch.arange(n, 2 * n), torch.arange(n)])].mean()
    return -aligned + negatives * torch.logsumexp(logits, dim=1).mean()


class Embedder(torch.nn.Module):
    """An MLP embedding of the digits (64 -> 128 -> 32; SimSiam's with a 32 -> 8 -> 32 predictor), pretrained with
    ``objective`` on two noisy views for 500 steps (the run continues from it). From ``fault_step`` training steps on
    (None: never) the objective's bug is in: VICReg's variance weight is 0, SimCLR has no negatives, SimSiam's
    target keeps its gradient."""

    def __init__(self, objective: str, fault_step: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                           torch.nn.Linear(128, 32))  # fmt: skip
        if objective == "simsiam_stop_gradient":
            self.predictor = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU(), torch.nn.Linear(8, 32))
        self.objective, self.fault_step, self.steps = objective, fault_step, 0
        images = digits()[0]
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        for step in range(500):
            batch = images[torch.randint(0, images.shape[0], (64,), generator=torch.Generator().manual_seed(step))]
            loss = self.views_loss(batch, False, torch.Generator().manual_seed(10_000 + step))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def views_loss(self, x: torch.Tensor, faulted: bool, generator: torch.Generator) -> torch.Tensor:
        z1, z2 = (self.encoder(x + 0.1 * torch.randn(x.shape, generator=generator)) for _ in range(2))
        if self.objective == "vicreg_variance":
            return vicreg(z1, z2, 0.0 if faulted else 25.0)
        if self.objective == "simclr_negatives":
            return simclr(z1, z2, 0.0 if faulted else 1.0)
        p1, p2 = self.predictor(z1), self.predictor(z2)
        t1, t2 = (z1, z2) if faulted else (z1.detach(), z2.detach())
        return -(F.cosine_similarity(p1, t2).mean() + F.cosine_similarity(p2, t1).mean()) / 2

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """In training, one step's loss (its views from the step's own generator; the step counter moves on); else
        (the monitor's probe pass) the embedding."""
        if not self.training:
            return {"embedding": self.encoder(x)}
        faulted = self.fault_step is not None and self.steps >= self.fault_step
        loss = self.views_loss(x, faulted, torch.Generator().manual_seed(self.steps))
        self.steps += 1
        return {"loss": loss}


class LightningEmbedder(pl.LightningModule):
    def __init__(self, objective: str, fault_step: int | None) -> None:
        super().__init__()
        self.model = Embedder(objective, fault_step)

    def forward(self, x):
        return self.model.encoder(x)

    def training_step(self, batch, batch_idx):
        return self.model(batch[0])["loss"]

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def silent_steps(history):
    return [r.step for r in history if r.kind == "check" and r.decision.rule == "silent"]


def loud_actions(history):
    return [r for r in history if r.kind == "check" and r.decision.fired and r.decision.rule != "silent"]


def assert_caught_after_the_fault_and_twin_untouched(faulted, twin, messages, signal):
    (step,) = silent_steps(faulted)  # one warning, raised once
    assert FAULT_STEP < step <= FAULT_STEP + 100  # after the fault, within ten checks of it
    (record,) = [r for r in faulted if r.kind == "check" and r.step == step]
    (before,) = [r for r in faulted if r.kind == "check" and r.step == FAULT_STEP - 10]
    assert record.loss < before.loss  # the loss the rule saw fell from the last check before the fault
    assert record.decision.reason.startswith("silent path: ")
    assert f"({signal} " in record.decision.reason  # the reason names the signal that moved, and its value
    assert any("silent path" in message for message in messages)
    assert not loud_actions(faulted)  # the loss falls: the loud path never acts
    assert not silent_steps(twin)
    assert not loud_actions(twin)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's notes on a CPU-only trainer
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_lightning_warns_about_a_silent_collapse_after_the_fault_and_never_on_its_twin(tmp_path, objective):
    probe = digits(256)[0]
    histories, messages = {}, []
    for name, fault in (("faulted", FAULT_STEP), ("twin", None)):
        callback = TopoCollapseCallback(probe=probe, layer="model.encoder", **SILENT, **AT_CADENCE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(tmp_path / name, [callback], max_steps=STEPS).fit(
                LightningEmbedder(objective, fault), digits_loader()
            )
        histories[name] = callback.history
        messages += [str(w.message) for w in caught] if name == "faulted" else []
    assert_caught_after_the_fault_and_twin_untouched(histories["faulted"], histories["twin"], messages,
                                                     OBJECTIVES[objective])  # fmt: skip


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_hf_trainer_warns_about_a_silent_collapse_after_the_fault_and_never_on_its_twin(tmp_path, objective):
    images = digits()[0]
    dataset = [{"x": images[i]} for i in range(images.shape[0])]
    histories, messages = {}, []
    for name, fault in (("faulted", FAULT_STEP), ("twin", None)):
        callback = TopoCollapseTrainerCallback(probe=images[:256], layer="encoder", **SILENT, **AT_CADENCE)
        arguments = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=64,
                                      learning_rate=1e-3, max_steps=STEPS, lr_scheduler_type="constant",
                                      save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                                      logging_strategy="no", seed=0, dataloader_num_workers=0,
                                      weight_decay=0.0)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(
                model=Embedder(objective, fault), args=arguments, train_dataset=dataset, callbacks=[callback]
            ).train()
        histories[name] = callback.history
        messages += [str(w.message) for w in caught] if name == "faulted" else []
    assert_caught_after_the_fault_and_twin_untouched(histories["faulted"], histories["twin"], messages,
                                                     OBJECTIVES[objective])  # fmt: skip
