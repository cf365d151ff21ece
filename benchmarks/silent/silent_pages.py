"""The silent suite's results page, rendered from the stored JSON of one split (``silent_evaluate.py``).

The same text is ``benchmarks/results/silent_<split>.md`` and, for the design split, the ``silent-design`` block of
``docs/evidence.md`` (``benchmarks/pages.py``); it computes nothing, it only formats what the evaluation stored.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

#: How the tables name the scenarios, in the pre-registration's order.
SHORT = {
    "simsiam_no_stopgrad": "S1 SimSiam",
    "contrastive_no_negatives": "S2a contrastive",
    "minilm_pairs_no_negatives": "S2b MiniLM pairs",
    "watermark_shortcut": "S3 watermark",
    "generator_modes_grid": "S4a grid",
    "generator_modes_circle": "S4b circle",
    "vae_kl_bug": "S5 VAE",
    "minilm_forgetting": "S6 MiniLM forgetting",
    "classes_dropped": "S7 classes dropped",
    "finetune_forgetting_images": "S8 image fine-tune",
    "digits_class_dropped": "S9 digits class dropped",
    "labels_merged": "S10 labels merged",
    "simclr_negatives_fade": "D1 SimCLR negatives fade",
    "simsiam_stopgrad_fade": "D2 SimSiam stop-gradient fade",
    "vicreg_variance_fade": "H1 VICReg variance fade",
    "simsiam_predictor_fade": "H2 SimSiam predictor fade",
    "barlow_redundancy_fade": "H3 Barlow Twins redundancy fade",
    "simclr_views_identical": "H4 SimCLR views identical",
    "supcon_labels_shuffled": "H5 SupCon labels shuffled",
    "supcon_watermark": "H6 SupCon watermark",
    "simclr_narrow_finetune": "H7 SimCLR narrow fine-tune",
    "trap_simclr_full_finetune": "T8 SimCLR full fine-tune",
}


def _short(name: str) -> str:
    """A scenario's class label alone (``S4a``)."""
    return SHORT.get(name, name).split(" ", 1)[0]


def _rate(successes: int, n: int, low: float, high: float) -> str:
    if not n:
        return "-"
    return f"{successes}/{n} ({100 * low:.0f}-{100 * high:.0f} %)"


def _candidate(row: dict[str, Any]) -> str:
    c = row["candidate"]
    if c.get("combination") == "default":
        return "`MonitorSettings()`"
    if c.get("combination") == "loss_rule":
        return "`Policy` on the loss alone, its defaults"
    if "score" not in c:
        return str(c.get("combination", "-"))
    return f"{c['combination']}, {c['score']}, k {c['k']:g}, p {c['p']}"


def _seeds(row: dict[str, Any]) -> str:
    return ", ".join(f"{_short(name)} {n}" for name, n in row["seeds_caught"].items())


def _lead(row: dict[str, Any]) -> str:
    lead = row["median_lead"]
    return "-" if lead is None or (isinstance(lead, float) and math.isnan(lead)) else f"{lead:.0f}"


def _row(name: str, row: dict[str, Any] | None) -> str:
    if row is None:
        return f"| {name} | none | - | - | - | - |"
    catch = _rate(row["runs_caught"], row["runs"], *row["catch_interval"])
    healthy = _rate(row["healthy_alarmed"], row["healthy_runs"], *row["healthy_interval"])
    return f"| {name} | {_candidate(row)} | {_seeds(row)} | {catch} | {_lead(row)} | {healthy} |"


HEADER = (
    "| signal | candidate | seeds caught (of 6) | faulted runs caught (95 % Wilson) | median lead (steps) "
    "| healthy runs alarmed (95 % Wilson) |\n|---|---|---|---|---|---|"
)


def silence_table(payload: dict[str, Any]) -> str:
    """The silence check re-run on the evaluation seeds, per scenario."""
    lines = [
        "| scenario | seeds passing (of 6) | 5 % point reached | loss-only rule quiet until it | checks between the "
        "fault and the 5 % point (median; range) | passes |",
        "|---|---|---|---|---|---|",
    ]
    for name, found in payload["silence"].items():
        seeds = found["per_seed"]
        reached = sum(s["reached"] for s in seeds)
        quiet = sum(s["quiet"] and s["reached"] for s in seeds)
        verdict = "yes" if found["passes"] else "**no**"
        room = sorted(s["checks_before_harm"] for s in seeds if s.get("checks_before_harm") is not None)
        window = f"{statistics.median(room):g}; {room[0]}-{room[-1]}" if room else "-"
        lines.append(f"| {SHORT.get(name, name)} | {found['passed']} | {reached} | {quiet} | {window} | {verdict} |")
    return "\n".join(lines)


def choice(payload: dict[str, Any]) -> str:
    """The pre-registered choice's outcome, in a sentence (on the held-out split: that nothing is chosen there)."""
    healthy = payload["loss_rule"]["healthy_runs"]
    if payload["split"] != "design":
        return (
            "**Nothing is chosen on this split.** The choice is made on the design split only, and there stage 2 "
            "chose nothing, so the held-out split tests no chosen silent path: the rows below describe each family "
            f"and anchor at the same healthy budget on these {healthy} healthy runs (a description, not a choice)."
        )
    candidates = len(payload["results"])
    if payload["chosen"] is None:
        return (
            f"**No candidate was eligible.** Of the {candidates} pre-registered candidates, none that alarmed on "
            f"none of the {healthy} healthy runs (the design split's twins and trap) caught any design class on 5 "
            "of its 6 seeds, so by the pre-registered rule the default gains **no silent path**."
        )
    chosen = payload["chosen"]
    return (
        f"Chosen: {chosen['combination']}, score {chosen['score']}, k {chosen['k']:g}, p {chosen['p']}: "
        f"{chosen['classes_caught']} design classes caught, no healthy run alarmed of {healthy}."
    )


def page(payload: dict[str, Any]) -> str:
    """The whole results text of one split."""
    split = payload["split"]
    loss = payload["loss_rule"]
    lines = [
        f"Split: **{split}** (classes {', '.join(payload['classes'])}; trap {', '.join(payload['traps'])}); "
        f"evaluation seeds 0-5; evaluated at commit `{payload['commit'][:12]}`.",
        "",
        "The silence check, re-run on the evaluation seeds' recordings (a scenario passes when the loss-only rule "
        "stays quiet from the fault until the 5 % point and the point comes, on at least 5 of 6 seeds):",
        "",
        silence_table(payload),
        "",
        choice(payload),
        "",
        "Each family's and anchor's best candidate at the pre-registered healthy budget (no healthy run alarmed), "
        "then, on a second line, its candidate that catches a class while alarming on the fewest healthy runs "
        "(not a choice: the price of catching). A run is caught when the first alarm after the fault comes strictly "
        "before the 5 % point.",
        "",
        HEADER,
    ]
    for title, group in (("family", payload["families"]), ("anchor", payload["anchors"])):
        for name, row in group.items():
            lines.append(_row(f"{name} ({title})", row["at_zero"]))
            lines.append(_row(f"{name}, cheapest catch", row["cheapest_catch"]))
    lines += [
        "",
        "The library's default as shipped (`MonitorSettings()`, replayed open-loop on the recorded features and "
        "training channels: a run counts as caught at its first action, and a healthy run as touched by any action, "
        "warm-up included) and the loss-only rule (the silence check's rule, at the library's defaults):",
        "",
        HEADER,
        _row("the default", payload.get("default")),
        _row("loss-only rule", loss),
    ]
    return "\n".join(lines) + "\n"


def classes_caught(row: dict[str, Any] | None) -> set[str]:
    """The classes a row catches, as `silent_evaluate.judge` decided them (every variant of the class on at least 5
    of its 6 seeds)."""
    return set() if row is None else {c for c, caught in row["by_class"].items() if caught}


def targets(design: dict[str, Any], held_out: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """PREREGISTERED.md's targets ("Evaluation and targets"), held-out split first: (target, what was found, met;
    None where the target does not apply)."""
    held_caught = classes_caught(held_out["default"])
    suite_caught = classes_caught(design["default"]) | held_caught
    touched = design["default"]["healthy_alarmed"] + held_out["default"]["healthy_alarmed"]
    healthy = design["default"]["healthy_runs"] + held_out["default"]["healthy_runs"]
    loss_caught = classes_caught(design["loss_rule"]) | classes_caught(held_out["loss_rule"])
    two_sided = set()
    for payload in (design, held_out):
        two_sided |= classes_caught(payload["anchors"]["loss_two_sided"]["at_zero"])
    named = ", ".join(sorted(held_caught)) or "neither"
    return [
        ("the default catches both held-out classes (S2, S6)", f"{named} caught", {"S2", "S6"} <= held_caught),
        ("the default catches >= 5 of the 6 classes (whole suite)", f"{len(suite_caught)} of 6",
         len(suite_caught) >= 5),
        ("<= 1 healthy run touched, over >= 48", f"{touched} of {healthy}", touched <= 1 and healthy >= 48),
        ("the loss alone catches <= 1 class", f"{len(loss_caught)} (the two-sided loss anchor: {len(two_sided)})",
         len(loss_caught) <= 1),
        ("a class where only the topological signal fires", "none: no silent path was chosen, so there are no "
         "chosen settings to compare at", False),
        ("the rescue suite with the new default", "not run: the default did not change (stage 2 chose nothing), "
         "so the rescue suite's held-out figures stand", None),
    ]  # fmt: skip


def targets_table(design: dict[str, Any], held_out: dict[str, Any]) -> str:
    """The targets as a table."""
    lines = ["| target (PREREGISTERED.md) | found | met |", "|---|---|---|"]
    verdict = {True: "yes", False: "**no**", None: "does not apply"}
    lines += [f"| {what} | {found} | {verdict[met]} |" for what, found, met in targets(design, held_out)]
    return "\n".join(lines)


# --- round 2 (ROUND2.md; round2.py's results) ------------------------------------------------------------------


def round4_status(design: dict[str, Any], held_out: dict[str, Any], r2_held_out: dict[str, Any]) -> str:
    """The README's lead after round 4: what its design choice caught held out (the loss-only rule beside it), the
    registered verdict and what the default does, which signal fired, and the earlier rounds in a clause."""
    chosen, caught, targets = design["chosen"], held_out["design_choice"], held_out["targets"]
    seeds = caught["seeds_caught"]
    won = [name for name in held_out["admitted"] if seeds.get(name, 0) >= 5]
    lost = [name for name in held_out["admitted"] if seeds.get(name, 0) < 5]
    first = {signal for counts in held_out["first_signals"].values() for signal, n in counts.items() if n}
    loss, r2 = held_out["loss_rule"], r2_held_out["default"]
    verdict = (f"is missed ({', '.join(_short(n) for n in lost)} not caught on 5 of 6 seeds)" if lost
               else "is met")  # fmt: skip
    others = all(targets[k] for k in ("healthy_held_out_met", "healthy_both_met", "loss_met"))
    return (
        "**Silent collapse, what the loss does not show: the first fault class caught on runs never seen while "
        "choosing; the default still ships without a silent path.** Round 4 (pre-registered) watches embedding "
        "models whose harm is the pair accuracy, at the operating threshold, of the very embedding the monitor "
        f"watches. On its design split it chose the absolute-scale geometry family (`{chosen['combination']}`, "
        f"score {chosen['score']}, k {chosen['k']:g}, p {chosen['p']}: {chosen['runs_caught']}/{chosen['runs']} "
        f"design faulted runs caught before their harm, no alarm on {chosen['healthy_runs']} healthy runs). On the "
        f"held-out split, recorded after that choice, it caught {' and '.join(SHORT[n] for n in won) or 'nothing'} "
        f"on {' and '.join(f'{seeds[n]} of 6' for n in won) or '-'} seeds before the harm and "
        f"{' and '.join(SHORT[n] for n in lost) or 'nothing else'} on "
        f"{' and '.join(f'{seeds.get(n, 0)} of 6' for n in lost) or '-'} ({caught['runs_caught_silently']} of its "
        f"{caught['runs_caught']} catches before any loss-only warning; median lead {caught['median_lead']:.0f} "
        f"steps), alarming on {caught['healthy_alarmed']} of {caught['healthy_runs']} healthy runs; the loss-only "
        f"rule caught {loss['runs_caught']}/{loss['runs']}. The registered target of every admitted held-out class "
        f"{verdict}; the others ({targets['healthy_held_out']}/18 and {targets['healthy_both']}/"
        f"{targets['healthy_both_runs']} healthy alarms, the loss alone catching <= 1 class) are "
        f"{'met' if others else 'not all met'}. By the ship rule `silent_path` stays off by default. What fired "
        f"first: {', '.join(f'`{s}`' for s in sorted(first))}, never the topological mode counter. Earlier rounds "
        f"(classifiers, generators, a VAE) held up nowhere held out: round 2's path caught {r2['runs_caught']}/"
        f"{r2['runs']} of its held-out faulted runs, round 3 chose nothing."
    )


def _caught(row: dict[str, Any], names: list[str]) -> str:
    """``H4 ... on 6 of 6 seeds, H5 ... on 2 of 6`` for ``names`` (None: ``nothing``)."""
    seeds = row["seeds_caught"]
    return ", ".join(f"{SHORT[n]} on {seeds.get(n, 0)} of 6" for n in names) or "nothing"


def _why_not_admitted(admission: dict[str, Any]) -> str:
    """Why a scenario was not admitted, from its seeds' silence checks (no 5 % point; the loss-only rule first)."""
    seeds = admission["seeds"]
    none = sum(c["five_percent_point"] is None for c in seeds)
    loud = sum(c["five_percent_point"] is not None and not c["quiet"] for c in seeds)
    parts = [
        f"no 5 % point on {none} of 6 seeds" if none else "",
        f"the loss-only rule first on {loud}" if loud else "",
    ]
    return ", ".join(part for part in parts if part) or "too little room"


def round6_status(design: dict[str, Any], held_out: dict[str, Any], r5_held_out: dict[str, Any],
                  r2_held_out: dict[str, Any]) -> str:  # fmt: skip
    """The README's lead after round 6 (`embedding_round_status`, round 5's choice judged on its held-out split, and
    what the new neighbours family did on the design split)."""
    neighbours = design["at_zero"].get("neighbours") or {"scenarios_caught": []}
    found = ", ".join(_short(n) for n in neighbours["scenarios_caught"]) or "nothing"
    keys = ("combination", "score", "k", "p")
    same = all(design["chosen"][key] == held_out["previous_choice"][key] for key in keys)
    extra = ((" It is round 5's rule again." if same else "") + " A new family that measures how the probe's "
             f"neighbourhoods change caught {found} there at no healthy alarm.")  # fmt: skip
    return embedding_round_status(6, "all of rounds 4 and 5's runs", extra, design, held_out, "previous_choice",
                                  r5_held_out, r2_held_out)  # fmt: skip


def embedding_round_status(number: int, chosen_on: str, extra: str, design: dict[str, Any], held_out: dict[str, Any],
                           earlier_key: str, earlier_held_out: dict[str, Any],
                           r2_held_out: dict[str, Any]) -> str:  # fmt: skip
    """The README's lead after an embedding round (``number``, chosen on ``chosen_on``; ``extra``: a sentence after
    the choice): its choice, what it caught on held-out kinds of failure (admission first, the loss-only rule
    beside it), the earlier round's choice there (``held_out[earlier_key]``), the registered verdict and what the
    default does, which signal fired, the earlier round's held-out split and the rounds before them in a clause."""
    chosen, caught, targets = design["chosen"], held_out["design_choice"], held_out["targets"]
    admitted = held_out["admitted"]
    left = [n for n in held_out["admission"] if n not in admitted]
    won = [n for n in admitted if caught["seeds_caught"].get(n, 0) >= 5]
    lost = [n for n in admitted if n not in won]
    first = {signal for counts in held_out.get("first_signals", {}).values() for signal, n in counts.items() if n}
    loss, earlier = held_out["loss_rule"], held_out[earlier_key]
    earlier_choice = earlier_held_out["design_choice"]
    r2 = r2_held_out["default"]
    verdict = (f"is missed ({', '.join(_short(n) for n in lost)} not caught on 5 of 6 seeds)" if lost
               else "is met" if admitted else "cannot be met (no held-out class admitted)")  # fmt: skip
    others = all(targets[k] for k in ("healthy_held_out_met", "healthy_both_met", "loss_met"))
    topological = (
        "the topological mode counter among them" if "modes" in first else "never the topological mode counter"
    )
    not_admitted = "; ".join(f"{SHORT[n]} was not admitted ({_why_not_admitted(held_out['admission'][n])})"
                             for n in left)  # fmt: skip
    lead = "a held-out class caught" if won else "no new held-out class caught"
    anchor = held_out["at_zero"].get("loss") or {"seeds_caught": {}}
    by_loss = [n for n in won if anchor["seeds_caught"].get(n, 0) >= 5]
    loss_too = (f" The loss scored against its own warm-up (at its setting with no alarm on this split, so chosen on "
                f"it: descriptive) also catches {', '.join(_short(n) for n in by_loss)}: the loss moves there, the "
                "loss-only rule does not flag it." if by_loss else "")  # fmt: skip
    rounds = "Rounds 4 and 5" if number == 5 else f"Rounds 4 to {number}"
    return (
        f"**Silent collapse, what the loss does not show: {lead} in round {number}; the default still ships without "
        f"a silent path.** {rounds} (pre-registered) watch embedding models whose harm is the pair accuracy, at "
        f"the operating threshold, of the very embedding the monitor watches. Round {number} chose on {chosen_on} "
        f"({len(design['admitted'])} fault classes, {chosen['healthy_runs']} healthy runs) the absolute-scale "
        f"geometry family (`{chosen['combination']}`, score {chosen['score']}, k {chosen['k']:g}, p {chosen['p']}: "
        f"{chosen['runs_caught']}/{chosen['runs']} design faulted runs caught before their harm, none of the healthy "
        f"runs alarmed).{extra} Its held-out split, recorded after that choice, holds kinds of failure the design "
        f"split lacks{': ' + not_admitted if not_admitted else ''}. On the admitted held-out classes it caught "
        f"{_caught(caught, admitted)} seeds before the harm ({caught['runs_caught_silently']} of its "
        f"{caught['runs_caught']} catches before any loss-only warning), alarming on {caught['healthy_alarmed']} of "
        f"{caught['healthy_runs']} healthy runs; the loss-only rule caught {loss['runs_caught']}/{loss['runs']}. "
        f"Round {number - 1}'s choice there: {_caught(earlier, admitted)}, {earlier['healthy_alarmed']} of "
        f"{earlier['healthy_runs']} healthy runs alarmed.{loss_too} The registered target of every admitted held-out "
        f"class {verdict}; the others ({targets['healthy_held_out']}/{caught['healthy_runs']} and "
        f"{targets['healthy_both']}/{targets['healthy_both_runs']} healthy alarms, the loss alone catching <= 1 "
        f"class) are {'met' if others else 'not all met'}. By the ship rule `silent_path` stays off by default; the "
        'library offers the family as an opt-in (`silent_family="geometry"`, reproducing the replay check by '
        "check). What fired "
        f"first: {', '.join(f'`{s}`' for s in sorted(first)) or 'nothing'}, {topological}. "
        f"Round {number - 1}'s held-out split: its choice caught "
        f"{_caught(earlier_choice, earlier_held_out['admitted'])}. Earlier rounds "
        f"(classifiers, generators, a VAE) held up nowhere held out: round 2's path caught "
        f"{r2['runs_caught']}/{r2['runs']} of its held-out faulted runs, round 3 chose nothing."
    )
