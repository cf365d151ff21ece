"""Each preset on a tiny model of its architecture, built here from a config (no download), trained a few steps."""

import codecs
import math
import this

import lightning.pytorch as pl
import pytest
import torch
import transformers

from tests.cadence import AT_CADENCE
from tests.integration.models import digits, digits_loader, quiet_trainer, zen_texts, zen_tokenizer
from topocallbacks import InputError
from topocallbacks.lightning import TopoCollapseCallback

TEXT = codecs.decode(this.s, "rot13").encode()  # the Zen of Python: real text, byte-level tokens


class ImageModel(pl.LightningModule):
    def __init__(self, model, upsample=1):
        super().__init__()
        self.model, self.upsample = model, upsample

    def forward(self, x):
        if self.upsample > 1:
            x = torch.nn.functional.interpolate(x, scale_factor=self.upsample)
        return self.model(pixel_values=x).logits

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self(images), labels)

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(images), labels))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LanguageModel(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def text_windows(length=24, count=96):
    data = torch.tensor(list(TEXT), dtype=torch.long)
    starts = torch.linspace(0, len(data) - length - 1, count).long()
    return torch.stack([data[s : s + length] for s in starts])


def text_probe(count=40, length=24):
    windows = text_windows(length, count)
    probe = []
    for i, window in enumerate(windows):
        mask = torch.ones(length, dtype=torch.long)
        mask[length - (i % 5) :] = 0  # some padding: pooling must respect the mask
        probe.append({"input_ids": window, "attention_mask": mask})
    return probe


def tiny(name):
    torch.manual_seed(0)
    if name == "resnet":
        config = transformers.ResNetConfig(
            num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10
        )
        return ImageModel(transformers.ResNetForImageClassification(config), upsample=4)
    if name == "vit":
        config = transformers.ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=1,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=10,
        )
        return ImageModel(transformers.ViTForImageClassification(config))
    if name == "gpt":
        config = transformers.GPT2Config(
            vocab_size=256, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        return LanguageModel(transformers.GPT2LMHeadModel(config))
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LanguageModel(transformers.LlamaForCausalLM(config))


@pytest.mark.parametrize("name", ["resnet", "vit", "gpt", "llama"])
def test_each_preset_runs_on_its_architecture_with_finite_index_at_every_check(tmp_path, name):
    images, _ = digits(64)
    probe = images if name in ("resnet", "vit") else text_probe()
    loader = (
        digits_loader(batch_size=32)
        if name in ("resnet", "vit")
        else torch.utils.data.DataLoader(torch.utils.data.TensorDataset(text_windows()), batch_size=16, shuffle=True)
    )
    callback = TopoCollapseCallback.from_preset(name, probe=probe, check_every=5, **AT_CADENCE)
    trainer = quiet_trainer(tmp_path, [callback], 15)
    trainer.fit(tiny(name), loader)
    checks = [r for r in callback.history if r.kind == "check"]
    assert [r.step for r in checks] == [0, 5, 10, 15]
    assert all(r.status == "ok" and math.isfinite(r.report.ci) and 0 <= r.report.ci <= 1 for r in checks)
    expected_layer = {
        "resnet": "model.resnet.pooler",
        "vit": "model.vit.layernorm",
        "gpt": "model.transformer.ln_f",
        "llama": "model.model.norm",
    }[name]
    assert callback.monitor.extractor.resolved_layer_ == expected_layer


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_text_probe_from_raw_strings_for_the_language_presets(tmp_path, name):
    tokenizer = zen_tokenizer(padding_side="right" if name == "gpt" else "left")
    texts = zen_texts()
    assert (
        TopoCollapseCallback.from_preset(
            name, probe=texts, tokenizer=tokenizer, **AT_CADENCE
        ).monitor.probe.spec.n_samples
        == 37
    )
    # The presets truncate at 256 tokens; these tiny models take 32 positions.
    callback = TopoCollapseCallback.from_preset(
        name, probe=texts, tokenizer=tokenizer, check_every=5, max_length=20, **AT_CADENCE
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(text_windows()), batch_size=16, shuffle=True)
    trainer = quiet_trainer(tmp_path, [callback], 10)
    trainer.fit(tiny(name), loader)
    probe = callback.monitor.probe
    lengths = [min(len(tokenizer(t)["input_ids"]), 20) for t in texts]
    assert max(len(tokenizer(t)["input_ids"]) for t in texts) > 20
    assert [int(item["attention_mask"].sum()) for item in probe.items] == lengths
    assert {tuple(item["input_ids"].shape) for item in probe.items} == {(max(lengths),)}
    checks = [r for r in callback.history if r.kind == "check"]
    assert [r.step for r in checks] == [0, 5, 10]
    assert all(r.status == "ok" and r.n_points == len(texts) and math.isfinite(r.report.ci) for r in checks)


def test_probe_from_the_validation_dataloader(tmp_path):
    images, labels = digits(96)
    validation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=32)
    callback = TopoCollapseCallback.from_preset(
        "resnet", probe="val", check_every=5, max_probe_samples=64, **AT_CADENCE
    )
    trainer = quiet_trainer(tmp_path, [callback], 5, num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(tiny("resnet"), digits_loader(batch_size=32), validation)
    assert callback.monitor.probe.spec.source == "dataset:TensorDataset"
    assert callback.monitor.probe.spec.n_samples == 64
    assert len([r for r in callback.history if r.kind == "check"]) == 2
    disabled = TopoCollapseCallback.from_preset("resnet", probe="val", check_every=5, **AT_CADENCE)
    with pytest.raises(InputError, match="does not load with limit_val_batches=0"):
        quiet_trainer(tmp_path, [disabled], 5, limit_val_batches=0).fit(
            tiny("resnet"), digits_loader(batch_size=32), validation
        )


class TwoInputEncoder(pl.LightningModule):
    """A LightningModule whose forward takes input_ids and attention_mask only (no token_type_ids)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, 16)
        self.encoder = torch.nn.Linear(16, 16)

    def forward(self, input_ids, attention_mask=None):
        hidden = self.encoder(self.embed(input_ids))
        return hidden if attention_mask is None else hidden * attention_mask.unsqueeze(-1)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_text_probe_passes_only_the_inputs_the_models_forward_takes_and_says_which_it_dropped(tmp_path):
    tokenizer = zen_tokenizer(token_type_ids=True)
    assert "token_type_ids" in tokenizer("a text")  # what made such a model fail before
    callback = TopoCollapseCallback(
        probe=zen_texts(), tokenizer=tokenizer, layer="encoder", check_every=5, **AT_CADENCE
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(text_windows() % 250), batch_size=16)
    with pytest.warns(RuntimeWarning, match=r"TwoInputEncoder.forward takes no token_type_ids") as said:
        quiet_trainer(tmp_path, [callback], 10).fit(TwoInputEncoder(), loader)
    assert sum("takes no token_type_ids" in str(w.message) for w in said) == 1  # said once, for three checks
    checks = [r for r in callback.history if r.kind == "check"]
    assert [(r.step, r.status) for r in checks] == [(0, "ok"), (5, "ok"), (10, "ok")]
