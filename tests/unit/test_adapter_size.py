"""Issue 38's limits on the training adapters, which share one core (`integrations/core.py`): each framework's adapter
and glue together stay within 350 lines and import at most 4 modules of the package besides the core."""

import ast
from pathlib import Path

import pytest

INTEGRATIONS = Path(__file__).parents[2] / "topocallbacks" / "integrations"
PACKAGE = "topocallbacks.integrations"
CORE = f"{PACKAGE}.core"
FRAMEWORKS = {"lightning": ("lightning.py", "lightning_glue.py"), "hf": ("hf.py", "hf_glue.py")}


def imported_modules(path: Path) -> set[str]:
    """The ``topocallbacks`` modules ``path`` imports anywhere (relative imports resolved; a package counts once)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = PACKAGE.split(".")  # the package these files are in
            base = ".".join(parts[: len(parts) + 1 - node.level]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            if node.module is None:  # `from . import x`: x is a module
                found |= {f"{module}.{alias.name}" for alias in node.names}
            else:
                found.add(module)
    return {name for name in found if name == "topocallbacks" or name.startswith("topocallbacks.")}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_adapter_and_glue_are_at_most_350_lines(framework):
    lines = sum(len((INTEGRATIONS / name).read_text().splitlines()) for name in FRAMEWORKS[framework])
    assert lines <= 350, f"{' + '.join(FRAMEWORKS[framework])}: {lines} lines"


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_adapter_and_glue_import_at_most_4_product_modules_besides_the_core(framework):
    files = FRAMEWORKS[framework]
    own = {f"{PACKAGE}.{name.removesuffix('.py')}" for name in files}
    imported = set().union(*(imported_modules(INTEGRATIONS / name) for name in files))
    assert CORE in imported  # the walk sees the relative imports
    product = sorted(imported - own - {CORE})
    assert len(product) <= 4, f"{framework}: {product}"


def test_the_core_imports_no_training_framework():
    tree = ast.parse((INTEGRATIONS / "core.py").read_text())
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not roots & {"lightning", "pytorch_lightning", "transformers", "accelerate"}
