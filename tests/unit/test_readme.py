import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_python_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    assert "betti" in capsys.readouterr().out


def test_readme_first_screen_gives_the_two_commands_and_ci_runs_the_test_one():
    first_screen = "\n".join(README.splitlines()[:25])
    commands = re.findall(r"^(make \w+)", first_screen, flags=re.MULTILINE)
    assert commands == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.MULTILINE)


def test_make_targets_exist():
    result = subprocess.run(["make", "-n", "demo", "test"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
