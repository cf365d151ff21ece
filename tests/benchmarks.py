"""The benchmark scripts' modules in tests: imported from their folder (which is on ``sys.path`` while a test module
uses them, as the scripts put it there themselves when run)."""

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: Skips a test that trains on Fashion-MNIST where Debian's dataset-fashion-mnist (``.ci/run`` installs it) is missing.
needs_fashion_mnist = pytest.mark.skipif(
    not (Path("/usr/share/datasets/fashion-mnist") / "train-images-idx3-ubyte.gz").exists(),
    reason="needs Debian's dataset-fashion-mnist",
)


def benchmark_module(name: str, folder: str = "") -> Callable[..., Any]:
    """A module-scoped fixture giving ``benchmarks/<folder>/<name>.py`` as a module."""

    @pytest.fixture(scope="module")
    def module() -> Iterator[ModuleType]:
        path = str(BENCHMARKS / folder)
        sys.path.insert(0, path)
        try:
            yield importlib.import_module(name)
        finally:
            sys.path.remove(path)

    return module


def benchmark_suite(folder: str, names: tuple[str, ...]) -> Callable[..., Any]:
    """A module-scoped fixture giving ``{name: module}`` for the modules ``names`` of ``benchmarks/<folder>/``."""

    @pytest.fixture(scope="module")
    def modules() -> Iterator[dict[str, ModuleType]]:
        path = str(BENCHMARKS / folder)
        sys.path.insert(0, path)
        try:
            yield {name: importlib.import_module(name) for name in names}
        finally:
            sys.path.remove(path)

    return modules
