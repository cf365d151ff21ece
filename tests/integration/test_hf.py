"""The Hugging Face callback in real ``transformers.Trainer.train`` runs on CPU."""

import html as markup
import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE, digits, zen_texts, zen_tokenizer
from topocallbacks import InputError, Policy
from topocallbacks.exceptions import ConfigError
from topocallbacks.hf import TopoCollapseTrainerCallback


class DigitsNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x, labels=None):
        logits = self.head(self.encoder(x))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def flat_digits():
    images, labels = digits()
    return images.flatten(1), labels


def digits_dataset(n=512):
    x, y = flat_digits()
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


PROBE = flat_digits()[0][:128]


def arguments(tmp_path, **overrides):
    settings = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 32,
        "learning_rate": 0.1,
        "max_steps": 10,
        "lr_scheduler_type": "constant",
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


class Recorder(TrainerCallback):
    """Records the hooks that matter here, with the control flags as the callbacks before it left them."""

    def __init__(self):
        self.events = []
        self.rates = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("on_train_begin", state.global_step))

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.events.append(("on_step_end", state.global_step, control.should_save, control.should_training_stop))
        self.rates[state.global_step] = optimizer.param_groups[0]["lr"]

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("on_save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("on_train_end", state.global_step))


def always(action, **kwargs):
    """A policy that fires at the first check after a one-check warm-up (the index alone: the old default rule's
    channels, so that the loss channel's confirmation is not needed)."""
    settings = {**OLD_RULE, "score": "value", "threshold": -1.0, "patience": 1, "warmup": 1, "cooldown": 100}
    return Policy(**{**settings, "action": action, **kwargs})


def checks(callback):
    return [r for r in callback.history if r.kind == "check"]


def interventions(callback):
    return [r for r in callback.history if r.kind == "intervention"]


def test_checks_land_in_log_history_every_n_steps(tmp_path):
    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=5, **AT_CADENCE)
    trainer = Trainer(model=DigitsNet(), args=arguments(tmp_path), train_dataset=digits_dataset(), callbacks=[callback])
    trainer.train()
    assert [r.step for r in checks(callback)] == [0, 5, 10]
    logged = [entry for entry in trainer.state.log_history if "topo/ci" in entry]
    assert [entry["step"] for entry in logged] == [0, 5, 10]
    assert logged[0]["topo/index"] == 0.0  # diagram drift has nothing to drift from at the first check
    assert all(math.isfinite(entry["topo/ci"]) for entry in logged)
    assert [entry["topo/index"] for entry in logged[1:]] == [r.index_value for r in checks(callback)[1:]]
    assert all(value > 0 for value in [entry["topo/index"] for entry in logged[1:]])


def test_a_stop_saves_a_checkpoint_then_stops_in_this_exact_hook_sequence(tmp_path):
    callback = TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", check_every=2, policy=always("stop"), **AT_CADENCE
    )
    recorder = Recorder()
    trainer = Trainer(
        model=DigitsNet(), args=arguments(tmp_path), train_dataset=digits_dataset(), callbacks=[callback, recorder]
    )
    trainer.train()
    assert recorder.events == [
        ("on_train_begin", 0),
        ("on_step_end", 1, False, False),
        ("on_step_end", 2, True, True),  # our callback only set the Trainer's control flags
        ("on_save", 2),  # the Trainer saved the checkpoint of the stopping step first
        ("on_train_end", 2),
    ]
    assert (tmp_path / "checkpoint-2").is_dir()
    stop = interventions(callback)[-1]
    assert stop.step == 2
    assert stop.action == "stop"
    assert "control.should_save set (the Trainer saves checkpoint-2)" in stop.detail
    assert "control.should_training_stop set" in stop.detail
    # The rule can stop, so healthy checks keep snapshots, and the stop restores the newest one first.
    assert stop.snapshot_step == 0
    assert stop.detail.startswith("restored the last healthy state, the snapshot of step 0 (2 updates undone)")


def test_the_learning_rate_cut_is_still_in_effect_steps_later_under_the_linear_schedule(tmp_path):
    callback = TopoCollapseTrainerCallback(
        probe=PROBE,
        layer="encoder",
        check_every=2,
        # The rule holds at every check; after the one cut, "none" (a stop would go through the cooldown).
        policy=always("lower_lr", lr_factor=0.5, max_lr_cuts=1, after_max_lr_cuts="none"),
        **AT_CADENCE,
    )
    recorder = Recorder()
    args = arguments(tmp_path, lr_scheduler_type="linear", warmup_steps=0)
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[callback, recorder]).train()
    # Linear decay from 0.1 to 0 over 10 steps; halved from step 2 on (the cut lands in step 2's on_step_end).
    assert recorder.rates[1] == pytest.approx(0.1 * (1 - 1 / 10))
    for step in range(2, 10):
        assert recorder.rates[step] == pytest.approx(0.05 * (1 - step / 10)), step
    cut = interventions(callback)
    assert len(cut) == 1
    assert cut[0].action == "lower_lr"
    assert cut[0].lr_factor == 0.5


def test_a_warning_names_the_step_and_the_reason(tmp_path):
    callback = TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", check_every=2, policy=always("warn"), **AT_CADENCE
    )
    with pytest.warns(RuntimeWarning, match=r"topocallbacks at step 2: index .* >= threshold -1.0"):
        Trainer(
            model=DigitsNet(),
            args=arguments(tmp_path, max_steps=2),
            train_dataset=digits_dataset(),
            callbacks=[callback],
        ).train()


@pytest.mark.parametrize("rebuild", [False, True], ids=["read-by-the-callback", "rebuilt-by-the-trainer"])
def test_resume_restores_the_state_from_trainer_state_json_and_never_refires(tmp_path, rebuild):
    # The rule holds at every check: one LR cut at step 2, then nothing (the cut count is in the saved state).
    policy = {
        **OLD_RULE,
        "action": "lower_lr",
        "score": "value",
        "threshold": -1.0,
        "patience": 1,
        "warmup": 1,
        "max_lr_cuts": 1,
        "after_max_lr_cuts": "none",
    }
    first = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=2, policy=policy, **AT_CADENCE)
    args = arguments(
        tmp_path, max_steps=8, save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=rebuild
    )
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[first]).train()
    assert [r.step for r in interventions(first)] == [2]
    saved = transformers.TrainerState.load_from_json(str(tmp_path / "checkpoint-4" / "trainer_state.json"))
    assert saved.stateful_callbacks["TopoCollapseTrainerCallback"]["args"]["probe_hash"] is not None

    first_history = list(first.history)
    fresh = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=2, policy=policy, **AT_CADENCE)
    trainer = Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[fresh])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    # Two consecutive runs in one process (a notebook): the first run's callback, alive and watching the same layer
    # with the same probe, is left alone; the resumed run's state goes to the callback the user passed.
    assert first.history == first_history
    restored = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TopoCollapseTrainerCallback))
    assert (restored is not fresh) is rebuild  # with the flag on, the Trainer rebuilt it from trainer_state.json
    assert [r.step for r in checks(restored)] == [0, 2, 4, 6, 8]
    assert [r.step for r in interventions(restored)] == [2]  # a fresh policy would cut again at step 6
    assert restored.monitor.lr_factor_ == 0.5
    assert [r.index_value for r in checks(restored)][:3] == [r.index_value for r in checks(first)][:3]
    assert fresh.history is restored.history  # the user's object sees the live state, rebuilt or not


def test_a_rebuilt_callback_follows_the_new_arguments_of_the_users_callback(tmp_path):
    args = arguments(
        tmp_path, max_steps=12, save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=True
    )
    first = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=2, **AT_CADENCE)
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[first]).train()
    fresh = TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", check_every=4, history_path=str(tmp_path / "h"), **AT_CADENCE
    )
    trainer = Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[fresh])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    restored = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TopoCollapseTrainerCallback))
    assert restored is not fresh
    assert [r.step for r in checks(fresh)] == [0, 2, 4, 8, 12]  # the saved checks, then every 4 steps (the new value)
    assert fresh.monitor.settings.schedule.check_every == 4
    assert (tmp_path / "h").read_text().count("\n") == 2  # the new history file receives the new checks


@pytest.mark.slow
def test_two_rebuilt_callbacks_on_one_layer_each_resume_their_own_state(tmp_path):
    args = arguments(
        tmp_path, max_steps=8, save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=True
    )

    def pair():
        return [
            TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=2, prefix="topo/a", **AT_CADENCE),
            TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=4, prefix="topo/b", **AT_CADENCE),
        ]

    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=pair()).train()
    a, b = pair()
    trainer = Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[a, b])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert a.history is not b.history
    assert [r.step for r in checks(a)] == [0, 2, 4, 6, 8]
    assert [r.step for r in checks(b)] == [0, 4, 8]
    assert [e["step"] for e in trainer.state.log_history if "topo/b/ci" in e] == [0, 4, 8]


def test_the_values_reach_report_to_tensorboard_and_the_console(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=5, **AT_CADENCE)
    # No logging steps of its own: the callback makes the Trainer log at its checks.
    args = arguments(tmp_path, report_to="tensorboard", logging_strategy="no")
    trainer = Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[callback])
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("TopoCollapseTrainerCallback") < names.index("TensorBoardCallback")
    trainer.train()
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    events = EventAccumulator(str(runs[0])).Reload()
    assert {"train/topo/ci", "train/topo/index", "train/topo/betti0"} <= set(events.Tags()["scalars"])
    # The checks did not make the Trainer log its loss (logging_strategy="no": nothing else logs it).
    assert "train/loss" not in events.Tags()["scalars"]
    assert not [entry for entry in trainer.state.log_history if "loss" in entry]
    logged = events.Scalars("train/topo/ci")
    # Each check at its own step, the start check at step 0.
    assert [e.step for e in logged] == [0, 5, 10]
    assert [e.value for e in logged] == pytest.approx([r.report.ci for r in checks(callback)])
    assert "'topo/ci': " in capsys.readouterr().out  # the console's log lines (PrinterCallback) carry them too


def test_console_false_keeps_the_values_off_the_console_and_in_report_to(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=5, console=False, **AT_CADENCE)
    args = arguments(tmp_path, report_to="tensorboard", logging_strategy="no")
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[callback]).train()
    assert "topo/" not in capsys.readouterr().out
    events = EventAccumulator(str(next((tmp_path / "runs").iterdir()))).Reload()
    assert [e.step for e in events.Scalars("train/topo/ci")] == [0, 5, 10]


def test_attach_places_the_callback_before_the_report_to_callbacks(tmp_path):
    pytest.importorskip("tensorboard")
    trainer = Trainer(model=DigitsNet(), args=arguments(tmp_path, report_to="tensorboard"))
    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", **AT_CADENCE)
    assert callback.attach(trainer) is callback
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names[:3] == ["DefaultFlowCallback", "TopoCollapseTrainerCallback", "TensorBoardCallback"]
    callback.attach(trainer)  # idempotent
    assert len(trainer.callback_handler.callbacks) == len(names)


def test_two_callbacks_on_two_layers_log_under_their_layer(tmp_path, capsys):
    a = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=5, **AT_CADENCE)
    b = TopoCollapseTrainerCallback(probe=PROBE, layer="head", check_every=5, summary=False, **AT_CADENCE)
    trainer = Trainer(model=DigitsNet(), args=arguments(tmp_path), train_dataset=digits_dataset(), callbacks=[a, b])
    trainer.train()
    assert (a.prefix, b.prefix) == ("topo/encoder", "topo/head")
    history = trainer.state.log_history
    assert [e["step"] for e in history if "topo/encoder/ci" in e] == [0, 5, 10]
    assert [e["step"] for e in history if "topo/head/ci" in e] == [0, 5, 10]
    assert not [e for e in history if "topo/ci" in e]
    out = capsys.readouterr().out
    # One summary (b's is off), after training, naming the checks and the layer.
    assert out.count("topocallbacks: ") == 1
    assert (
        "topocallbacks: 3 checks (steps 0-10) at layer encoder of diagram_drift; no warning and no intervention." in out
    )


def test_the_callback_writes_a_report_of_its_run(tmp_path):
    policy = Policy(**{**OLD_RULE, "action": "lower_lr", "score": "value", "threshold": -1.0, "patience": 1,
                       "warmup": 1, "cooldown": 0})  # fmt: skip
    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=5, policy=policy, **AT_CADENCE)
    Trainer(model=DigitsNet(), args=arguments(tmp_path), train_dataset=digits_dataset(), callbacks=[callback]).train()
    page = callback.report(tmp_path / "report", title="digits")
    html = page.read_text()
    text = markup.unescape(html)
    assert "<title>digits</title>" in html
    assert {"index.png", "composite_0.png", "diagrams.png"} <= {p.name for p in page.parent.iterdir()}
    cuts = [r for r in callback.history if r.kind == "intervention"]
    assert [r.step for r in cuts] == [5, 10]
    assert all(r.reason.split(":")[0] in text for r in cuts)  # each intervention is diagnosed on the page


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_text_probe_from_raw_strings_with_the_trainers_tokenizer(tmp_path, name):
    tokenizer = zen_tokenizer(padding_side="right" if name == "gpt" else "left")
    assert tokenizer.pad_token_id is None  # as GPT-2's and LLaMA's tokenizers come
    texts = zen_texts()
    if name == "gpt":
        config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    ids = torch.tensor([tokenizer(t)["input_ids"][:8] + [0] * (8 - len(tokenizer(t)["input_ids"][:8])) for t in texts])
    data = [{"input_ids": row, "labels": row} for row in ids]
    callback = TopoCollapseTrainerCallback.from_preset(name, probe=texts, check_every=2, **AT_CADENCE)
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=4, learning_rate=1e-3,
                      per_device_train_batch_size=8), train_dataset=data, processing_class=tokenizer,
                      data_collator=transformers.default_data_collator,
                      callbacks=[callback])  # fmt: skip
    trainer.train()
    probe = callback.monitor.probe
    assert probe.spec.source == "texts"
    assert len(probe) == len(texts)
    first = probe.items[0]
    assert first["input_ids"][first["attention_mask"] == 1].tolist() == tokenizer(texts[0])["input_ids"]
    records = checks(callback)
    assert [r.step for r in records] == [0, 2, 4]
    assert all(r.status == "ok" and math.isfinite(r.report.ci) for r in records)


def test_a_batch_encoding_is_a_probe(tmp_path):
    tokenizer = zen_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    encoding = tokenizer(zen_texts(), padding=True, return_tensors="pt")
    callback = TopoCollapseTrainerCallback(probe=encoding, layer="transformer.ln_f", check_every=2, **AT_CADENCE)
    assert callback.monitor.probe.spec.source == "columns"
    assert len(callback.monitor.probe) == len(zen_texts())
    with pytest.raises(InputError, match="pass `tokenizer=` to the callback or `processing_class=` to the Trainer"):
        TopoCollapseTrainerCallback(probe=zen_texts(), layer="encoder", **AT_CADENCE).on_train_begin(
            arguments(tmp_path), transformers.TrainerState(), transformers.TrainerControl(), model=DigitsNet()
        )


@pytest.mark.slow
def test_streaming_mode_keeps_a_meaningful_window_over_2000_steps(tmp_path):
    callback = TopoCollapseTrainerCallback(layer="encoder", mode="stream", check_every=100, **AT_CADENCE)
    args = arguments(tmp_path, max_steps=2000, learning_rate=0.3, optim="sgd", per_device_train_batch_size=64)
    data = digits_dataset(n=1797)
    Trainer(model=DigitsNet(), args=args, train_dataset=data, callbacks=[callback]).train()
    records = checks(callback)
    assert [r.step for r in records][:2] == [100, 200]  # the window is empty at step 0: no check there
    assert len(records) == 20
    full = [r for r in records if r.n_points == r.window]
    assert len(full) >= 15
    assert all(r.report.betti0 < r.n_points and 0.001 < r.density < 0.9 for r in full)


def test_a_restore_without_the_users_callback_says_what_to_do(tmp_path):
    # What the Trainer rebuilds from a checkpoint (restore_callback_states_from_checkpoint) stands for the callback the
    # resumed Trainer was built with; a Trainer built without one gets the package's error at its first hook.
    rebuilt = TopoCollapseTrainerCallback(layer="encoder", probe_hash="0" * 64, restoring=True, **AT_CADENCE)
    args = arguments(tmp_path, max_steps=2)
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[rebuilt])
    with pytest.raises(InputError, match="pass the same callback, with the same probe, to the Trainer of the resumed"):
        rebuilt.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(), model=DigitsNet())


def test_probe_from_the_train_dataset_drops_the_labels(tmp_path):
    callback = TopoCollapseTrainerCallback(
        probe="train", layer="encoder", check_every=5, max_probe_samples=64, **AT_CADENCE
    )
    Trainer(
        model=DigitsNet(), args=arguments(tmp_path, max_steps=5), train_dataset=digits_dataset(), callbacks=[callback]
    ).train()
    assert callback.monitor.probe.spec.n_samples == 64
    assert "labels" not in callback.monitor.probe.items[0]
    assert [r.n_points for r in checks(callback)] == [64, 64]


def test_bad_arguments_are_named():
    with pytest.raises(InputError, match="`probe` given as text must be 'train' or 'eval'"):
        TopoCollapseTrainerCallback(probe="val", layer="encoder", **AT_CADENCE)
    with pytest.raises(InputError, match=r"`mode` must be one of \['probe', 'stream'\], got 'batch'"):
        TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", mode="batch", **AT_CADENCE)
    with pytest.raises(ConfigError, match="unknown argument `check_evry`; did you mean `check_every`"):
        TopoCollapseTrainerCallback.from_preset("gpt", probe=PROBE, check_evry=3, **AT_CADENCE)
    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="nope", **AT_CADENCE)
    with pytest.raises(InputError, match="`layer` 'nope' is not a module of DigitsNet"):
        callback.on_train_begin(None, transformers.TrainerState(), transformers.TrainerControl(), model=DigitsNet())


def test_gpt_preset_on_a_tiny_gpt2_through_trainer(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (96, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, 12:] = 0  # some padded windows: the preset's mean pooling must skip them
    data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i]} for i in range(96)]
    probe = [{"input_ids": ids[i], "attention_mask": mask[i]} for i in range(48)]
    callback = TopoCollapseTrainerCallback.from_preset("gpt", probe=probe, check_every=2, **AT_CADENCE)
    assert callback.monitor.settings.schedule.check_every == 2
    assert callback.monitor.settings.index.name == "diagram_drift"
    Trainer(model=model, args=arguments(tmp_path, max_steps=6, learning_rate=1e-3), train_dataset=data,
            callbacks=[callback]).train()  # fmt: skip
    records = checks(callback)
    assert [r.step for r in records] == [0, 2, 4, 6]
    assert all(math.isfinite(r.report.ci) for r in records)
    assert records[0].index_value is None
    assert all(math.isfinite(r.index_value) for r in records[1:])
    assert callback.monitor.extractor.resolved_layer_ == "transformer.ln_f"


def test_import_without_transformers_gives_an_install_hint():
    code = "import sys; sys.modules['transformers'] = None\nimport topocallbacks.hf"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert result.returncode != 0
    assert "pip install 'topocallbacks[hf]'" in result.stderr


def test_the_callback_pickles_and_its_state_is_json(tmp_path):
    callback = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=5, **AT_CADENCE)
    Trainer(
        model=DigitsNet(), args=arguments(tmp_path, max_steps=5), train_dataset=digits_dataset(), callbacks=[callback]
    ).train()
    state = json.loads(json.dumps(callback.state()))
    assert state["args"]["settings"]["probe"]["layer"] == ["encoder"]
    assert [r["step"] for r in state["attributes"]["_restored"]["monitor"]["history"]] == [0, 5]
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.monitor.state_dict() == callback.monitor.state_dict()


def test_a_dataset_that_is_not_a_torch_dataset_is_read_as_inputs(tmp_path):
    class Columns:  # what a `datasets.Dataset` looks like to the callback: sized, indexable, dict items
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.x)

        def __getitem__(self, index):
            return {"x": self.x[index].tolist(), "labels": int(self.y[index])}

    x, y = flat_digits()
    callback = TopoCollapseTrainerCallback(probe=Columns(x[:50], y[:50]), layer="encoder", check_every=5, **AT_CADENCE)
    assert callback.monitor.probe.spec.n_samples == 50
    assert set(callback.monitor.probe.items[0]) == {"x"}
    torch.testing.assert_close(callback.monitor.probe.items[3]["x"], x[3])


def test_a_budgeted_train_plans_once_and_a_second_train_given_that_plan_checks_and_decides_the_same(tmp_path):
    # As in Lightning: the plan (made at the third check, step 4, from this machine's timings) is recorded; a second
    # `Trainer.train` given it as `plan=`, with no budget, checks and decides as the first did.
    policy = always("lower_lr", max_lr_cuts=100)
    first = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=2, overhead_budget=0.001,
                                        policy=policy)  # fmt: skip
    args = arguments(tmp_path, max_steps=60)
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[first]).train()
    (made,) = [r.plan for r in checks(first) if r.plan is not None]
    assert made.at_step == 4
    second = TopoCollapseTrainerCallback(probe=PROBE, layer="encoder", check_every=2, policy=policy,
                                         plan=made.settings, **AT_CADENCE)  # fmt: skip
    Trainer(model=DigitsNet(), args=args, train_dataset=digits_dataset(), callbacks=[second]).train()

    def what(callback):
        return [(r.step, r.n_points, r.applied_step, r.index_value, r.decision.action.value) for r in checks(callback)]

    assert what(second) == what(first)
    assert [(r.step, r.action) for r in interventions(second)] == [(r.step, r.action) for r in interventions(first)]
    assert len(checks(first)) < 31  # the plan did change the cadence (a check every 2 steps would give 31)
