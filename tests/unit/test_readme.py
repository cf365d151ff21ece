import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
@pytest.mark.slow
def test_every_python_example_of_the_readme_and_the_docs_runs(page, capsys):
    blocks = python_blocks(page)
    for block in blocks:
        exec(compile(block, str(page.relative_to(ROOT)), "exec"), {})
    if blocks and page.name in ("README.md", "index.md"):
        assert "betti" in capsys.readouterr().out


def test_the_readme_is_one_screen_of_introduction_with_an_example_per_framework():
    assert len(README.splitlines()) <= 250
    examples = "\n".join(python_blocks(ROOT / "README.md"))
    assert "TopoCollapseCallback(" in examples
    assert "TopoCollapseTrainerCallback(" in examples
    linked = set(re.findall(r"\]\(docs/(\w+\.md)", README))
    assert linked == {p.name for p in PAGES[1:]}  # every page of the site is linked from the README


def test_readme_first_screen_gives_the_two_commands_and_ci_runs_the_test_one():
    first_screen = "\n".join(README.splitlines()[:25])
    commands = re.findall(r"^(make \w+)", first_screen, flags=re.MULTILINE)
    assert commands == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.MULTILINE)


def test_make_targets_exist():
    result = subprocess.run(["make", "-n", "demo", "test"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
