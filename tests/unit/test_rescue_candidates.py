"""The pre-registered choice among the rescue rule's candidates (benchmarks/rescue/candidates.py)."""

from tests.benchmarks import benchmark_module

candidates = benchmark_module("candidates", "rescue")


def row(rescued, change=0.0, rate=0.0):
    return {"rescued": rescued, "healthy_change": change, "healthy_rate": rate}


def test_there_are_sixteen_candidates_and_today_is_among_them(candidates):
    assert len(candidates.CANDIDATES) == 16
    assert candidates.TODAY in candidates.CANDIDATES
    assert candidates.CANDIDATES[candidates.TODAY].policy == {}
    assert candidates.changes("cand_a1_b3_c1+rollback") == 3
    assert candidates.changes(candidates.TODAY) == 0


def test_a_candidate_replaces_today_only_with_strictly_more_design_rescues_within_the_healthy_criteria(candidates):
    today = candidates.TODAY
    rows = {today: row(10), "cand_a1_b1_c0+rollback": row(10), "cand_a0_b3_c0+rollback": row(14, change=-0.01)}
    choice = candidates.choose(rows)
    assert choice["chosen"] == today  # the 14 breaks the healthy criteria; the 10 only ties
    rows["cand_a0_b4_c1+rollback"] = row(12, rate=0.5)
    rows["cand_a0_b2_c0+rollback"] = row(12, rate=0.5)
    choice = candidates.choose(rows)
    assert choice["chosen"] == "cand_a0_b2_c0+rollback"  # tied at 12 and 0.5: fewer changes from today's rule
    assert "strictly more" in choice["why"]
    rows["cand_a1_b4_c1+rollback"] = row(12, rate=0.1)
    assert candidates.choose(rows)["chosen"] == "cand_a1_b4_c1+rollback"  # fewer healthy interventions first


def test_no_eligible_candidate_keeps_today(candidates):
    rows = {candidates.TODAY: row(3, rate=2.0), "cand_a1_b1_c1+rollback": row(9, change=-0.2)}
    choice = candidates.choose(rows)
    assert (choice["chosen"], choice["best"]) == (candidates.TODAY, None)
    assert "no candidate meets" in choice["why"]
