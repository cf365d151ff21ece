"""Tiny real models and data for the integration tests (scikit-learn's bundled digits: no download)."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits

# The library's default rule before issue 22 (its one home: tests/unit/rules.py). Tests about a mechanism
# (learning-rate cuts, rollbacks, resumes, hook sequences, ranks) give it explicitly, so they keep testing the same
# mechanics with the same values whatever the default rule becomes; the tests of the default rule itself use the
# default. (Absolute sentinels did not exist then: a test that must see only its own rule's verdict on a collapsing
# model also gives ``"sentinels": False``.)
from tests.unit.rules import OLD_RULE as OLD_RULE


def digits(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.tensor(data.target)
    return (images, labels) if n is None else (images[:n], labels[:n])


def digits_loader(batch_size: int = 64, seed: int = 0) -> torch.utils.data.DataLoader:
    images, labels = digits()
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images, labels),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


class TinyCNN(pl.LightningModule):
    """conv -> relu -> conv -> relu -> global average pool -> linear, on 8x8 digits."""

    def __init__(self, lr: float = 0.05, scheduler: str | None = None, lr_growth: float = 1.0, total_steps: int = 100):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
        )
        self.avgpool = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Linear(32, 10)
        self.lr, self.scheduler_kind, self.lr_growth, self.total_steps = lr, scheduler, lr_growth, total_steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.avgpool(self.backbone(x)).flatten(1))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(images), labels))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        kind = self.scheduler_kind
        if kind is None:
            return optimizer
        if kind == "ramp":  # an LR that grows by lr_growth every step: the induced blow-up
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_growth**step)
        elif kind == "warmup":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
        elif kind == "cosine":
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.total_steps)
        elif kind == "onecycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.total_steps + 5)
        elif kind == "plateau":
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=3, factor=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "monitor": "train_loss"},
            }
        else:
            raise ValueError(kind)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class DigitsData(pl.LightningDataModule):
    """Digits as a datamodule (for LightningCLI)."""

    def __init__(self, batch_size: int = 64):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return digits_loader(self.batch_size)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        images, labels = digits(128)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=64)


def quiet_trainer(root, callbacks, max_steps: int, **overrides) -> pl.Trainer:
    """A CPU trainer without logger, checkpoints, progress bar or summary; ``overrides`` replace any setting."""
    settings = {
        "max_steps": max_steps,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": callbacks,
        "default_root_dir": str(root),
    }
    settings.update(overrides)
    return pl.Trainer(**settings)


def zen_texts() -> list[str]:
    """The Zen of Python's lines and pairs of consecutive lines: 37 short real texts of different lengths."""
    import codecs
    import this

    lines = [line for line in codecs.decode(this.s, "rot13").splitlines() if line.strip()][1:]
    return lines + [f"{a} {b}" for a, b in itertools.pairwise(lines)]


def zen_tokenizer(padding_side: str = "right", token_type_ids: bool = False):
    """A real BPE tokenizer (the ``tokenizers`` library) trained on those texts, under 256 tokens, with an
    end-of-text token and no pad token, as GPT-2's and LLaMA's tokenizers come (``token_type_ids``: it also gives
    them, as BERT's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=250, special_tokens=["<|endoftext|>", "<unk>"], show_progress=False)
    tokenizer.train_from_iterator(zen_texts(), trainer)
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_type_ids else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", unk_token="<unk>", padding_side=padding_side,
        model_input_names=names,
    )  # fmt: skip
