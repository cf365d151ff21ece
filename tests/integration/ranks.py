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
#: The environment of a two-process job: one thread, and Python's stack of every thread on a fatal signal (an abort
#: or a crash of a rank then says where it happened in the job's output).
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}


def write_result(directory: str | Path, rank: int, data: dict[str, Any]) -> None:
    """Write this rank's ``rank<r>.json`` (whole or not at all), then wait until every rank has written its own.

    The wait (a barrier, when a process group is up) keeps a rank that finished first from exiting while another is
    still writing: a rank's exit can end the others (torchrun and Lightning's launchers stop the job when a process
    exits with an error, as the rare abort of c10d's threads at exit does), and a rank ended before it wrote would
    fail a test for a reason that is not its subject.
    """
    path = Path(directory, f"rank{rank}.json")
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_two_ranks(
    script: str, directory: Path, *args: Any, torchrun: bool = False, timeout: float = HANG_SECONDS
) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """Run ``script`` (itself spawning two ranks, or under ``torchrun`` with two processes) writing into
    ``directory``; each rank's JSON and the finished process. Fails with the output's tail if the script failed.
    """
    env = {**os.environ, **ENV}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*(launcher if torchrun else [sys.executable]), str(HERE / script), str(directory), *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return finished(result, directory), result


def finished(result: subprocess.CompletedProcess[str], directory: Path) -> list[dict[str, Any]]:
    """Both ranks' JSON from ``directory``, once the job that wrote them is known to have succeeded.

    An abort of torch's c10d threads at interpreter exit (seen under torchrun even after destroy_process_group, in
    CI, and on every job of a traced run), after both ranks wrote their results (`write_result` waits for both), is
    not what these tests are about: a job that wrote both files and then printed that abort counts as finished. Any
    other failure fails with the output.
    """
    written = all((directory / f"rank{r}.json").is_file() for r in (0, 1))
    teardown = written and "terminate called without an active exception" in result.stderr
    assert result.returncode == 0 or teardown, failure(result)
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in (0, 1)]


#: Lines of a job's output that say how a process ended: a signal, an abort, a crash, a launcher's verdict.
ENDINGS = ("signal", "terminate called", "Fatal Python error", "exitcode", "Segmentation", "Aborted", "Killed")


def failure(result: subprocess.CompletedProcess[str]) -> str:
    """What a failed job printed: how its processes ended, its first traceback (often the rank that failed first)
    and its last lines."""
    text = result.stdout + result.stderr
    first = text.find("Traceback")
    head = text[first : first + 4000] if first >= 0 else ""
    endings = "\n".join(line for line in text.splitlines() if any(word in line for word in ENDINGS))
    return f"exit code {result.returncode}\nhow processes ended:\n{endings[-3000:]}\n{head}\n[...]\n{text[-3000:]}"
