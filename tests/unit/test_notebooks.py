import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def run_notebook(path: Path) -> dict:
    """Every code cell in order, in one namespace (as a kernel would); returns the namespace."""
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    code_cells = [c for c in cells if c["cell_type"] == "code"]
    assert code_cells
    for cell in code_cells:
        exec(compile("".join(cell["source"]), f"{path.name}:{cell['id']}", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_cells_run_in_order(path, capsys):
    namespace = run_notebook(path)
    assert "CI" in capsys.readouterr().out
    if path.name == "plain_loop_layers.ipynb":  # one monitor, two layers, one probe pass per check
        monitor = namespace["monitor"]
        checks = [r for r in monitor.history if r.kind == "check"]
        steps = sorted({r.step for r in checks})
        assert steps == list(range(0, 241, 20))
        assert [r.layer for r in checks] == ["1", "3"] * len(steps)  # the primary layer's record last
        cuts = [r for r in monitor.history if r.kind == "intervention"]
        assert cuts
        assert cuts[0].action == "lower_lr"
        # The fault at 150: the index jumps at the check of 160, the loss (its mean since the check before) at 180,
        # where the default rule's two channels agree.
        assert cuts[0].step == 180
        assert "at the check before (step 160)" in cuts[0].reason
        assert "layer that moved first" in cuts[0].reason
        assert namespace["page"].is_file()


def test_there_is_a_notebook():
    assert NOTEBOOKS
