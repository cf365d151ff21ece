"""Where the rescue suite caches its trunks and detector runs (``benchmarks/rescue/cache/``, git-ignored)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from faults import QUICK, Setup

VERSION = 1
CACHE = Path(__file__).resolve().parent / "cache"


def fingerprint(setup: Setup) -> str:
    """A short hash of the setup and the suite's version: a changed setup never reuses stale work."""
    text = json.dumps({"version": VERSION, **dataclasses.asdict(setup)}, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def cache_dir(cache: Path, setup: Setup) -> Path:
    return cache / f"{'quick' if setup == QUICK else 'full'}-{fingerprint(setup)}"


def trunk_path(directory: Path, arch: str, seed: int) -> Path:
    return directory / f"trunk-{arch}-seed{seed}.pt"


def trunk_summary_path(directory: Path, arch: str, seed: int) -> Path:
    return directory / f"trunk-{arch}-seed{seed}.json"


def runs_path(directory: Path, arch: str, seed: int, key: str) -> Path:
    return directory / f"runs-{arch}-seed{seed}-{key}.json"


def timing_path(directory: Path, arch: str) -> Path:
    return directory / f"timing-{arch}.json"
