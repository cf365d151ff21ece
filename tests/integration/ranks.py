"""Running a two-process script of this folder and reading what each rank wrote (``rank0.json``, ``rank1.json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.waiting import HANG_SECONDS

HERE = Path(__file__).parent


def run_two_ranks(
    script: str, directory: Path, *args: Any, torchrun: bool = False, timeout: float = HANG_SECONDS
) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """Run ``script`` (itself spawning two ranks, or under ``torchrun`` with two processes) writing into
    ``directory``; each rank's JSON and the finished process. Fails with the output's tail if the script failed.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*(launcher if torchrun else [sys.executable]), str(HERE / script), str(directory), *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return finished(result, directory), result


def finished(result: subprocess.CompletedProcess[str], directory: Path) -> list[dict[str, Any]]:
    """Both ranks' JSON from ``directory``, once the job that wrote them is known to have succeeded.

    A rare abort of torch's c10d threads at interpreter exit, after both ranks finished and wrote their results
    (seen under torchrun even after destroy_process_group, and in CI), is not what these tests are about: a job that
    wrote both files and then printed that abort counts as finished. Any other failure fails with the output.
    """
    written = all((directory / f"rank{r}.json").is_file() for r in (0, 1))
    teardown = written and "terminate called without an active exception" in result.stderr
    assert result.returncode == 0 or teardown, failure(result)
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in (0, 1)]


def failure(result: subprocess.CompletedProcess[str]) -> str:
    """What a failed job printed: from its first traceback (often the rank that failed first) and its last lines."""
    text = result.stdout + result.stderr
    first = text.find("Traceback")
    head = text[first : first + 4000] if first >= 0 else ""
    return f"exit code {result.returncode}\n{head}\n[...]\n{text[-3000:]}"
