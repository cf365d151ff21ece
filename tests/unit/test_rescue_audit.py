"""The rescue audit (benchmarks/rescue/audit.py): the stored audit is what the stored results give, and adds up."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

SUITE = Path(__file__).parents[2] / "benchmarks" / "rescue"
RESULTS = SUITE.parent / "results"


audit = benchmark_module("audit", "rescue")


@pytest.fixture(scope="module")
def data():
    return json.loads((RESULTS / "rescue.json").read_text())


@pytest.fixture(scope="module")
def result(audit, data):
    first = json.loads((RESULTS / "rescue_plain_replay_v1.json").read_text())
    return json.loads(json.dumps(audit.audit(data, first)))  # as stored: tuples become lists


def test_the_stored_audit_is_recomputed_from_the_stored_results(audit, result):
    assert result == json.loads((RESULTS / "rescue_audit.json").read_text())
    assert audit.markdown(result) == (RESULTS / "rescue_audit.md").read_text()


def test_the_design_runs_are_nine_pairs_of_the_grid(audit, data):
    assert len(audit.DESIGN) == 9
    grid = {(s, seed) for s, spec in data["settings"].items() for seed in spec["seeds"]}
    assert audit.DESIGN.issubset(grid)
    assert not {s for s, _ in audit.DESIGN} & set(audit.ADDED)


def test_counts_add_up_to_the_grid_per_row_and_fault(audit, data, result):
    for arm in audit.ROLES.values():
        here = result["rescues"][arm]
        for fault in ("transient", "structural"):
            stored = data["summary"][arm][f"rescued_{fault}_count"]
            assert f"{here['all'][fault]['rescued']}/{here['all'][fault]['runs']}" == stored
            assert here["all"][fault]["runs"] == 32
            per_setting = [result["per_setting"][arm][s][fault].split("/") for s in data["architectures"]]
            assert [sum(int(p[i]) for p in per_setting) for i in (0, 1)] == [
                here["all"][fault]["rescued"],
                here["all"][fault]["runs"],
            ]
        for split in audit.SPLITS:
            both = here[split]["faulted"]
            parts = [here[split][f] for f in ("transient", "structural")]
            assert both["rescued"] == sum(p["rescued"] for p in parts)
            assert both["runs"] == sum(p["runs"] for p in parts)


def test_design_and_held_out_make_all_and_the_added_settings_are_held_out(audit, result):
    for arm in audit.ROLES.values():
        for fault in audit.FAULTS:
            cells = {split: result["rescues"][arm][split][fault] for split in audit.SPLITS}
            for what in ("rescued", "runs"):
                assert cells["design"][what] + cells["held_out"][what] == cells["all"][what]
                assert cells["added_settings"][what] <= cells["held_out"][what]
            assert cells["design"]["runs"] == (9 if fault != "faulted" else 18)


def test_intervals_contain_the_rate_and_wilson_is_the_suites(audit, result):
    for arm in audit.ROLES.values():
        for split in audit.SPLITS:
            for fault in audit.FAULTS:
                cell = result["rescues"][arm][split][fault]
                assert cell["bootstrap"][0] <= cell["rate"] <= cell["bootstrap"][1]
                assert cell["wilson"][0] <= cell["rate"] <= cell["wilson"][1]
                low, high = audit.wilson(cell["rescued"], cell["runs"])
                assert cell["wilson"] == [round(low, 6), round(high, 6)]


def test_the_recomputed_choice_is_the_stored_one(result, data):
    assert result["choice"]["all"]["key"] == data["default"]["key"] == result["choice"]["stored"]


def test_the_cluster_bootstrap_resamples_settings_then_seeds(audit):
    ones = [(np.ones(3, dtype=int), np.ones(3, dtype=int)), (np.ones(2, dtype=int), np.ones(2, dtype=int))]
    assert audit.cluster_bootstrap(ones, resamples=200) == (1.0, 1.0)
    # One setting always rescued, one never: a resample with only one of them gives 0 or 1.
    mixed = [(np.ones(4, dtype=int), np.ones(4, dtype=int)), (np.zeros(4, dtype=int), np.ones(4, dtype=int))]
    assert audit.cluster_bootstrap(mixed, resamples=2000) == (0.0, 1.0)
    # Seeds within one setting: a single setting's interval is the seeds' bootstrap, and the same seed gives the same.
    one = [(np.array([1, 0, 1, 0, 1, 0, 1, 0]), np.ones(8, dtype=int))]
    low, high = audit.cluster_bootstrap(one, resamples=2000)
    assert 0.0 < low < 0.5 < high < 1.0
    assert audit.cluster_bootstrap(one, resamples=2000) == (low, high)


def test_the_evidence_pages_account_says_what_the_stored_results_give(audit, result):
    # The page holds this text (benchmarks/pages.py's rescue-choice block, tests/unit/test_pages.py).
    block = audit.evidence(result)
    ours = result["rescues"][audit.OURS]
    for cell in (ours["held_out"]["faulted"], ours["design"]["faulted"], ours["added_settings"]["faulted"]):
        assert f"{cell['rescued']}/{cell['runs']}" in block


def test_plain_replay_first_version_is_the_superseded_row(result, data):
    v1 = result["plain_replay_v1"]
    assert v1["transient"]["runs"] == v1["structural"]["runs"] == 32
    now = data["summary"]["plain_replay+rollback"]
    assert f"{v1['structural']['rescued']}/32" != now["rescued_structural_count"]  # the row changed
    paired = v1["paired"]
    assert (
        paired["both"] + paired["default_only"]
        == result["rescues"]["ours_default+rollback"]["all"]["faulted"]["rescued"]
    )


def test_the_readme_status_says_what_the_stored_results_give(audit, result):
    # The README holds this text (benchmarks/pages.py's rescue-status block, tests/unit/test_pages.py).
    block = audit.readme(result)
    held = result["rescues"][audit.OURS]["held_out"]["faulted"]
    flat = " ".join(line.removeprefix("> ") for line in block.strip().splitlines())
    assert f"outside them it rescues {held['rescued']}/{held['runs']}" in flat
    met, missed = flat.split("Targets met, as the suite judges them: ")[1].split("**Not met**: ")
    for target in result["targets"]:  # each target on the side the stored verdict puts it
        text = target["target"].replace(" (the control for luck)", " as redefined")
        assert text in (met if target["met"] else missed), text


def test_comparisons_are_computed_not_written(audit):
    cell = {"rescued": 9, "runs": 46}
    assert audit._against(cell, {"rescued": 9}) == "as many as"
    assert audit._against(cell, {"rescued": 11}) == "fewer than"
    assert audit._against(cell, {"rescued": 4}) == "more than"
