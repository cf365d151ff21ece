"""One PNG per scenario: standard metric, the default index and its components, both warnings, the fault onset."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from signals import SIGNALS

COMPONENTS = {
    "paper_ci": ("betti_term", "entropy_term", "anisotropy"),
    "diagram_drift": ("h0_drift", "h1_drift"),
}


def _scaled(values: np.ndarray, warmup: int) -> np.ndarray:
    """Min-max scaled over the checks after the warm-up (earlier checks may fall outside [0, 1])."""
    finite = values[warmup:][np.isfinite(values[warmup:])]
    if finite.size == 0:
        return values
    low, high = float(finite.min()), float(finite.max())
    return (values - low) / (high - low) if high > low else values * 0.0


def plot_scenarios(
    runs: list[Any],
    index: str,
    best: str,
    outcomes: dict[str, dict[tuple[str, str, int], Any]],
    directory: Path,
    standard_warning: Callable[[Any], int | None],
    warmup: int,
) -> None:
    """Seed 0 (or the lowest seed) of each scenario: collapse run on the left, healthy twin on the right.

    Top: the standard metric. Bottom: the default index (bold), its components, and the best candidate; dashed
    lines mark the standard-metric warning (red), the default index's (green) and the best candidate's (blue).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    lines = [(index, 2.2, 1.0), *((c, 0.9, 0.7) for c in COMPONENTS.get(index, ()))]
    lines += [(part, 1.6, 1.0) for part in (SIGNALS[best].parts or (best,))]
    for scenario in sorted({r.scenario for r in runs}):
        seed = min(r.seed for r in runs if r.scenario == scenario)
        fig, axes = plt.subplots(2, 2, figsize=(12, 6.5), sharex=True)
        for column, kind in enumerate(("collapse", "healthy")):
            run = next(r for r in runs if r.scenario == scenario and r.seed == seed and r.kind == kind)
            top, bottom = axes[0, column], axes[1, column]
            top.plot(run.steps, run.metric, color="black", label="standard metric")
            top.set_ylabel("standard metric")
            top.set_title(f"{scenario}, seed {seed}: {kind}")
            for name, width, alpha in lines:
                label = f"{name} (default)" if name == index else name
                bottom.plot(run.steps, _scaled(run.signals[name], warmup), linewidth=width, alpha=alpha, label=label)
            bottom.set_ylabel("min-max scaled after warm-up")
            bottom.set_ylim(-0.1, 1.3)
            bottom.set_xlabel("step")
            for ax in (top, bottom):
                ax.axvline(run.fault_step, color="grey", linestyle=":", label="fault onset")
                if kind == "collapse":
                    standard = standard_warning(run)
                    if standard is not None:
                        ax.axvline(standard, color="tab:red", linestyle="--", label="standard-metric warning")
                    for name, color in ((index, "tab:green"), (best, "tab:blue")):
                        warning = outcomes[name][(scenario, kind, seed)].warning_step
                        if warning is not None:
                            ax.axvline(warning, color=color, linestyle="--", label=f"{name} warning")
            flags = outcomes[index][(scenario, kind, seed)]
            text = f"{index} flagged checks: {flags.flagged_checks}/{flags.checks}"
            bottom.text(0.01, 0.02, text, transform=bottom.transAxes)
        axes[0, 0].legend(fontsize=7, loc="lower left")
        axes[1, 0].legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(directory / f"{scenario}.png", dpi=80)
        plt.close(fig)
