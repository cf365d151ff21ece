"""The rescue suite at the shipped default (``benchmarks/DEFAULT_BUDGET.md``, stage 9): the pages' paragraph and table.

Reads the two-row run (``benchmarks/results/rescue_at_default/rescue.json``: the default rule checking every 10
steps on the whole probe, as every rescue figure was measured, and ``ours_default_planned+rollback``, the same rule
following the plan the shipped default's budget makes for each setting) and the plans
(``benchmarks/results/rescue_plans.json``); what it says follows the rule stage 9 registered before the runs.
"""

from __future__ import annotations

from typing import Any

from outputs import OURS, TARGETS, _rate

from topocallbacks.settings import MonitorSettings

PLANNED = "ours_default_planned+rollback"
#: Where the stored two-row run and the plans are, under benchmarks/results/.
RUN = "rescue_at_default/rescue.json"
PLANS = "rescue_plans.json"


def _count(row: dict[str, Any], fault: str) -> tuple[int, int]:
    saved, runs = row[f"rescued_{fault}_count"].split("/")
    return int(saved), int(runs)


def holds(payload: dict[str, Any]) -> bool:
    """Stage 9's rule: the planned row rescues no fewer faulted runs in all (McNemar's p >= 0.05) and meets the
    suite's healthy targets (mean final-metric change, interventions per 1,000 steps)."""
    planned, every = payload["summary"][PLANNED], payload["summary"][OURS]
    healthy = (planned["healthy_change"] >= TARGETS["healthy_change"]
               and planned["healthy_rate"] <= TARGETS["healthy_rate"])  # fmt: skip
    return planned["rescued"] >= every["rescued"] and payload["paired"][PLANNED]["p"] >= 0.05 and healthy


def first_judged(plan: dict[str, Any], check_every: int, warmup: int) -> int:
    """The step of the first check the rule judges (the one after its ``warmup`` checks) under ``plan``: checks at
    every ``check_every`` steps from step 0 up to the plan's step, then every ``intervals`` of them; a smaller probe
    restarts the warm-up after the plan's check."""
    at, every = plan["at_step"], plan["intervals"] * check_every
    before = at // check_every + 1  # the checks at 0, check_every, ..., at_step
    if plan["probe_size"] is not None:
        return at + (warmup + 1) * every
    if before > warmup:
        return warmup * check_every
    return at + (warmup + 1 - before) * every


def _plans_text(plans: dict[str, Any]) -> str:
    """The plans in words: the cadences, the probe sizes and lags they chose."""
    found = [s["plan"] for s in plans["settings"].values()]
    every = sorted({p["intervals"] for p in found})
    sizes = sorted({p["probe_size"] for p in found if p["probe_size"]})
    lags = sorted({p["lag"] for p in found if p["lag"] is not None})
    missed = [name for name, s in plans["settings"].items() if not s["plan"]["met"]]
    return (
        f"a check every {' or '.join(str(i) for i in every)} intervals of {plans['check_every']} steps"
        + (f" on {' or '.join(str(n) for n in sizes)} probe samples (which restarts the rule's warm-up)" if sizes
           else "")
        + (f", decisions applied {' or '.join(str(n) for n in lags)} steps after their check" if lags else "")
        + (f"; {len(missed)} of {len(found)} settings miss the {100 * plans['budget']:g} % even so" if missed else "")
    )  # fmt: skip


def summary(payload: dict[str, Any], plans: dict[str, Any]) -> str:
    """The paragraph: both rows' rescues and healthy twins, the paired test, and what stage 9's rule says."""
    planned, every = payload["summary"][PLANNED], payload["summary"][OURS]
    pair = payload["paired"][PLANNED]
    faults = " and ".join(f"{_rate(*_count(planned, f))} {f}" for f in ("transient", "structural"))
    before = " and ".join(f"{_rate(*_count(every, f))}" for f in ("transient", "structural"))
    warmup, fault = MonitorSettings().rule.warmup, payload["setup"]["fault"]
    judged = sorted({first_judged(s["plan"], plans["check_every"], warmup) for s in plans["settings"].values()})
    when = "after" if judged[0] > fault else "before" if judged[-1] <= fault else "around"
    text = (
        f"At the shipped default (`overhead_budget={plans['budget']:g}`), the budget plans, for each of the rescue "
        f"suite's settings on the development machine, {_plans_text(plans)}. So the rule judges its first check at "
        f"step {' or '.join(str(step) for step in judged)}, {when} the faults begin (position {fault}; the runs "
        f"end at {payload['setup']['steps']}). Following those plans, the default "
        f"rule rescued {faults} faults, against {before} when the same rule checks every {plans['check_every']} "
        f"steps on the whole probe, as the rescue figures were measured ({pair['default_only']} runs rescued only "
        f"there, {pair['other_only']} only at the plans; McNemar p = {pair['p']:.2g}); it acted on "
        f"{planned['healthy_acted']}/{planned['healthy_runs']} healthy twins (against "
        f"{every['healthy_acted']}/{every['healthy_runs']})."
    )
    if holds(payload):
        return text + " The rescue figures hold at the shipped default on these settings."
    if planned["rescued"] < every["rescued"]:
        return text + (
            " **At the shipped default the rule rescues fewer faulted runs on these settings than the figures "
            "measured with the budget off show; those figures are `overhead_budget=None`'s** (stage 9 of "
            "`benchmarks/DEFAULT_BUDGET.md`)."
        )
    why = "rescues more (the figures understate it)" if pair["p"] < 0.05 else "misses the suite's healthy targets"
    return text + f" By stage 9's rule the rescue figures do not hold at the shipped default: there the rule {why}."


def rows_table(payload: dict[str, Any], plans: dict[str, Any]) -> list[str]:
    """Per setting: the plan, and the faulted runs rescued by the rule at every check and at the plan."""
    planned, every = payload["summary"][PLANNED], payload["summary"][OURS]
    lines = [
        "| setting | plan (every, probe, lag; predicted share) | rescued, every 10 steps (T / S) | rescued, at the "
        "plan (T / S) |",
        "|---|---|---|---|",
    ]
    for name, found in plans["settings"].items():
        p, n = found["plan"], found["costs"]["n"]
        shown = f"{p['intervals']} x {plans['check_every']} steps, {p['probe_size'] or n}, {p['lag']}; "
        shown += f"{100 * p['predicted']:.1f} %" + ("" if p["met"] else " (missed)")
        here, there = every["settings"][name], planned["settings"][name]
        lines.append(
            f"| {name} | {shown} | {here['transient']} / {here['structural']} | "
            f"{there['transient']} / {there['structural']} |"
        )
    return lines
