"""Streaming windows keep their meaning while a real network's features drift (their scale grows 100x here)."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import topocallbacks.transform as transform_module
from topocallbacks import TopoMonitor
from topocallbacks.transform import FeatureTransform


def digits_stream(steps=2000, lr=0.3, seed=0, points=32):
    """The hidden features of an MLP trained on digits, ``points`` per step: their radius grows about 100x."""
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    torch.manual_seed(seed)
    body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU())
    head = torch.nn.Linear(32, 10)
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    stream = []
    for _ in range(steps):
        batch = torch.randint(0, len(x), (64,), generator=generator)
        features = body(x[batch])
        loss = torch.nn.functional.cross_entropy(head(features), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stream.append(features.detach()[:points].numpy().astype(np.float64))
    return stream


@pytest.fixture(scope="module")
def stream():
    return digits_stream()


def radius(batch):
    return float(np.sqrt(np.mean(np.sum((batch - batch.mean(axis=0)) ** 2, axis=1))))


def replay(stream, check_every=100):
    monitor = TopoMonitor(mode="stream", check_every=check_every)
    # Steps from 1, as a trainer counts them after each update (a streaming window is first checked at step 100).
    records = [r for step, batch in enumerate(stream, start=1) if (r := monitor.observe(batch, step)) is not None]
    return monitor, records


def test_the_window_stays_meaningful_over_2000_steps_of_a_real_stream(stream):
    assert radius(stream[-1]) > 50 * radius(stream[0])  # the drift this is about
    monitor, records = replay(stream)
    assert len(records) == 20
    full = [r for r in records if r.n_points == r.window]
    assert len(full) >= 15
    for record in full:
        assert record.report.betti0 < record.n_points  # never every point isolated
        assert 0.001 < record.density < 0.9  # neither empty nor one blob
    assert monitor.pipeline.transform.reframes_ >= 3


def test_a_frame_fixed_on_the_first_batch_isolates_nearly_every_point(stream, monkeypatch):
    # What the window did before it followed the features: (nearly) every point isolated. (The features grow
    # 4x by the first check at step 10, then 30x more.)
    monkeypatch.setattr(transform_module, "REFRAME_FACTOR", float("inf"))
    monkeypatch.setattr(transform_module, "REFRAME_SHIFT", float("inf"))
    monitor, records = replay(stream, check_every=10)
    assert monitor.pipeline.transform.reframes_ == 0
    assert records[-1].report.betti0 > 0.9 * records[-1].n_points
    assert records[-1].density < 0.001


def test_a_reframe_re_expresses_old_points_exactly():
    rng = np.random.default_rng(0)
    transform = FeatureTransform(streaming=True, window=64)
    first = rng.normal(size=(32, 5))
    old = transform(first)
    drifted = [rng.normal(size=(32, 5)) * 10 + 3 for _ in range(20)]
    due = [transform.track(batch) for batch in drifted]
    assert any(due)
    scale, offset = transform.reframe()
    np.testing.assert_allclose(old * scale + offset, transform(first), rtol=1e-12, atol=1e-12)
    assert 0.05 < scale < 0.2  # the features are about 10x larger now
