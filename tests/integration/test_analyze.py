"""Offline analysis of real checkpoints: a tiny GPT-2 saved by transformers.Trainer, a tiny CNN saved by Lightning.

Every value checked is recomputed here from the functional core on the same features, with the same ε and the
same transform, the features taken from a model loaded by the framework's own loader (not analyze's).
"""

import csv
import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.integration.models import TinyCNN, digits, digits_loader, quiet_trainer
from tests.unit.test_report import assert_labelled
from topocallbacks import InputError
from topocallbacks import functional as F
from topocallbacks.analysis.checkpoints import Checkpoint
from topocallbacks.analysis.summaries import flattening_steps, loss_correlations
from topocallbacks.analysis.writing import analysis_sections
from topocallbacks.analyze import analyze
from topocallbacks.functional.collapse import calibrate_epsilon
from topocallbacks.presets import load
from topocallbacks.probe import FeatureExtractor, Probe
from topocallbacks.settings import MonitorSettings
from topocallbacks.transform import FeatureTransform


class Opaque:
    """A Python object in a checkpoint: loading it needs arbitrary unpickling."""

    def __init__(self, note="kept"):
        self.note = note


def read_csv(path):
    with Path(path).open() as handle:
        return list(csv.DictReader(handle))


def snapshot(folder):
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in Path(folder).rglob("*")}


def reference(feature_list, settings):
    """The monitor's view of each checkpoint's features: one transform fitted on the first, ε calibrated on it."""
    transform = FeatureTransform(settings.transform, seed=settings.seed)
    clouds = [transform(np.asarray(f, dtype=np.float64)) for f in feature_list]
    return clouds, calibrate_epsilon(clouds[0], settings.index, settings.seed)


def assert_row_matches(row, cloud, epsilon, settings):
    report = F.collapse_index(cloud, epsilon, max_points=settings.index.max_points, seed=settings.seed)
    assert (int(row["betti0"]), int(row["betti1"])) == tuple(F.betti_numbers(cloud, epsilon))
    assert float(row["epsilon"]) == pytest.approx(epsilon, rel=1e-12)
    assert float(row["ci"]) == pytest.approx(report.ci, rel=1e-9)
    assert float(row["anisotropy_term"]) == pytest.approx(F.anisotropy(cloud), rel=1e-9)
    assert float(row["effective_rank"]) == pytest.approx(F.effective_rank(cloud), rel=1e-9)
    assert float(row["participation_ratio"]) == pytest.approx(F.participation_ratio(cloud), rel=1e-9)
    assert float(row["eigenspectrum_decay"]) == pytest.approx(F.eigenspectrum_decay(cloud), rel=1e-9)
    assert (int(row["n_points"]), int(row["n_features"])) == cloud.shape


# --- a tiny GPT-2 through transformers.Trainer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (96, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, 12:] = 0  # some padded windows
    data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i]} for i in range(96)]
    arguments = transformers.TrainingArguments(
        output_dir=str(root / "run"), per_device_train_batch_size=16, learning_rate=3e-3, max_steps=6,
        lr_scheduler_type="constant", save_strategy="steps", save_steps=2, save_only_model=True, logging_steps=1,
        report_to="none", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data).train()
    probe = root / "probe.pt"
    torch.save({"input_ids": ids[:40], "attention_mask": mask[:40]}, probe)
    return root / "run", probe


def gpt2_features(checkpoint, probe_file, settings):
    model = transformers.GPT2LMHeadModel.from_pretrained(str(checkpoint))  # transformers' own loader
    batch = torch.load(probe_file, weights_only=True)
    items = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
    return FeatureExtractor(settings.probe, layer=("transformer.ln_f",))(model, Probe(items)), model


@pytest.mark.slow
def test_hugging_face_checkpoints_match_the_functional_core(gpt2_run, tmp_path):
    folder, probe = gpt2_run
    before = snapshot(folder)
    result = analyze(folder, probe=probe, out_dir=tmp_path / "out", weights=True, progress=False)
    assert snapshot(folder) == before  # nothing written beside the checkpoints
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix != ".png") == [
        "analysis.csv",
        "analysis.json",
        "index.html",
    ]
    rows = read_csv(result.csv_path)
    features = [r for r in rows if r["source"] == "features"]
    assert [(r["step"], r["layer"]) for r in features] == [("2", "transformer.ln_f"), ("4", "transformer.ln_f"),
                                                           ("6", "transformer.ln_f")]  # fmt: skip
    # No layer named: the gpt preset's layer and settings, as the callback would have used them.
    settings = load("gpt").settings
    extracted = [gpt2_features(folder / f"checkpoint-{s}", probe, settings) for s in (2, 4, 6)]
    clouds, epsilon = reference([f for f, _ in extracted], settings)
    for row, cloud in zip(features, clouds, strict=True):
        assert_row_matches(row, cloud, epsilon, settings)
    assert features[0]["diagram_drift"] == ""
    assert float(features[1]["diagram_drift"]) > 0
    # The loss of each checkpoint, from trainer_state.json's log history.
    history = json.loads((folder / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    logged = {entry["step"]: entry["loss"] for entry in history if "loss" in entry}
    assert [float(r["loss"]) for r in features] == pytest.approx([logged[2], logged[4], logged[6]])
    # Weight space: Conv1D matrices (stored (in, out)) read as (out, in), per checkpoint.
    weights = [r for r in rows if r["source"] == "weights" and r["step"] == "6"]
    names = {r["layer"] for r in weights}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"} <= names
    model = extracted[2][1]
    c_attn = next(r for r in weights if r["layer"] == "transformer.h.0.attn.c_attn")
    matrix = model.transformer.h[0].attn.c_attn.weight.detach().T
    assert (c_attn["weight_rows"], c_attn["weight_columns"]) == ("96", "32")
    assert float(c_attn["neural_persistence"]) == pytest.approx(F.neural_persistence(matrix), rel=1e-12)
    assert float(c_attn["neural_persistence_normalized"]) == pytest.approx(
        F.neural_persistence(matrix, normalize=True), rel=1e-12
    )
    assert float(c_attn["weight_h0_total_persistence"]) == pytest.approx(
        F.weight_h0_total_persistence(matrix), rel=1e-12
    )
    # The JSON: the same rows, the preset, the correlations with the loss.
    data = json.loads(result.json_path.read_text())
    assert data["kind"] == "hf"
    assert data["preset"] == "gpt"
    assert data["losses"] == ["loss"]
    assert len(data["rows"]) == len(rows)
    assert data["epsilon"] == {"transformer.ln_f": pytest.approx(epsilon, rel=1e-12)}
    ci = next(c for c in data["correlations"] if c["quantity"] == "ci" and c["source"] == "features")
    assert ci["n"] == 3
    assert ci["loss"] == "loss"
    assert ci["p_value"] >= 1 / 3 - 1e-12  # exact: 2 of the 6 orderings of 3 points are as extreme as any
    report = result.report_path.read_text()
    assert "Spearman" in report
    assert "Weight space" in report
    assert "diagrams.png" in report


def test_hugging_face_layers_named_and_a_checkpoint_that_does_not_fit(gpt2_run, tmp_path):
    folder, probe = gpt2_run
    result = analyze(
        folder / "checkpoint-4", probe=probe, out_dir=tmp_path / "one", layers=["transformer.h.0", "*.ln_f"],
        progress=False, max_probe_samples=24,
    )  # fmt: skip
    assert [(r["step"], r["layer"], r["n_points"]) for r in result.rows] == [
        (4, "transformer.h.0", 24),
        (4, "transformer.ln_f", 24),
    ]
    # A pattern means what `layers=[...]` means everywhere: every module it matches that is not inside another
    # match (the blocks), not the last sublayer it matches; the modules analysed are in the result.
    blocks = analyze(folder / "checkpoint-4", probe=probe, out_dir=tmp_path / "blocks", layers=["transformer.h.*"],
                     progress=False, max_probe_samples=24)  # fmt: skip
    assert blocks.layers == ["transformer.h.0", "transformer.h.1"]
    assert [r["layer"] for r in blocks.rows] == ["transformer.h.0", "transformer.h.1"]
    assert blocks.findings
    # A factory that builds another model: the error names the checkpoint and what differs.
    with pytest.raises(InputError, match=r"checkpoint-2.* does not match the model GPT2LMHeadModel.*shape mismatch"):
        analyze(folder, probe=probe, out_dir=tmp_path / "bad", layers=["transformer.ln_f"], progress=False,
                factory=lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
                    vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)))  # fmt: skip
    with pytest.raises(InputError, match="`probe` is required to analyse model checkpoints"):
        analyze(folder, out_dir=tmp_path / "none", progress=False)


# --- a tiny CNN through Lightning -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    saver = ModelCheckpoint(
        dirpath=root / "ckpts", every_n_train_steps=4, save_top_k=-1, filename="{step}", monitor="train_loss"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer(root, [saver], max_steps=12, enable_checkpointing=True)
        trainer.fit(TinyCNN(lr=0.2), digits_loader())
    probe = root / "probe.npy"
    np.save(probe, digits(96)[0].numpy().astype(np.float64))
    return root / "ckpts", probe


def cnn_features(path, layer, settings):
    model = TinyCNN()
    model.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    probe = Probe(torch.tensor(np.load(path.parent.parent / "probe.npy"), dtype=torch.float32))
    return FeatureExtractor(settings.probe, layer=(layer,))(model, probe)


def test_lightning_checkpoints_match_the_functional_core(lightning_run, tmp_path):
    folder, probe = lightning_run
    result = analyze(
        folder, probe=probe, out_dir=tmp_path / "out", layers=["avgpool", "backbone.1"],
        factory="tests.integration.models:TinyCNN", weights=True, progress=False,
    )  # fmt: skip
    everything = read_csv(result.csv_path)
    rows = [r for r in everything if r["source"] == "features"]
    assert [(r["step"], r["layer"]) for r in rows] == [
        (str(step), layer) for step in (4, 8, 12) for layer in ("avgpool", "backbone.1")
    ]
    # Weight space: the conv kernels (out, in, 3, 3) read as (out, in * 9), the linear head as it is.
    model = TinyCNN()
    model.load_state_dict(torch.load(folder / "step=12.ckpt", weights_only=True)["state_dict"])
    weights = {r["layer"]: r for r in everything if r["source"] == "weights" and r["step"] == "12"}
    assert sorted(weights) == ["backbone.0", "backbone.2", "head"]
    kernel = model.backbone[2].weight.detach()
    assert (weights["backbone.2"]["weight_rows"], weights["backbone.2"]["weight_columns"]) == ("32", "144")
    assert float(weights["backbone.2"]["neural_persistence"]) == pytest.approx(
        F.neural_persistence(kernel.reshape(32, 144)), rel=1e-12
    )
    assert float(weights["head"]["weight_h0_total_persistence"]) == pytest.approx(
        F.weight_h0_total_persistence(model.head.weight.detach()), rel=1e-12
    )
    settings = MonitorSettings()
    for layer in ("avgpool", "backbone.1"):
        paths = [folder / f"step={step}.ckpt" for step in (4, 8, 12)]
        clouds, epsilon = reference([cnn_features(p, layer, settings) for p in paths], settings)
        for row, cloud in zip([r for r in rows if r["layer"] == layer], clouds, strict=True):
            assert_row_matches(row, cloud, epsilon, settings)
    # The loss: the ModelCheckpoint's monitored value at each save.
    scores = [
        float(next(iter(torch.load(folder / f"step={s}.ckpt", weights_only=True)["callbacks"].values()))[
            "current_score"]) for s in (4, 8, 12)
    ]  # fmt: skip
    assert [float(r["train_loss"]) for r in rows[::2]] == pytest.approx(scores)
    page = result.report_path.read_text()
    assert "weights_np.png" in page
    assert "heatmap_index.png" in page
    assert "Correlation with the loss" in page


def test_the_analysis_figures_have_titles_and_labelled_axes(lightning_run, tmp_path):
    folder, probe = lightning_run
    result = analyze(folder, probe=probe, out_dir=tmp_path / "out", layers=["avgpool"], factory=TinyCNN,
                     weights=True, progress=False)  # fmt: skip
    checkpoints = [Checkpoint(r["step"], folder, {"train_loss": r["train_loss"]}) for r in result.rows[::4]]
    correlations, losses = loss_correlations(result.rows, checkpoints)
    sections = analysis_sections(
        result.rows, correlations, losses, checkpoints, flattening_steps(result.rows), {"x": "y"}
    )
    names = [name for section in sections for name, _, _ in section.figures.items]
    assert names == ["losses.png", "geometry_rank.png", "geometry_decay.png", "persistence_total.png",
                     "persistence_wasserstein.png", "weights_np.png", "weights_tp.png"]  # fmt: skip
    for section in sections:
        assert_labelled(section.figures)


def test_a_wrapped_network_loses_its_prefix_and_a_wrong_one_is_named(lightning_run, tmp_path):
    folder, probe = lightning_run
    network = TinyCNN()
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    state = torch.load(folder / "step=8.ckpt", weights_only=True)["state_dict"]
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "global_step": 8}, wrapped / "a.ckpt")
    torch.save({f"model.{k}": v for k, v in state.items()}, wrapped / "step=9.ckpt")  # a bare state dict
    result = analyze(wrapped, probe=probe, out_dir=tmp_path / "o", layers=["avgpool"], factory=lambda: network,
                     progress=False)  # fmt: skip
    assert [r["step"] for r in result.rows] == [8, 9]
    settings = MonitorSettings()
    (cloud,), epsilon = reference([cnn_features(folder / "step=8.ckpt", "avgpool", settings)], settings)
    for row in result.rows:  # both files hold step=8.ckpt's weights
        assert_row_matches({k: str(v) for k, v in row.items()}, cloud, epsilon, settings)

    class Narrow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU())
            self.avgpool = torch.nn.AdaptiveAvgPool2d(1)
            self.head = torch.nn.Linear(8, 10)

    mismatch = r"step=4.ckpt' does not match the model Narrow built for it: 2 unexpected key.*shape mismatch"
    with pytest.raises(InputError, match=mismatch):
        analyze(folder, probe=probe, out_dir=tmp_path / "n", layers=["avgpool"], factory=Narrow, progress=False)
    with pytest.raises(InputError, match="`factory` is required for Lightning checkpoints"):
        analyze(folder, probe=probe, out_dir=tmp_path / "f", layers=["avgpool"], progress=False)
    with pytest.raises(InputError, match=r"`factory` 'tests.integration.models:Nope': .* has no callable 'Nope'"):
        analyze(folder, probe=probe, out_dir=tmp_path / "f", factory="tests.integration.models:Nope", progress=False)


def test_unsafe_checkpoints_are_refused_unless_trusted(lightning_run, tmp_path):
    folder, probe = lightning_run
    unsafe = tmp_path / "unsafe"
    unsafe.mkdir()
    state = torch.load(folder / "step=4.ckpt", weights_only=True)["state_dict"]
    torch.save({"state_dict": state, "global_step": 4, "extra": Opaque()}, unsafe / "step=4.ckpt")
    with pytest.raises(InputError) as refused:
        analyze(unsafe, probe=probe, out_dir=tmp_path / "o", layers=["avgpool"], factory=TinyCNN, progress=False)
    message = str(refused.value)
    assert "refusing to load the checkpoint" in message
    assert "step=4.ckpt" in message
    assert "Opaque" in message  # what failed
    assert "arbitrary code" in message
    assert "--trust-checkpoints" in message
    assert not (tmp_path / "o").exists()
    factory = tmp_path / "my_factory.py"  # a factory given as a file (--factory path/to/file.py:function)
    factory.write_text("from tests.integration.models import TinyCNN\n\n\ndef build():\n    return TinyCNN()\n")
    with pytest.warns(RuntimeWarning, match="weights_only=False"):
        result = analyze(unsafe, probe=probe, out_dir=tmp_path / "o", layers=["avgpool"], factory=f"{factory}:build",
                         trust_checkpoints=True, progress=False)  # fmt: skip
    assert [r["step"] for r in result.rows] == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_factory.py", "o", "unsafe"]  # no __pycache__


def test_unreadable_and_empty_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"`path` '.*empty' holds no checkpoints"):
        analyze(tmp_path / "empty", out_dir=tmp_path / "o")
    with pytest.raises(InputError, match=r"`path` '.*missing' does not exist"):
        analyze(tmp_path / "missing", out_dir=tmp_path / "o")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "step=1.ckpt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(InputError, match=r"cannot read the checkpoint '.*step=1.ckpt': .*Unsupported operand"):
        analyze(broken, probe=torch.zeros(4, 1, 8, 8), out_dir=tmp_path / "o", factory=TinyCNN, layers=["avgpool"])
    hf = tmp_path / "hf" / "checkpoint-3"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"cannot read the checkpoint '.*checkpoint-3': no model.safetensors"):
        analyze(tmp_path / "hf", out_dir=tmp_path / "o")
    assert not (tmp_path / "o").exists()


# --- feature arrays -------------------------------------------------------------------------------------------


def test_feature_arrays_by_step(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "features"
    folder.mkdir()
    base = rng.normal(size=(60, 8))
    steps = (0, 100, 200, 300)
    arrays = {}
    for i, step in enumerate(steps):
        squeeze = np.exp(-0.4 * i * np.arange(8))  # the last checkpoints lose directions
        arrays[step] = {"encoder": base * squeeze, "head": rng.normal(size=(60, 4))}
        if step == 200:
            arrays[step]["head"][0, 0] = np.nan
        torch.save({k: torch.tensor(v) for k, v in arrays[step].items()}, folder / f"step_{step}.pt")
    result = analyze(folder, out_dir=tmp_path / "out", progress=False)
    rows = read_csv(result.csv_path)
    expected = [(str(s), layer, "ok") for s in steps for layer in ("encoder", "head")]
    expected[5] = ("200", "head", "diverged")
    assert [(r["step"], r["layer"], r["status"]) for r in rows] == expected
    settings = MonitorSettings()
    clouds, epsilon = reference([arrays[s]["encoder"] for s in steps], settings)
    encoder = [r for r in rows if r["layer"] == "encoder"]
    for row, cloud in zip(encoder, clouds, strict=True):
        assert_row_matches(row, cloud, epsilon, settings)
    assert float(encoder[-1]["anisotropy_term"]) > float(encoder[0]["anisotropy_term"])
    # The H0/H1 statistics and the Wasserstein distances are those of the measured diagrams.
    h0 = F.persistence_diagrams(clouds[1], max_points=256, threshold=F.longest_mst_edge(clouds[1]))[0]
    finite = h0[np.isfinite(h0[:, 1])]
    assert float(encoder[1]["h0_count"]) == len(finite)
    assert float(encoder[1]["h0_total_persistence"]) == pytest.approx(F.total_persistence(finite), rel=1e-9)
    drift = float(encoder[1]["wasserstein_h0"]) + float(encoder[1]["wasserstein_h1"])
    assert float(encoder[1]["diagram_drift"]) == pytest.approx(drift, rel=1e-12)
    page = result.report_path.read_text()
    assert "Step 200: diverged check on layer <code>head</code>" in page
    assert "The checkpoints carry no loss or perplexity" in page
    data = json.loads(result.json_path.read_text())
    assert data["correlations"] == []
    assert data["correlations_note"] == "the checkpoints carry no loss or perplexity"
    assert all(v is None or not isinstance(v, float) or math.isfinite(v) for row in data["rows"] for v in row.values())

    only = analyze(folder, out_dir=tmp_path / "only", layers=["encoder"], progress=False)
    assert {r["layer"] for r in only.rows} == {"encoder"}
    with pytest.raises(InputError, match=r"step_0.pt' has no layer\(s\) \['decoder'\]; it has \['encoder', 'head'\]"):
        analyze(folder, out_dir=tmp_path / "x", layers=["decoder"], progress=False)
    (folder / "notes.npy").write_bytes(b"")
    with pytest.raises(InputError, match=r"cannot tell the step of the feature file '.*notes.npy'"):
        analyze(folder, out_dir=tmp_path / "x", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["features", "only", "out"]
