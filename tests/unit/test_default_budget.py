"""The default overhead budget's pre-registered choice (benchmarks/default_budget.py, benchmarks/DEFAULT_BUDGET.md):
the rule, a smoke run of the script, and the stored results against the shipped default."""

import hashlib
import json
import sys
from pathlib import Path

import pytest

from topocallbacks import MonitorSettings

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import default_budget  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def case(target, ratios):
    return {"target": target, "rows": [{"budget": b, "meets": r <= target} for b, r in ratios.items()]}


def test_the_rule_takes_the_largest_candidate_that_meets_every_target():
    cases = [case(1.5, {0.02: 1.3, 0.05: 1.4, 0.10: 1.6}), case(1.1, {0.02: 1.0, 0.05: 1.05, 0.10: 1.08})]
    choice = default_budget.choose(cases)
    assert (choice["chosen"], choice["all_met"]) == (0.05, True)
    assert choice["targets_met"] == {"0.02": 2, "0.05": 2, "0.1": 1}


def test_without_a_candidate_meeting_every_target_the_rule_takes_the_most_met_then_the_smallest():
    cases = [case(1.5, {0.02: 1.6, 0.05: 1.4, 0.10: 1.4}), case(1.1, {0.02: 1.2, 0.05: 1.2, 0.10: 1.2})]
    assert default_budget.choose(cases) == {"chosen": 0.05, "targets_met": {"0.02": 0, "0.05": 1, "0.1": 1},
                                            "all_met": False}  # fmt: skip


def test_the_held_out_cases_wait_for_stage_2(monkeypatch, tmp_path):
    text = tmp_path / "DEFAULT_BUDGET.md"
    text.write_text("# Pre-registration\n\nStage 1 only.\n")
    monkeypatch.setattr(default_budget, "PREREGISTRATION", text)
    assert not default_budget.shipping_stage_written()
    with pytest.raises(SystemExit):
        default_budget.main(["--split", "held_out", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("default_budget_*"))


def test_a_smoke_run_times_real_fits_and_writes_its_table(tmp_path):
    assert default_budget.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "default_budget_design.json").read_text())
    (mlp,) = payload["cases"]
    assert [row["budget"] for row in mlp["rows"]] == list(default_budget.CANDIDATES)
    for row in mlp["rows"]:
        assert row["checks"] >= 2
        assert row["in_all"] > 0
    assert payload["choice"]["chosen"] in default_budget.CANDIDATES
    assert "| mlp_1ms |" in (tmp_path / "default_budget_design.md").read_text()


def test_the_stored_design_choice_follows_the_rule():
    payload = json.loads((RESULTS / "default_budget_design.json").read_text())
    for case in payload["cases"]:
        for row in case["rows"]:
            assert row["meets"] == (row["wall_ratio"] <= case["target"])
    assert payload["choice"] == default_budget.choose(payload["cases"])


def test_the_stored_stage4_design_choice_follows_the_rule_on_the_same_cases():
    payload = json.loads((RESULTS / "default_budget_stage4_design.json").read_text())
    assert payload["stage"] == 4
    assert [case["case"] for case in payload["cases"]] == [c.name for c in default_budget.CASES if c.split == "design"]
    for case in payload["cases"]:
        assert [row["budget"] for row in case["rows"]] == list(default_budget.CANDIDATES)
        for row in case["rows"]:
            assert row["meets"] == (row["wall_ratio"] <= case["target"])
            assert row["last_plan"]["at_step"] is not None  # one plan, recorded with the step that made it
    assert payload["choice"] == default_budget.choose(payload["cases"])


def test_stage4s_choice_is_the_shipped_default_and_its_held_out_cases_wait_for_the_stage_that_ships_it(
    monkeypatch, tmp_path
):
    chosen = json.loads((RESULTS / "default_budget_stage4_design.json").read_text())["choice"]["chosen"]
    assert MonitorSettings().schedule.overhead_budget == chosen  # stage 6: the default is the rule's choice
    assert default_budget.chosen_is_shipped(4)
    # Shipped, the held-out cases still run only after the stage that records the gates (stage 7).
    before = tmp_path / "DEFAULT_BUDGET.md"
    before.write_text(default_budget.PREREGISTRATION.read_text().split(default_budget.SHIPPED_AT[4])[0])
    monkeypatch.setattr(default_budget, "PREREGISTRATION", before)
    assert not default_budget.shipping_stage_written(4)
    with pytest.raises(SystemExit):
        default_budget.main(["--stage", "4", "--split", "held_out", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("default_budget_*"))
    new_cases = [c.name for c in default_budget.CASES if c.stages == (4,)]
    assert new_cases == ["resnet18_default", "resnet18_every10"]  # held out for stage 4, never run by stage 1
    assert all(c.split == "held_out" for c in default_budget.CASES if c.stages == (4,))


def chosen_settings():
    """The settings the held-out runs measured: the default with the chosen budget (DEFAULT_BUDGET.md, stage 3:
    chosen, measured, not shipped, because a budget's plan makes a run's decisions follow the machine's speed)."""
    chosen = json.loads((RESULTS / "default_budget_design.json").read_text())["choice"]["chosen"]
    return MonitorSettings().merged({"overhead_budget": chosen})


def test_stage1s_withdrawn_choice_is_not_the_shipped_default_and_its_held_out_cases_do_not_run_again(tmp_path):
    assert "## Stage 3" in default_budget.PREREGISTRATION.read_text()
    assert not default_budget.chosen_is_shipped()  # 0.05, withdrawn by stage 3; stage 6 ships stage 4's choice
    with pytest.raises(SystemExit):  # the held-out cases would measure another default than the registered one
        default_budget.main(["--split", "held_out", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("default_budget_*"))


def assert_held_out_rows(payload, stage):
    """A stored held-out split: the stage's held-out cases in order, one row each at the default, `meets` as stored."""
    held_out = [c.name for c in default_budget.CASES if c.split == "held_out" and stage in c.stages]
    assert [case["case"] for case in payload["cases"]] == held_out
    for case in payload["cases"]:
        (row,) = case["rows"]
        assert row["budget"] == "default"
        assert row["meets"] == (row["wall_ratio"] <= case["target"])


def test_the_held_out_fits_measured_the_default_a_user_gets():
    payload = json.loads((RESULTS / "default_budget_held_out.json").read_text())
    assert default_budget.shipping_stage_written()
    measured = chosen_settings()
    # The same object, field for field; `schedule.plan` came later (stage 4) and, None, is left out of the digest, as
    # are the silent path's later fields at the values that keep its behaviour as measured (`as_measured`).
    as_then = default_budget.as_measured(measured)
    assert as_then["schedule"].pop("plan") is None
    assert payload["settings_sha256"] == hashlib.sha256(json.dumps(as_then, sort_keys=True).encode()).hexdigest()
    assert payload["shipped_budget"] == measured.schedule.overhead_budget
    assert_held_out_rows(payload, stage=1)


def test_stage4s_held_out_fits_measured_the_default_a_user_gets():
    payload = json.loads((RESULTS / f"{default_budget.stem(4, 'held_out')}.json").read_text())
    assert (payload["stage"], payload["split"], payload["repeats"]) == (4, "held_out", default_budget.REPEATS)
    assert payload["settings_sha256"] == default_budget.settings_sha()  # `MonitorSettings()`, field for field
    chosen = json.loads((RESULTS / "default_budget_stage4_design.json").read_text())["choice"]["chosen"]
    assert payload["shipped_budget"] == chosen == MonitorSettings().schedule.overhead_budget
    assert_held_out_rows(payload, stage=4)
    assert all(case["rows"][0]["last_plan"]["at_step"] is not None for case in payload["cases"])  # planned, once


def test_the_measured_layout_leaves_out_only_later_fields_at_their_measured_behaviour():
    from topocallbacks.settings import SilentSettings

    default = default_budget.as_measured(MonitorSettings())
    assert "family" not in default["silent"]
    assert (default["silent"]["threshold"], default["silent"]["patience"], default["silent"]["sentinels"]) == (
        12.0, 2, True)  # fmt: skip
    assert SilentSettings().rule == (12.0, 2, True)  # the behaviour is the one measured
    geometry = default_budget.as_measured(MonitorSettings().merged({"silent_family": "geometry"}))
    assert geometry["silent"]["family"] == "geometry"  # another behaviour: kept, so its digest differs
    assert default_budget.settings_sha(MonitorSettings().merged({"silent_family": "geometry"})) != (
        default_budget.settings_sha())  # fmt: skip


def test_step_cost_splits_a_fit_between_the_callbacks_hooks_and_the_rest():
    """The hooks' time is the gap between the clock before the callback and the clock after it, hook by hook."""
    import step_cost

    first, last = step_cost.Clock(), step_cost.Clock()
    first.marks["on_train_start"], last.marks["on_train_start"] = [1.0], [3.5]  # the first check: 2.5 s
    first.marks["on_train_batch_end"], last.marks["on_train_batch_end"] = [10.0, 20.0, 30.0], [10.25, 20.0, 31.0]
    first.marks["teardown"], last.marks["teardown"] = [40.0], [40.5]
    total, per_batch = step_cost.split(first, last)
    assert total == pytest.approx(2.5 + 0.25 + 1.0 + 0.5)
    assert per_batch == pytest.approx([0.25, 0.0, 1.0])


def test_a_step_cost_smoke_run_times_real_fits_and_writes_its_table(tmp_path):
    import step_cost

    assert step_cost.main(["--case", "mlp_1ms", "--steps", "30", "--pairs", "1", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / f"{step_cost.stem('mlp_1ms', 30, 1)}.json").read_text())
    (pair,) = payload["pairs"]
    bare, watched = pair["bare"], pair["default"]
    assert watched["checks"][:3] == [0, 10, 20]  # the case's cadence: every 10 steps
    assert watched["hooks_s"] > 0
    assert "monitor_in_all" not in bare
    for row in (bare, watched):
        assert row["hooks_s"] + row["outside_hooks_s"] == pytest.approx(row["wall_s"], abs=2e-3)
    assert watched["monitor_in_all"] > 0
    assert "| 1 | default |" in (tmp_path / f"{step_cost.stem('mlp_1ms', 30, 1)}.md").read_text()


def test_the_stored_step_cost_tables_are_their_payloads():
    import step_cost
    from pages import STEP_COST_RUNS

    for case, steps, pairs in STEP_COST_RUNS:
        path = RESULTS / step_cost.stem(case, steps, pairs)
        payload = json.loads(path.with_suffix(".json").read_text())
        assert (payload["case"], payload["steps"], len(payload["pairs"])) == (case, steps, pairs)
        assert path.with_suffix(".md").read_text() == step_cost.markdown(payload)
