"""Regenerate the README's pictures from the current code (``make figures``).

* ``docs/images/report_index.png``: the report's first figure for the Lightning example of ``docs/lightning.md``, run
  as the page gives it (its code block is read from there), with ``callback.report(...)`` added after ``fit``;
* ``docs/images/rescue.png``: the picture of ``topocallbacks demo`` (seed 0).

Both are made in a temporary folder (the example writes ``runs/``), and only the two pictures are copied here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"


def lightning_example(page: Path = ROOT / "docs" / "lightning.md") -> str:
    """The first code block of the documentation's Lightning page (the example the README shortens)."""
    text = page.read_text(encoding="utf-8")
    match = re.search(r"```python\n(.*?)```", text, flags=re.DOTALL)
    if match is None:
        raise SystemExit(f"{page.name}: no ```python block")
    return match.group(1)


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """Run the body in ``path``, then go back."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def report_figure(work: Path) -> Path:
    """Run the README's Lightning example in ``work`` and copy its report's index figure into docs/images."""
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    with working_directory(work):
        exec(compile(lightning_example(), "docs/lightning.md", "exec"), namespace)
        callback = namespace["callback"]
        index = callback.report(work / "runs" / "report")
    target = IMAGES / "report_index.png"
    shutil.copyfile(Path(index).parent / "index.png", target)
    return target


def demo_figure(work: Path) -> tuple[Path, int]:
    """Run ``topocallbacks demo`` into ``work`` and copy its picture into docs/images; its exit status too."""
    from topocallbacks.demo import run

    status = run(work / "demo")
    target = IMAGES / "rescue.png"
    shutil.copyfile(work / "demo" / "rescue.png", target)
    return target, status


def main() -> int:
    """Write both pictures; 1 if the demo did not tell its usual story (the picture is still written)."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="topocallbacks-figures-") as folder:
        work = Path(folder)
        report = report_figure(work)
        demo, status = demo_figure(work)
    print(f"\nREADME figures:\n  {report.relative_to(ROOT)}\n  {demo.relative_to(ROOT)}")
    if status != 0:
        print("the demo did not end as usual (see above): check the picture before committing it", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
