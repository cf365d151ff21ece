import pickle

import numpy as np
import pytest
import torch

from topocallbacks import InputError
from topocallbacks.probe import FeatureExtractor, Probe, ProbeSpec, resolve_module


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU())
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.dropout = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.dropout(self.pool(self.backbone(x)).flatten(1)))


class Encoder(torch.nn.Module):
    """A toy sequence model taking input_ids and attention_mask, like a Hugging Face encoder."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 3)

    def forward(self, input_ids, attention_mask):
        return self.embed(input_ids)


def test_features_of_a_conv_layer_are_pooled_and_the_model_is_restored():
    model = Net().train()
    model.head.eval()  # a mixed state must come back exactly
    probe = Probe(torch.randn(10, 1, 5, 5))
    features = FeatureExtractor(layer="backbone", batch_size=3)(model, probe)
    assert features.shape == (10, 4)
    assert features.dtype == np.float32
    with torch.no_grad():
        expected = model.backbone(torch.stack(probe.items)).mean(dim=(2, 3)).numpy()
    np.testing.assert_allclose(features, expected, rtol=1e-6)
    assert model.training
    assert model.dropout.training
    assert not model.head.training
    assert not model.backbone._forward_hooks  # hook removed


def test_eval_mode_during_the_pass_makes_features_deterministic():
    model = Net().train()
    probe = Probe(torch.randn(6, 1, 5, 5))
    extractor = FeatureExtractor(layer="head")
    np.testing.assert_array_equal(extractor(model, probe), extractor(model, probe))


def test_the_hook_is_removed_when_the_forward_fails():
    model = Net()
    probe = Probe(torch.randn(4, 2, 5, 5))  # wrong channel count
    with pytest.raises(RuntimeError):
        FeatureExtractor(layer="pool")(model, probe)
    assert not model.pool._forward_hooks
    assert model.training


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ("mean", [[1.5], [1.0]]),  # mask-aware: padding (value 9) ignored
        ("last", [[2.0], [1.0]]),
        ("cls", [[1.0], [1.0]]),
    ],
)
def test_sequence_pooling_respects_the_attention_mask(pooling, expected):
    model = Encoder()
    with torch.no_grad():
        model.embed.weight.copy_(torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 3))
    probe = Probe(
        [
            {"input_ids": torch.tensor([1, 2, 9]), "attention_mask": torch.tensor([1, 1, 0])},
            {"input_ids": torch.tensor([1, 9, 9]), "attention_mask": torch.tensor([1, 0, 0])},
        ]
    )
    features = FeatureExtractor(layer="embed", pooling=pooling)(model, probe)
    np.testing.assert_allclose(features[:, :1], expected)


def test_dataset_sources_use_the_first_element_and_a_seeded_subset():
    data = torch.utils.data.TensorDataset(torch.arange(20.0).reshape(10, 2), torch.arange(10))
    probe = Probe(data, max_samples=4, seed=3)
    again = Probe(data, max_samples=4, seed=3)
    assert probe.spec == again.spec
    assert probe.spec.source == "dataset:TensorDataset"
    assert len(probe.spec.indices) == 4
    np.testing.assert_array_equal(torch.stack(probe.items).numpy(), data.tensors[0][list(probe.spec.indices)].numpy())


def test_spec_round_trip_and_verify():
    probe = Probe(torch.randn(5, 3))
    spec = ProbeSpec.from_dict(probe.spec.as_dict())
    assert spec == probe.spec
    probe.verify(spec)
    other = Probe(torch.randn(5, 3))
    with pytest.raises(InputError, match="the probe differs from the one this state was saved with"):
        other.verify(spec)
    assert pickle.loads(pickle.dumps(probe)).spec == probe.spec


def test_unknown_layer_lists_close_matches():
    with pytest.raises(InputError, match=r"`layer` 'backbon' is not a module of Net; closest: \['backbone'"):
        resolve_module(Net(), "backbon")
    with pytest.raises(InputError, match="some names"):
        resolve_module(Net(), "zzzzzz")


@pytest.mark.parametrize(
    ("source", "kwargs", "match"),
    [
        (torch.zeros(0, 3), {}, r"`probe` is empty \(tensor with 0 samples\)"),
        ([], {}, r"`probe` is empty \(list with 0 samples\)"),
        (torch.zeros(1, 3), {}, "`probe` must hold at least 2 samples, got 1"),
        (torch.zeros(4, 3, device="meta"), {}, "on the meta device"),
        ("images/", {}, "`probe` must be a tensor of inputs, a Dataset with __len__, or a list of inputs, got str"),
        (torch.zeros(4, 3), {"max_samples": 0}, "`max_samples` must be None or an integer >= 1, got 0"),
    ],
)
def test_bad_probes(source, kwargs, match):
    with pytest.raises(InputError, match=match):
        Probe(source, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layer": ""}, "`layer` must be a module name"),
        ({"layer": "head", "pooling": "max"}, "`pooling` must be one of"),
        ({"layer": "head", "batch_size": 0}, "`batch_size` must be an integer >= 1, got 0"),
        ({}, "`layer` is required"),
    ],
)
def test_bad_extractor_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        FeatureExtractor(**kwargs)


def test_a_layer_that_is_never_called():
    class Unused(Net):
        def forward(self, x):
            return self.backbone(x)

    with pytest.raises(InputError, match="`layer` 'head' was never called"):
        FeatureExtractor(layer="head")(Unused(), Probe(torch.randn(3, 1, 5, 5)))
