"""The kit the HTML pages are built with: escaping, number formatting, matplotlib figures, sections, saving.

Generic parts with no knowledge of the monitor: `topocallbacks.report` builds the run report with them, and the
offline analysis (`topocallbacks.analysis.writing`) adds its own sections to that report with them. Figures are
drawn with matplotlib's object API (no pyplot: no global state, no display) and saved as PNG files next to the
page, which refers to them by relative paths.
"""

from __future__ import annotations

import dataclasses
import html
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .exceptions import InputError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "Figures",
    "Section",
    "add_legend",
    "escape_html",
    "figure_html",
    "format_number",
    "new_figure",
    "output_folder",
    "page_html",
    "save_figures",
    "sections_html",
    "series_figure",
]


# --- text ---------------------------------------------------------------------------------------------------------


def escape_html(text: Any) -> str:
    """``str(text)`` with ``&``, ``<``, ``>`` and both quotes escaped for HTML text and attribute values."""
    return html.escape(str(text))


def format_number(value: float | None) -> str:
    """A number for a table or a sentence: three decimals, or three significant digits when very large or small.

    None becomes an en dash; NaN and infinities are written as Python writes them.
    """
    if value is None:
        return "–"
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.3f}"


# --- figures ------------------------------------------------------------------------------------------------------


def new_figure(width: float = 8.0, height: float = 3.6) -> Figure:
    """A matplotlib figure of ``width`` x ``height`` inches with a constrained layout, outside pyplot.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display, Agg when saved
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the report draws its figures with matplotlib: pip install matplotlib") from exc
    return Figure(figsize=(width, height), layout="constrained")


def add_legend(axes: Axes) -> None:
    """A legend beside the plot (never over the curves), when something is labelled; steps as integers."""
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    entries = len(axes.get_legend_handles_labels()[0])
    if entries:
        size = "small" if entries <= 12 else "x-small"
        axes.legend(fontsize=size, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                    ncol=math.ceil(entries / 24))  # fmt: skip


def series_figure(
    title: str,
    ylabel: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    log: bool = False,
) -> Figure:
    """One line per named series ``(steps, values)`` over the steps; ``log``: a symmetric log scale for y."""
    figure = new_figure()
    axes = figure.add_subplot()
    for name, (steps, values) in series.items():
        axes.plot(list(steps), list(values), marker=".", label=name)
    if log:
        axes.set_yscale("symlog", linthresh=1e-3)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    add_legend(axes)
    return figure


@dataclasses.dataclass
class Figures:
    """The figures of a page, in order, by file name, with their captions."""

    items: list[tuple[str, Figure, str]] = dataclasses.field(default_factory=list)

    def add(self, name: str, figure: Figure, caption: str) -> None:
        """Add ``figure``, to be saved as ``name`` (a PNG file name) and shown with ``caption``."""
        self.items.append((name, figure, caption))

    def get(self, name: str) -> Figure:
        """The figure saved as ``name``."""
        return next(figure for file, figure, _ in self.items if file == name)

    def caption(self, name: str) -> str:
        """The caption of the figure saved as ``name``."""
        return next(caption for file, _, caption in self.items if file == name)


def save_figures(figures: Figures, out: Path) -> None:
    """Save every figure into the folder ``out`` as a PNG at 100 dpi, under its file name."""
    for name, figure, _ in figures.items:
        figure.savefig(out / name, dpi=100)


# --- the page -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Section:
    """A part of a page: a heading, its HTML body, and the figures shown after it."""

    heading: str
    body: str
    figures: Figures = dataclasses.field(default_factory=Figures)


def figure_html(name: str, caption: str) -> str:
    """A ``<figure>`` showing the image file ``name`` with ``caption`` (also its alternative text)."""
    image = f"<img src='{escape_html(name)}' alt='{escape_html(caption)}'>"
    return f"<figure>{image}<figcaption>{escape_html(caption)}</figcaption></figure>"


def sections_html(sections: Sequence[Section]) -> list[str]:
    """The HTML of each section: its heading, its body and its figures."""
    parts = []
    for section in sections:
        parts.append(f"<h2>{escape_html(section.heading)}</h2>{section.body}")
        parts.extend(figure_html(name, caption) for name, _, caption in section.figures.items)
    return parts


def page_html(title: str, style: str, parts: Sequence[str]) -> str:
    """A whole HTML document: ``title``, the CSS ``style`` inline, and the body's ``parts`` one per line."""
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{escape_html(title)}</title><style>{style}</style></head><body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )


def output_folder(out_dir: Any) -> Path:
    """``out_dir`` as a folder that exists (created with its parents if needed).

    Raises:
        InputError: ``out_dir`` is not a path, or it is an existing file.
    """
    if not isinstance(out_dir, (str, os.PathLike)):
        raise InputError(f"`out_dir` must be a path, got {type(out_dir).__name__}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"`out_dir` {str(out)!r} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    return out
