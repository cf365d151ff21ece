"""Real feature streams and probes for the engine benchmark, recorded from offline data (nothing is downloaded).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_features.py   # records what is missing (about a minute)

Two small networks are trained with a plain loop, seeded, on one CPU thread:

* ``cnn``: the check benchmark's CNN (two 3x3 convolutions, global average pooling: 64-d features) on
  Fashion-MNIST (scikit-learn's 8x8 digits when Fashion-MNIST is not installed), batches of 64, SGD with momentum;
* ``mlp``: a two-layer MLP (64-d penultimate features) on scikit-learn's digits, batches of 32.

For each, at every training step, the features of the batch's first 32 images as the forward pass saw them (what
a streaming monitor captures: 32 points per step into its window), and the features of a fixed probe of 512
held-out images (what a probe check sees, so that a check every 1, 5 or 20 steps can be replayed). Saved as float16
``.npz`` files in ``benchmarks/traces/`` (ignored by git; this script rebuilds them bit for bit on the same
machine). ``benchmarks/data/gpt_probe.npz`` (committed, 2.2 MB) holds a tiny GPT-2's probe features from the
collapse suite's recordings (``gpt_high_lr``, seed 0, healthy twin and collapse run, a check every 10 steps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "benchmarks" / "traces"
DATA = ROOT / "benchmarks" / "data"
RECORDINGS = ROOT / "benchmarks" / "collapse" / "recordings"
STEPS = 400
PER_STEP = 32
PROBE = 512


def _images(name: str):
    import torch

    if name == "cnn":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        try:
            from data import fashion_mnist

            x, y = fashion_mnist("train")
            return torch.tensor(x[:20000]).unsqueeze(1), torch.tensor(y[:20000]), "Fashion-MNIST"
        except FileNotFoundError:
            pass
    from sklearn.datasets import load_digits

    data = load_digits()
    if name == "cnn":
        return torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1), torch.tensor(data.target), "digits"
    return torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target), "digits"


def record(name: str, steps: int = STEPS, path: Path | None = None) -> Path:
    """Train ``name`` for ``steps`` steps and save its stream and probe features (to ``traces/<name>.npz``)."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y, source = _images(name)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    probe, train = order[:PROBE], order[PROBE:]
    if name == "cnn":
        from data import small_cnn_body  # _images put benchmarks/ on the path

        body = small_cnn_body()
        batch_size = 64
    else:
        body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU())
        batch_size = 32
    head = torch.nn.Linear(64, 10)
    optimiser = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    stream, probes = [], []
    for _ in range(steps):
        batch = train[torch.randint(0, len(train), (batch_size,), generator=generator)]
        with torch.no_grad():
            probes.append(body(x[probe]).numpy().astype(np.float16))
        features = body(x[batch])
        stream.append(features[:PER_STEP].detach().numpy().astype(np.float16))
        loss = torch.nn.functional.cross_entropy(head(features), y[batch])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    path = TRACES / f"{name}.npz" if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, stream=np.stack(stream), probe=np.stack(probes), source=source)
    return path


def load(name: str) -> dict[str, np.ndarray]:
    """``{"stream": (steps, 32, 64), "probe": (steps, 512, 64), "source": ...}``, recorded here when missing."""
    path = TRACES / f"{name}.npz"
    if not path.exists():
        print(f"recording {path.relative_to(ROOT)} ({name}, {STEPS} steps)", flush=True)
        record(name)
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def gpt_probe() -> dict[str, np.ndarray] | None:
    """The tiny GPT-2's probe checks (healthy twin and collapse run), from the committed extract."""
    path = DATA / "gpt_probe.npz"
    if not path.exists():
        source = RECORDINGS / "gpt_high_lr-seed0.npz"
        if not source.exists():
            return None
        with np.load(source) as data:
            extract = {
                "healthy": data["healthy/features"][:20].astype(np.float16),
                "collapse": data["collapse/features"][:20].astype(np.float16),
                "check_steps": data["healthy/check_steps"][:20],
            }
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **extract)
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


if __name__ == "__main__":
    for network in ("cnn", "mlp"):
        print(network, {k: getattr(v, "shape", v) for k, v in load(network).items()})
    print("gpt", None if (gpt := gpt_probe()) is None else {k: v.shape for k, v in gpt.items()})
