"""The GPU-overhead benchmark's 4-layer configuration runs on a CPU, with tiny models (a smoke test)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_overhead", ROOT / "benchmarks" / "gpu_overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_overhead"] = module
    spec.loader.exec_module(module)
    return module


def test_four_layers_resolve_on_every_model_of_both_sizes(bench):
    import torch
    import transformers

    from topocallbacks.presets import load
    from topocallbacks.probe import resolve_layers

    for model, size in [("gpt2", "tiny"), ("gpt2", "small"), ("resnet18", "tiny"), ("mlp", "tiny")]:
        if size == "small":  # GPT-2 small's names, without building its 124M parameters
            network = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=12, n_embd=8, n_head=2))
        else:
            network = bench.build(model, size)
        lightning_like = torch.nn.Module()
        lightning_like.model = network  # the benchmark's LightningModule holds the network as `model`
        settings = load(bench.preset_of(model)).settings
        probe = settings.merged(bench.callback_overrides(model, "probe_4layers", None, size)).probe
        for root in [lightning_like] if model == "mlp" else [network, lightning_like]:
            names = resolve_layers(root, probe.layers, primary=probe.layer, shortcuts=probe.shortcuts)
            assert len(names) == 4, (model, size, names)


@pytest.mark.slow
def test_the_4_layer_configuration_runs_in_lightning_and_hf_on_a_cpu(bench, tmp_path):
    import torch

    device = torch.device("cpu")
    lightning = bench.lightning_run("mlp", "tiny", (512,), "probe_4layers", 12, device, False)
    assert lightning["checks"] == 1
    assert lightning["layers"] == 4
    assert lightning["probe_pass_ms"] > 0
    hf = bench.hf_run("gpt2", "tiny", (4, 64), "probe_4layers", 6, device, False)
    assert hf["checks"] == 1
    assert hf["layers"] == 4
    assert bench.table({"hf:gpt2:4x64": {"probe_4layers": [hf]}}).count("probe_4layers") == 1
    json.dumps([lightning, hf])
