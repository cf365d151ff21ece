"""The lock (requirements/*.txt, made by `make lock`) agrees with pyproject.toml and never holds a CUDA build."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins(name):
    """`package -> version` of a lock file (its `name==version` lines)."""
    text = (ROOT / "requirements" / name).read_text()
    found = re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", text, flags=re.MULTILINE)
    return {canonicalize_name(package): version for package, version in found}


def requirements(*extras):
    """pyproject.toml's requirements: the dependencies and those of the extras named (self-references expanded)."""
    found, todo, seen = [Requirement(r) for r in PROJECT["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in PROJECT["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == canonicalize_name(PROJECT["name"]):
                todo.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


@pytest.mark.parametrize(("lock", "extras"), [("dev.txt", ("dev",)), ("demo.txt", ("report",))])
def test_the_lock_pins_every_requirement_within_its_range(lock, extras):
    pinned = pins(lock)
    for requirement in requirements(*extras):
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is missing from requirements/{lock}: run `make lock`"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"requirements/{lock} pins {name}=={pinned[name]}, outside pyproject.toml's {requirement}: run `make lock`"
        )


def test_the_demo_set_has_the_dev_sets_versions():
    dev, demo = pins("dev.txt"), pins("demo.txt")
    assert {name: dev.get(name) for name in demo} == demo


def test_torch_is_the_cpu_wheel_and_no_cuda_package_gets_in():
    for lock in ("dev.txt", "demo.txt"):
        pinned = pins(lock)
        assert pinned["torch"] == "2.13.0+cpu"
        assert not [name for name in pinned if name.startswith(("nvidia-", "triton", "cuda-"))]
