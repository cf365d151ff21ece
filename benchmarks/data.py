"""Offline data for the benchmarks: Fashion-MNIST from Debian's `dataset-fashion-mnist` package (idx files)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
INSTALL_HINT = "apt-get update && apt-get install -y dataset-fashion-mnist"


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Images ``(n, 28, 28)`` as float32 in [0, 1] and labels ``(n,)`` as int64."""
    prefix = {"train": "train", "test": "t10k"}[split]
    images = FASHION_MNIST / f"{prefix}-images-idx3-ubyte.gz"
    if not images.exists():
        raise FileNotFoundError(f"Fashion-MNIST is not installed at {FASHION_MNIST}: {INSTALL_HINT}")
    x = _read_idx(images).astype(np.float32) / 255.0
    y = _read_idx(FASHION_MNIST / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
    return x, y


def small_cnn_body():
    """The benchmarks' small CNN feature extractor: two 3x3 convolutions, global average pooling, 64-d features.

    Built from torch's global generator (seed it first); ``torch.nn.Linear(64, 10)`` is its head.
    """
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
    )
