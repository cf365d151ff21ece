import pickle

import numpy as np
import pytest
import torch

from topocallbacks import InputError
from topocallbacks.probe import FeatureExtractor, Probe, ProbeSpec, StreamCapture, resolve_module


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
        ("images/", {}, r"`probe` is a single string \('images/'\); pass a list of texts with `tokenizer=`"),
        (3.5, {}, "`probe` must be a tensor of inputs, a Dataset with __len__, a list of inputs or of texts, or a "),
        (["a rose", "by any"], {}, r"`probe` holds text \('a rose', ...\): pass `tokenizer=`"),
        (["a rose", torch.zeros(3)], {}, "`probe` mixes strings and other inputs"),
        (torch.zeros(4, 3), {"tokenizer": object()}, "`tokenizer` is for a probe of texts .* this probe is a tensor"),
        ([[1, 2, 3], [4, 5]], {}, r"sample 0 has \(3,\), sample 1 has \(2,\); pad them .* or pass the texts"),
        ([torch.zeros(3), torch.zeros(4)], {}, r"`probe` inputs must all have the same shape to be batched"),
        (
            [{"input_ids": torch.zeros(3)}, {"input_ids": torch.zeros(5)}],
            {},
            r"sample 0 has \{'input_ids': \(3,\)\}, sample 1 has \{'input_ids': \(5,\)\}",
        ),
        ({"input_ids": [[1, 2, 3], [4, 5]]}, {}, r"`probe` column 'input_ids' must be a tensor or an array of numbers"),
        ({"input_ids": torch.zeros(4, 3), "attention_mask": torch.ones(3, 3)}, {}, "the same number of rows, got"),
        ({}, {}, "`probe` is an empty mapping"),
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


def test_columns_and_a_batch_encoding_are_rows_of_one_probe():
    ids = torch.arange(24).reshape(6, 4) % 10
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[::2, 3] = 0
    columns = Probe({"input_ids": ids, "attention_mask": mask}, max_samples=4, seed=1)
    assert columns.spec.source == "columns"
    assert columns.spec.indices is not None
    assert len(columns) == 4
    row = columns.spec.indices[0]
    torch.testing.assert_close(columns.items[0]["input_ids"], ids[row])
    rows = [{"input_ids": ids[i], "attention_mask": mask[i]} for i in range(6)]
    as_rows = Probe(rows, max_samples=4, seed=1)
    assert as_rows.spec.content_hash == columns.spec.content_hash  # the same inputs, however they were given
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": ids.tolist(), "attention_mask": mask.tolist()})
    assert Probe(encoding, max_samples=4, seed=1).spec.content_hash == columns.spec.content_hash
    features = FeatureExtractor(layer="embed", pooling="mean")(Encoder(), Probe(encoding))
    assert features.shape == (6, 3)


class WordTokenizer:
    """The tokenizer call a probe makes, as Hugging Face tokenizers answer it (no pad token, like GPT-2's)."""

    eos_token_id = 9
    pad_token_id = None
    model_max_length = 1_000_000_000_000  # the "no limit" sentinel of Hugging Face tokenizers
    padding_side = "right"

    def __call__(self, texts, truncation, max_length, padding):
        assert truncation
        assert padding is False
        ids = [[1 + len(word) % 8 for word in text.split()][:max_length] for text in texts]
        return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]}


@pytest.mark.parametrize("side", ["right", "left"])
def test_texts_are_tokenized_padded_with_a_mask_and_pooled_over_their_own_tokens(side):
    tokenizer = WordTokenizer()
    tokenizer.padding_side = side
    texts = ["shall I compare thee", "to a summer's day", "thou art more lovely and more temperate"]
    probe = Probe(texts, tokenizer=tokenizer, max_length=5)
    ids = torch.stack([item["input_ids"] for item in probe.items])
    mask = torch.stack([item["attention_mask"] for item in probe.items])
    assert ids.shape == (3, 5)  # the longest (truncated at 5 tokens)
    assert mask.sum(dim=1).tolist() == [4, 4, 5]
    assert (ids[mask == 0] == 9).all()  # no pad token: padded with the end-of-text token
    assert mask[0].tolist() == ([1, 1, 1, 1, 0] if side == "right" else [0, 1, 1, 1, 1])
    encoder = Encoder()
    features = FeatureExtractor(layer="embed", pooling="mean")(encoder, probe)
    with torch.no_grad():
        expected = torch.stack(
            [encoder.embed(item["input_ids"][item["attention_mask"] == 1]).mean(0) for item in probe.items]
        )
    np.testing.assert_allclose(features, expected.numpy(), rtol=1e-6)
    last = FeatureExtractor(layer="embed", pooling="last")(encoder, probe)
    with torch.no_grad():
        expected = torch.stack(
            [encoder.embed(item["input_ids"][item["attention_mask"] == 1][-1]) for item in probe.items]
        )
    np.testing.assert_allclose(last, expected.numpy(), rtol=1e-6)
    assert Probe(texts, tokenizer=tokenizer).items[0]["input_ids"].shape == (7,)  # default: no truncation here


def _count_calls(module, inputs, output):
    module.user_calls += 1


def _spawned_user_hook_survives(rank, model, path):
    # A fresh process: torch's hook counter starts at 0, the unpickled module keeps its hook under id 0.
    layer = model[0]
    FeatureExtractor(layer="0")(model, Probe(torch.randn(4, 3)))
    capture = StreamCapture()
    capture.attach(model, "0")
    capture.detach()
    layer.user_calls = 0
    model(torch.randn(2, 3))
    with open(path, "w") as handle:
        handle.write(f"{list(layer._forward_hooks)} {layer.user_calls}")


@pytest.mark.slow
def test_a_users_hook_survives_the_probe_in_a_spawned_process(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model[0].user_calls = 0
    counter = torch.utils.hooks.RemovableHandle
    saved = counter.next_id
    try:
        counter.next_id = 0  # the id a user's hook gets in a fresh script, which spawned processes reuse
        handle = model[0].register_forward_hook(_count_calls)
    finally:
        counter.next_id = max(saved, 1)
    assert handle.id == 0
    torch.multiprocessing.spawn(_spawned_user_hook_survives, args=(model, str(tmp_path / "out")), nprocs=1)
    assert (tmp_path / "out").read_text() == "[0] 1"  # still registered, and called once by the user's forward
