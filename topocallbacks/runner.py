"""The runner: evaluates each check in the training loop or in a background worker, and owns the worker's life.

A check's result is applied at the step it was announced for, on every rank (rank 0 evaluates and broadcasts).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._messages import Answer, Start
from ._state import StateFields, Stateful
from ._worker import WorkerFailed, WorkerProcess
from .check import CheckRecord
from .distributed import broadcast_object, rank_and_world
from .pipeline import CheckPipeline, CheckRequest, Evaluation, LayeredPipeline

__all__ = ["Runner"]

#: Completes a check's deciding (last) record from all of its records, on rank 0.
Annotate = Callable[[list[CheckRecord]], CheckRecord]
#: Called with each collected record (and the figures of its check's last one, None for the others), in order.
Emit = Callable[[CheckRecord, Any], None]


@dataclasses.dataclass
class _Pending:
    """A check whose decision is applied at ``apply_at`` (evaluated at once, or by the worker meanwhile)."""

    step: int
    apply_at: int
    probe_ms: float = 0.0
    evaluation: Evaluation | None = None
    eval_ms: float = 0.0  # the training loop's own time on an inline evaluation
    request: Any = None  # rank 0, in the background: what the worker was asked (sent again if it fails)

    def as_dict(self) -> dict[str, Any]:
        evaluation = self.evaluation
        return {
            "step": self.step,
            "apply_at": self.apply_at,
            "probe_ms": self.probe_ms,
            "record": None if evaluation is None or evaluation.record is None else evaluation.record.as_dict(),
            "others": [] if evaluation is None else [r.as_dict() for r in evaluation.others],
            "done": evaluation is not None,
        }

    def records_at(
        self, step: int, *, final: bool, waited_ms: float, annotate: Annotate | None = None
    ) -> list[CheckRecord]:
        """Rank 0: this check's records as collected at ``step``, the other layers' first, the deciding one last.

        ``final``: at the end of training (no ``applied_step``: their decisions can no longer act); ``annotate``
        completes the deciding record.
        """
        evaluation = self.evaluation
        if evaluation is None or evaluation.record is None:
            return []
        applied = None if final else step
        records = [
            dataclasses.replace(record, applied_step=applied, wait_ms=waited_ms, probe_ms=self.probe_ms)
            for record in [*evaluation.others, evaluation.record]
        ]
        if annotate is not None:
            records[-1] = annotate(records)
        return records

    def evaluate(self, request: CheckRequest, pipeline: CheckPipeline | LayeredPipeline) -> None:
        """Evaluate this check with ``pipeline`` now, in the training loop (the time it takes goes to ``eval_ms``)."""
        start = time.perf_counter()
        self.evaluation = request.run(pipeline)
        self.request = None
        self.eval_ms += (time.perf_counter() - start) * 1e3

    def answered(self, answer: Answer) -> None:
        """Take the evaluation a worker's ``answer`` carries (nothing is left to send again)."""
        record = None if answer.record is None else CheckRecord.from_dict(answer.record)
        others = [CheckRecord.from_dict(r) for r in answer.others]
        self.evaluation = Evaluation(record=record, figures=answer.figures, others=others)
        self.request = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> _Pending:
        record = None if data["record"] is None else CheckRecord.from_dict(data["record"])
        others = [CheckRecord.from_dict(r) for r in data.get("others", [])]
        evaluation = Evaluation(record=record, others=others)
        return cls(step=int(data["step"]), apply_at=int(data["apply_at"]), probe_ms=float(data["probe_ms"]),
                   evaluation=evaluation)  # fmt: skip


def _adopt_rank0(
    records: list[CheckRecord],
    pipeline: CheckPipeline | LayeredPipeline,
    share: Callable[[], dict[str, Any]] | None,
    receive: Callable[[Mapping[str, Any]], None] | None,
) -> list[CheckRecord]:
    """Broadcast rank 0's ``records`` and ``pipeline`` state (none: nothing); the other ranks adopt them.

    ``share`` gives the extra state broadcast with them, ``receive`` what the other ranks do with it.
    """
    rank, world = rank_and_world()
    if world == 1:
        return records
    payload = None
    if rank == 0 and records:
        payload = {"records": [r.as_dict() for r in records], "pipeline": pipeline.share(),
                   "extra": {} if share is None else share()}  # fmt: skip
    shared: dict[str, Any] | None = broadcast_object(payload)
    if shared is None or rank == 0:
        return records
    pipeline.receive(shared["pipeline"])
    if receive is not None:
        receive(shared["extra"])
    return [CheckRecord.from_dict(r) for r in shared["records"]]


class WorkerLife:
    """Rank 0's background worker, a base of `Runner`: started on use or beforehand, its replies taken, replaced.

    The worker cannot take training down: one that dies, fails or does not answer within ``timeout`` seconds is
    killed and replaced once (the new one starts from the mirror's state and gets the checks the old one had not
    answered, in order); after a second failure the checks run in the training loop. Each time one warning says
    what happened. No result of a killed worker can arrive later: its pipes are closed with it. The state it works
    on is the runner's.
    """

    settings_dict: dict[str, Any]
    pipeline: CheckPipeline | LayeredPipeline
    threads: int
    timeout: float
    failures: int
    _worker: WorkerProcess | None
    _synced: bool
    _pending: collections.deque[_Pending]

    @property
    def in_loop(self) -> bool:
        """Whether the checks run in the training loop from now on, whatever the schedule (the worker failed twice)."""
        return self.failures >= 2

    @property
    def worker(self) -> str:
        """Rank 0: ``"ready"`` (a worker set up its pipeline), ``"starting"`` or ``"failed"`` (none, or it died)."""
        return "failed" if self._worker is None or self.in_loop else self._worker.status

    def prestart(self) -> None:
        """Rank 0: start a worker now, beside the checks in the loop, so that it is ready if they move to it.

        The training runs on the CPU then: the worker gets at most the cores its threads leave free (one at least).
        """
        if rank_and_world()[0] == 0 and self._worker is None and not self.in_loop:
            self.threads = min(self.threads, max(1, (os.cpu_count() or 1) - torch.get_num_threads()))
            try:
                self._start_worker()
            except (RuntimeError, OSError) as failure:  # the checks stay in the loop; one would start on use
                warnings.warn(f"topocallbacks: could not start the background worker ({failure})", RuntimeWarning,
                              stacklevel=3)  # fmt: skip
                self.close()

    def close(self) -> None:
        """Stop the worker (the next background check starts a new one from the pipeline's state)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _evaluate(self, pending: _Pending, request: CheckRequest) -> None:
        """Evaluate a check in the training loop (the time it takes is the loop's)."""
        pending.evaluate(request, self.pipeline)
        self._synced = self._worker is None

    def _start_worker(self) -> WorkerProcess:
        """The worker, started from the mirror's state, or brought to it if checks were evaluated here beside it."""
        if self._worker is None:
            self._worker = WorkerProcess(self.settings_dict, self.pipeline.state_dict(), threads=self.threads)
        elif not self._synced:
            self._worker.request(Start(self.settings_dict, self.pipeline.state_dict()))
        self._synced = True
        return self._worker

    def _receive(self, pending: _Pending) -> float:
        """Rank 0: wait for the worker's evaluations up to ``pending``'s; the seconds waited for it."""
        waited = 0.0
        while pending.evaluation is None:
            item = next(i for i in self._pending if i.evaluation is None)  # the oldest unanswered, in order
            if self._worker is None:  # pragma: no cover - an unanswered check always has a worker
                raise RuntimeError("a background check is pending without a worker")
            try:
                answer, seconds = self._worker.reply(self.timeout)
            except WorkerFailed as failure:
                start = time.perf_counter()
                self._recover(failure)
                waited += time.perf_counter() - start
                continue
            self.pipeline.receive(answer.shared)  # the mirror follows the worker at once
            item.answered(answer)
            if item is pending:
                waited += seconds
        return waited

    def _recover(self, failure: WorkerFailed) -> None:
        """The worker failed: kill it, then replace it once (resending what it owed), or evaluate here from now on."""
        if self._worker is not None:
            self._worker.kill()
            self._worker = None
        self.failures += 1
        owed = [item for item in self._pending if item.evaluation is None and item.request is not None]
        if failure.in_check and owed:
            # The check itself raised there: run it here, where its error is what the loop would have raised.
            self._evaluate(owed[0], owed[0].request)
            owed = owed[1:]
        if self.in_loop:
            what = f"the checks run in the training loop from now on ({len(owed)} pending evaluated there)"
        else:
            what = f"a new worker starts from the last state received and gets the {len(owed)} check(s) it owed"
        warnings.warn(f"topocallbacks: {failure}; {what}. Training goes on.", RuntimeWarning, stacklevel=5)
        for item in owed:
            if self.in_loop:
                self._evaluate(item, item.request)
            else:
                try:
                    self._start_worker().request(item.request)
                except WorkerFailed as again:
                    self._recover(again)
                    return

    def __getstate__(self) -> dict[str, Any]:
        # A worker process does not pickle (ddp_spawn pickles callbacks): it is started again on use.
        return {**self.__dict__, "_worker": None}


class Runner(WorkerLife, Stateful):
    """Evaluates checks and hands back their records when their step comes, the same on every rank.

    Rank 0 evaluates a check at once with ``pipeline`` (in the training loop) or sends it to a worker process
    (`topocallbacks._worker`, in the background) and mirrors the worker's pipeline state from each reply. Every
    rank queues the check; `collect` gives back, in order, the records of the checks whose ``apply_at`` has
    come, waiting for a late worker there (the record's ``wait_ms``), and other ranks adopt rank 0's records and
    pipeline state (one broadcast per collected check).

    The worker's life (started on use, replaced once when it fails, then the checks in the loop) is `WorkerLife`'s.

    Args:
        settings_dict: the monitor's settings as a dict (what a worker is started with).
        pipeline: the pipeline that evaluates (or mirrors the worker's).
        threads: threads the worker's numerical libraries may use.
        share: extra state rank 0 broadcasts with each check's records (e.g. the learning-rate factor), and
            receive: what the other ranks do with it.
        timeout: seconds to wait for the worker at a check's applied step before it counts as stuck.
    """

    _state = StateFields(version=1, fields={"pending": "_pending_state"})

    def __init__(
        self,
        settings_dict: dict[str, Any],
        pipeline: CheckPipeline | LayeredPipeline,
        threads: int = 2,
        share: Callable[[], dict[str, Any]] | None = None,
        receive: Callable[[Mapping[str, Any]], None] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.settings_dict = settings_dict
        self.pipeline = pipeline
        self.threads = threads
        self.share, self.receive = share, receive
        self.timeout = timeout
        self._pending: collections.deque[_Pending] = collections.deque()
        self._worker: WorkerProcess | None = None
        self._synced = True  # the worker's pipeline is the mirror's (False after a check evaluated here beside it)
        #: Worker failures so far; after the second the checks run in the training loop (`in_loop`).
        self.failures = 0

    @property
    def pending(self) -> int:
        """Checks submitted whose records were not collected yet."""
        return len(self._pending)

    def submit(
        self, request: CheckRequest, apply_at: int, *, background: bool, probe_ms: float = 0.0, prestart: bool = False
    ) -> None:
        """Queue a check (every rank); rank 0 evaluates it now or hands it to the worker.

        ``prestart``: start a worker beside the loop even for a check evaluated here (`prestart`); a background
        check is then evaluated here too while that worker is still starting (`_still_starting`).
        """
        pending = _Pending(request.step, apply_at, probe_ms)
        self._pending.append(pending)
        if rank_and_world()[0] != 0:
            return
        if prestart and not background:
            self.prestart()
        if background and not self.in_loop and not (prestart and self._still_starting()):
            pending.request = request
            try:
                self._start_worker().request(request)
            except WorkerFailed as failure:
                self._recover(failure)
        else:
            self._evaluate(pending, request)

    def _still_starting(self) -> bool:
        """Whether the newest check is best evaluated here, beside a worker that was started and is not ready yet.

        Only when the worker owes no earlier check (their order is the pipeline's: a check's drift is against the
        one before). The check's decision is applied at the same step wherever it is evaluated, so this changes
        what the loop waits for (the evaluation, not a process's start), never what the run decides.
        """
        if self._worker is None or self._worker.status != "starting":
            return False
        return all(item.evaluation is not None for item in itertools.islice(self._pending, len(self._pending) - 1))

    def collect(
        self, step: int, *, final: bool = False, annotate: Annotate | None = None, emit: Emit | None = None
    ) -> list[CheckRecord]:
        """The records of every pending check whose step has come (all ranks, in order).

        Args:
            step: the step now.
            final: the end of training: the records get no ``applied_step`` (their decisions can no longer act).
            annotate: completes the deciding (last) record from all of a check's records, on rank 0.
            emit: called with each record (and the figures of the check's last one, None for the others) in order.
        """
        collected: list[CheckRecord] = []
        if not self._pending or self._pending[0].apply_at > step:
            return collected  # the common step: nothing to apply (kept cheap: it runs at every training step)
        rank = rank_and_world()[0]
        while self._pending and self._pending[0].apply_at <= step:
            pending = self._pending[0]
            waited_ms = self._receive(pending) * 1e3 + pending.eval_ms if rank == 0 else 0.0
            self._pending.popleft()
            found = pending.records_at(step, final=final, waited_ms=waited_ms, annotate=annotate) if rank == 0 else []
            figures = pending.evaluation.figures if found and pending.evaluation is not None else None
            adopted = _adopt_rank0(found, self.pipeline, self.share, self.receive)
            for i, record in enumerate(adopted):
                if emit is not None:
                    emit(record, figures if i == len(adopted) - 1 else None)
                collected.append(record)
        return collected

    def finish(self, annotate: Annotate | None = None, emit: Emit | None = None) -> list[CheckRecord]:
        """End of training: every pending check's records (`collect`), with no ``applied_step``.

        Every rank must call it.
        """
        done: list[CheckRecord] = []
        while self._pending:
            done += self.collect(self._pending[-1].apply_at, final=True, annotate=annotate, emit=emit)
        return done

    def reset(self, pipeline: CheckPipeline | LayeredPipeline) -> None:
        """Evaluate the next checks with a new ``pipeline`` (the budget resized the probe), in a running worker too.

        The checks already submitted keep the old pipeline: rank 0 first waits for their evaluations (the mirror
        follows the worker in order). A running worker then gets the new pipeline's state before its next check,
        as after checks in the loop, instead of a new process being started (that would pay the imports again).
        """
        if rank_and_world()[0] == 0 and self._pending:
            self._receive(self._pending[-1])
        self.pipeline = pipeline
        self._synced = self._worker is None

    @property
    def _pending_state(self) -> list[dict[str, Any]]:
        if rank_and_world()[0] == 0 and self._pending:
            self._receive(self._pending[-1])  # a checkpoint holds every pending check's finished evaluation
        return [pending.as_dict() for pending in self._pending]

    @_pending_state.setter
    def _pending_state(self, value: list[Mapping[str, Any]]) -> None:
        self._pending = collections.deque(_Pending.from_dict(item) for item in value)
