"""No module of the package imports another module's private names (issue 38), except the functional kernels.

A name shared between modules is public there (and documented); ``topocallbacks/functional/`` is the exception, as
in torchmetrics: its private kernels (``_betti_numbers``, ``_subsample``...) are what the callbacks run.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "topocallbacks"
ALLOWED_SOURCE = "topocallbacks.functional"


def module_name(path: Path) -> str:
    """The dotted name of a module file under the package's parent folder (a package is its ``__init__``)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name of the module an ``ImportFrom`` in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each ``from <package module> import _name`` of ``source``: ``"module: _name from origin (line n)"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        origin = imported_from(node, module, is_package)
        if origin.split(".")[0] != "topocallbacks" or (origin + ".").startswith(ALLOWED_SOURCE + "."):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{module}: {alias.name} from {origin} (line {node.lineno})")
    return found


def test_no_module_imports_a_private_name_of_another_module():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40  # the walk saw the package
    found = [
        finding
        for path in modules
        for finding in private_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    ]
    assert found == [], "\n".join(found)


def test_the_check_finds_relative_absolute_nested_and_parenthesised_private_imports():
    source = """
from ..report import _e, format_number
from .checkpoints import (
    Checkpoint,
    _torch_load,
)
from topocallbacks.summary import _private as public
from ..functional.topology import _subsample
from .. import __version__
from numpy import _private_numpy


def later():
    from . import _helpers
"""
    found = private_imports(source, "topocallbacks.analysis.writing")
    assert found == [
        "topocallbacks.analysis.writing: _e from topocallbacks.report (line 2)",
        "topocallbacks.analysis.writing: _torch_load from topocallbacks.analysis.checkpoints (line 3)",
        "topocallbacks.analysis.writing: _private from topocallbacks.summary (line 7)",
        "topocallbacks.analysis.writing: _helpers from topocallbacks.analysis (line 14)",
    ]
    # A package's own ``from . import`` reads from the package itself; kernels import each other's private names.
    assert private_imports("from ._x import _y", "topocallbacks.analysis", is_package=True) == [
        "topocallbacks.analysis: _y from topocallbacks.analysis._x (line 1)"
    ]
    assert private_imports("from .geometry import _anisotropy", "topocallbacks.functional.collapse") == []
