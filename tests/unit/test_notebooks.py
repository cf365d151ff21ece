import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_cells_run_in_order(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    code_cells = [c for c in cells if c["cell_type"] == "code"]
    assert code_cells
    for cell in code_cells:
        exec(compile("".join(cell["source"]), f"{path.name}:{cell['id']}", "exec"), namespace)
    assert "CI" in capsys.readouterr().out


def test_there_is_a_notebook():
    assert NOTEBOOKS
