"""Where the rescue suite caches its trunks and detector runs (``benchmarks/rescue/cache/``, git-ignored)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from faults import QUICK, Setup

VERSION = 1
CACHE = Path(__file__).resolve().parent / "cache"
ROOT = Path(__file__).resolve().parents[2]
#: The code a run executes: the library, and the suite's trainees, faults, engine and rows with what they borrow from
#: the collapse suite (not the files that only read cached runs: outputs.py, audit.py, run.py, this one).
LIBRARY = ("topocallbacks",)
SUITE = (
    "benchmarks/rescue/faults.py",
    "benchmarks/rescue/finetune.py",
    "benchmarks/rescue/engine.py",
    "benchmarks/rescue/detectors.py",
    "benchmarks/rescue/baselines.py",
    "benchmarks/collapse/scenarios.py",
    "benchmarks/data.py",
)
PREREGISTRATION = "benchmarks/PREREGISTERED.md"


def _code(file: Path) -> bytes:
    """A Python file's code without its docstrings and formatting (its syntax tree): a reflowed docstring or a
    formatter's change is not a change of what runs."""
    tree = ast.parse(file.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[0] = ast.Pass()
    return ast.dump(tree).encode()


def _digest(parts: tuple[str, ...]) -> str:
    """A short hash of the code of the Python files under ``parts`` (paths and syntax trees)."""
    digest = hashlib.sha1()
    for part in parts:
        path = ROOT / part
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(ROOT).as_posix().encode() + b"\0" + _code(file) + b"\0")
    return digest.hexdigest()[:12]


def git(*args: str) -> str | None:
    """What ``git ARGS`` prints in the repository (stripped), or None where git fails or is missing."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


@functools.cache
def code_version() -> dict[str, Any]:
    """What a run was computed with: content hashes of the library and of the suite (what decides whether a cached
    run is reused), and, to read, the commit and whether either had uncommitted changes."""
    dirty = git("status", "--porcelain", "--", *LIBRARY, *SUITE)
    return {
        "library": _digest(LIBRARY),
        "suite": _digest(SUITE),
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": None if dirty is None else bool(dirty),
    }


def same_code(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether a cached payload's ``code`` (None: cached before runs recorded it) is the code ``b`` hashes."""
    return a is not None and (a.get("library"), a.get("suite")) == (b["library"], b["suite"])


def preregistration() -> dict[str, Any] | None:
    """The commit that last changed ``benchmarks/PREREGISTERED.md`` (None: no such file), and whether the file on
    disk differs from it."""
    if not (ROOT / PREREGISTRATION).exists():
        return None
    commit = git("log", "-1", "--format=%h", "--", PREREGISTRATION)
    changed = git("status", "--porcelain", "--", PREREGISTRATION)
    return {"file": PREREGISTRATION, "commit": commit or None, "uncommitted": bool(changed) or not commit}


def fingerprint(setup: Setup) -> str:
    """A short hash of the setup and the suite's version: a changed setup never reuses stale work (a changed code
    never does either: each cached run records :func:`code_version`, and ``run.py`` recomputes a run of other code)."""
    text = json.dumps({"version": VERSION, **dataclasses.asdict(setup)}, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def cache_dir(cache: Path, setup: Setup) -> Path:
    return cache / f"{'quick' if setup == QUICK else 'full'}-{fingerprint(setup)}"


def trunk_path(directory: Path, arch: str, seed: int) -> Path:
    return directory / f"trunk-{arch}-seed{seed}.pt"


def trunk_summary_path(directory: Path, arch: str, seed: int) -> Path:
    return directory / f"trunk-{arch}-seed{seed}.json"


def trunk_code_path(directory: Path, arch: str, seed: int) -> Path:
    return directory / f"trunk-{arch}-seed{seed}.code.json"


def cached_code(path: Path) -> dict[str, Any] | None:
    """The ``code`` a cached file recorded (a trunk's side file, or a detector run's payload); None: none."""
    if not path.exists():
        return None
    code: dict[str, Any] | None = json.loads(path.read_text()).get("code")
    return code


def runs_path(directory: Path, arch: str, seed: int, key: str) -> Path:
    return directory / f"runs-{arch}-seed{seed}-{key}.json"


def timing_path(directory: Path, arch: str) -> Path:
    return directory / f"timing-{arch}.json"
