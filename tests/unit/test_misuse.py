"""Misuse gets the package's errors: an InputError that names the argument and the value (and, for a probe pass,
the model, the layer and the step), never a TypeError from deep inside; a preset is used the same way everywhere.
"""

import numpy as np
import pytest
import torch

from tests.cadence import AT_CADENCE
from topocallbacks import TopoMonitor
from topocallbacks.exceptions import ConfigError, InputError
from topocallbacks.presets import load

FEATURES = np.random.default_rng(0).normal(size=(40, 4))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"step": "a"}, r"`step` must be an integer >= 0, got 'a' of type str"),
        ({"step": None}, r"`step` must be an integer >= 0, got None"),
        ({"step": 1.5}, r"`step` must be an integer >= 0, got 1.5 of type float"),
        ({"step": True}, r"`step` must be an integer >= 0, got True of type bool"),
        ({"step": -1}, r"`step` must be an integer >= 0, got -1"),
        ({"step": 0, "loss": "x"}, r"`loss` must be a number or a tensor, got 'x' of type str"),
        ({"step": 0, "loss": [1, 2]}, r"`loss` must be a number or a tensor, got \[1, 2\] of type list"),
        ({"step": 0, "grad_norm": -1.0}, r"`grad_norm` must be >= 0 \(a norm\), got -1.0"),
        ({"step": 0, "grad_norm": "big"}, r"`grad_norm` must be a number or a tensor, got 'big'"),
    ],
)
def test_bad_steps_losses_and_norms_are_named_with_their_value(arguments, message):
    with pytest.raises(InputError, match=message):
        TopoMonitor(check_every=1, **AT_CADENCE).process(FEATURES, **arguments)


@pytest.mark.parametrize("entry", ["on_step", "observe"])
def test_every_entry_point_checks_its_step(entry):
    monitor = TopoMonitor(check_every=1, mode="stream" if entry == "observe" else "probe", **AT_CADENCE)
    call = {"on_step": lambda: monitor.on_step("3"), "observe": lambda: monitor.observe(FEATURES, "3")}[entry]
    with pytest.raises(InputError, match=r"`step` must be an integer >= 0, got '3'"):
        call()


def test_a_non_finite_loss_or_norm_is_data_not_misuse():
    # NaN and Inf are what divergence looks like: they make a diverged check, not an error.
    record = TopoMonitor(check_every=1, **AT_CADENCE).process(FEATURES, 0, loss=float("nan"), grad_norm=float("inf"))
    assert record.decision.rule == "diverged"


@pytest.mark.parametrize("model", [None, "net", 3])
def test_check_without_a_model_names_the_argument(model):
    monitor = TopoMonitor(check_every=1, layer="0", probe=torch.randn(20, 8), **AT_CADENCE)
    with pytest.raises(InputError, match=r"`model` must be a torch module, got "):
        monitor.check(model, 0)


@pytest.mark.parametrize(
    ("probe", "said"),
    [
        (torch.randn(20, 5), r"mat1 and mat2 shapes cannot be multiplied"),
        (torch.ones(20, 8, dtype=torch.long), r"dtype"),
    ],
)
def test_a_probe_the_model_cannot_take_names_the_model_the_layer_the_step_and_the_probe(probe, said):
    net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    monitor = TopoMonitor(check_every=1, layer="0", probe=probe, **AT_CADENCE)
    with pytest.raises(InputError) as raised:
        monitor.check(net, 3)
    text = str(raised.value)
    assert "the probe pass of Sequential failed at step 3 (layer '0')" in text
    assert f"probe of shape {tuple(probe.shape)} and dtype {probe.dtype}" in text
    assert raised.match(said)


def test_a_preset_is_given_to_the_monitor_as_to_the_callbacks():
    by_name = TopoMonitor(preset="gpt", check_every=20, **AT_CADENCE)
    by_class = TopoMonitor.from_preset("gpt", check_every=20, **AT_CADENCE)
    expected = load("gpt").settings.merged({"check_every": 20, **AT_CADENCE})
    assert by_name.settings == by_class.settings == expected
    with pytest.raises(ConfigError, match="preset"):
        TopoMonitor(preset="gtp", **AT_CADENCE)
