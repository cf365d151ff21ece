import dataclasses
import importlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.cadence import AT_CADENCE
from tests.waiting import HANG_SECONDS
from topocallbacks import ConfigError, MonitorSettings, Policy, presets
from topocallbacks.presets import parse_preset

ROOT = Path(__file__).parents[2]


def test_the_four_architectures_are_available_and_valid():
    assert {"resnet", "vit", "gpt", "llama"} <= set(presets.available())
    for name in ("resnet", "vit", "gpt", "llama"):
        preset = presets.load(name)
        assert preset.name == name
        assert preset.settings.probe.layer
        assert preset.settings.probe.size == 512
        # The library's default rule: no architecture needed another (see the test below for where it comes from).
        assert preset.settings.policy is None
        assert preset.settings.rule == MonitorSettings().rule
        assert preset.settings.rollback_skip == 2 * preset.settings.schedule.check_every
    assert presets.load("vit").settings.probe.pooling == "cls"
    assert presets.load("llama").settings.probe.layer[0] == "model.norm"
    assert presets.load("gpt").settings.transform.projection == "random"


def test_the_default_rule_is_the_one_the_rescue_suite_chose():
    """The suite's selection rule, recomputed from the stored records (not the stored key), chooses the library's
    default rule, nothing overridden; the stored key says the same."""
    suite = Path(__file__).parents[2] / "benchmarks" / "rescue"
    data = json.loads((suite.parent / "results" / "rescue.json").read_text())
    sys.path.insert(0, str(suite))
    try:
        detectors = importlib.import_module("detectors")
        outputs = importlib.import_module("outputs")
    finally:
        sys.path.remove(str(suite))
    chosen, _ = outputs.choose_default(outputs.summarise(data["records"]))
    assert chosen == data["default"]["key"]
    assert detectors.DETECTORS[chosen].policy == {}


def test_preset_files_state_only_what_differs_from_the_defaults():
    import yaml

    defaults = MonitorSettings().as_dict()
    defaults["policy"] = dataclasses.asdict(MonitorSettings().rule)  # None there: the default rule
    for name in presets.available():
        data = yaml.safe_load((presets.preset_dir() / f"{name}.yaml").read_text())
        for section, values in data.items():
            if section in ("name", "description"):
                continue
            for key, value in values.items():
                default = defaults[section][key]
                assert value != default, f"{name}.yaml repeats the default {section}.{key} = {default!r}"


def write(tmp_path, text, name="my.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


MINIMAL = "probe:\n  layer: encoder\n"


def test_a_users_own_yaml_works_like_a_bundled_one(tmp_path):
    path = write(tmp_path, MINIMAL + "schedule:\n  check_every: 7\npolicy:\n  action: stop\n")
    preset = presets.load(str(path))
    assert preset.name == "my"
    assert preset.settings.probe.layer == ("encoder",)
    assert preset.settings.schedule.check_every == 7
    assert preset.settings.rule.action == "stop"
    assert preset.settings.rule.threshold == 4.5  # merged into the default rule
    assert preset.settings.index.weights == "paper"  # defaults fill the rest


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "polcy: {}\n" + MINIMAL,
            r"unknown key `polcy` in .*my.yaml; did you mean `policy`\? Valid keys: "
            r"\['description', 'index', 'interventions', 'name', 'output', 'policy', 'probe', 'schedule', 'seed', "
            r"'transform'\]",
        ),
        (
            MINIMAL + "policy:\n  patince: 3\n",
            r"unknown key `policy.patince` in .*; did you mean `policy.patience`\? "
            r"Valid keys of policy: \['action', 'after_max_lr_cuts',",
        ),
        (
            MINIMAL + "index:\n  projection: pca\n",
            r"unknown key `index.projection` in .*my.yaml Valid keys of index: \['epsilon', ",
        ),
        (
            MINIMAL + "policy:\n  patience: three\n",
            r"`policy.patience` must be an integer >= 1, got 'three' of type str in .*my.yaml",
        ),
        (MINIMAL + "policy:\n  patience: 0\n", r"`policy.patience` must be an integer >= 1, got 0 in .*my.yaml"),
        (
            MINIMAL + "policy:\n  lr_factor: 2\n",
            r"`policy.lr_factor` must be a finite number in \(0, 1\), got 2 in .*my.yaml",
        ),
        (MINIMAL + "schedule:\n  check_every: 0\n", r"`schedule.check_every` must be an integer >= 1, got 0"),
        (MINIMAL + "schedule:\n  mode: batch\n", r"`schedule.mode` must be one of \['probe', 'stream'\], got 'batch'"),
        (
            MINIMAL + "index:\n  epsilon_quantile: 1.5\n",
            r"`index.epsilon_quantile` must be a finite number in \(0, 1\]",
        ),
        (MINIMAL + "transform:\n  normalize: yes please\n", r"`transform.normalize` must be true or false, got 'yes"),
        (MINIMAL + "probe:\n  layer: x\n  pooling: avg\n", r"`probe.pooling` must be one of \['auto', .* in .*my.yaml"),
        (MINIMAL + "probe:\n  layer: []\n", r"`probe.layer` must be a module name or a non-empty list of name"),
        ("probe:\n  pooling: mean\n", r"`probe.layer` is required in"),
        (MINIMAL + "probe:\n  layer: x\n  size: 1\n", r"`probe.size` must be an integer >= 2, got 1"),
        (MINIMAL + "seed: -2\n", r"`seed` must be an integer >= 0, got -2 in .*my.yaml"),
        ("- 1\n- 2\n", "a preset must be a mapping of sections, got list"),
        ("probe: [1, 2]\n", "`probe` must be a mapping, got list"),
        ("!!python/object/apply:os.system ['echo hacked']\n", "is not valid YAML"),
    ],
)
def test_bad_presets_name_the_key_path_and_the_file(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        presets.load(str(write(tmp_path, text)))


def test_unknown_preset_names():
    with pytest.raises(ConfigError, match=r"unknown preset 'gtp'; did you mean 'gpt'\? Available presets: \["):
        presets.load("gtp")
    with pytest.raises(ConfigError, match=r"preset file 'missing\.yaml' does not exist"):
        presets.load("missing.yaml")


def test_parse_preset_from_a_mapping():
    preset = parse_preset({"probe": {"layer": ["a", "*.b"]}, "policy": {"threshold": 0.2}}, origin="inline")
    assert preset.settings.probe.layer == ("a", "*.b")
    assert preset.settings.rule.threshold == 0.2


def test_from_preset_overrides_every_value():
    pytest.importorskip("lightning")
    from topocallbacks.lightning import TopoCollapseCallback

    probe = torch.randn(8, 3)
    callback = TopoCollapseCallback.from_preset(
        "gpt", probe=probe, check_every=20, policy={"patience": 5}, **AT_CADENCE
    )
    settings = callback.monitor.settings
    assert settings.schedule.check_every == 20
    assert settings.rule.patience == 5
    assert settings.rule.threshold == presets.load("gpt").settings.rule.threshold  # merged, not replaced
    assert callback.layer == presets.load("gpt").settings.probe.layer
    replaced = TopoCollapseCallback.from_preset("resnet", probe=probe, policy=Policy(action="stop"), **AT_CADENCE)
    assert replaced.monitor.policy.settings.action == "stop"
    with pytest.raises(ConfigError, match=r"unknown argument `chek_every`; did you mean `check_every`\?"):
        TopoCollapseCallback.from_preset("gpt", probe=probe, chek_every=3, **AT_CADENCE)
    with pytest.raises(ConfigError, match=r"unknown key `policy.patient`; did you mean `policy.patience`\?"):
        TopoCollapseCallback.from_preset("gpt", probe=probe, policy={"patient": 3}, **AT_CADENCE)
    with pytest.raises(ConfigError, match="give a `preset` or a MonitorSettings value as `settings`, not both"):
        TopoCollapseCallback(probe=probe, preset="gpt", settings=MonitorSettings(), **AT_CADENCE)


@pytest.mark.slow
def test_a_built_wheel_ships_the_presets(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=HANG_SECONDS,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = next(tmp_path.glob("topocallbacks-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for preset in ("resnet", "vit", "gpt", "llama"):
        assert f"topocallbacks/configs/{preset}.yaml" in names
    assert "topocallbacks/py.typed" in names
