"""The background check worker: a separate process that runs a `CheckPipeline`.

A process, not a thread: the check is CPU work in numpy, scipy, GUDHI and Python that would otherwise compete for
the training loop's interpreter lock. The training process starts it with ``python -m topocallbacks._worker
READ_FD WRITE_FD`` (a fresh interpreter that imports no torch and never re-runs the user's script); the worker
loads the compiled kernels (numba, when installed) and scipy's assignment solver (the diagram distance's) before it
reads a request, so that its first checks do not pay for them. The training process sends it requests over two
pipes and reads one reply per request, in order (`topocallbacks._messages`): a ``Start`` (create the pipeline,
from a saved state when resuming) is answered with ``Ready``; a [`CheckRequest`][topocallbacks.pipeline.CheckRequest]
(a probe check, or a streaming window's batches to push and check) with an ``Answer`` or a ``Failure`` (its
traceback). The pipes closing stops it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from ._messages import Answer, Failure, Ready, Start

__all__ = ["WorkerFailed", "WorkerProcess", "main"]

#: Seconds a stopping worker gets to exit before it is killed.
_STOP_GRACE = 5.0
#: Seconds a worker that has not said it is ready yet gets to start (a fresh interpreter, scipy, numba's kernels: a
#: second on an idle machine, many more on a busy one), whatever the check's timeout: the timeout is for a check.
START_TIMEOUT = 120.0


def _evaluate(pipeline: Any, request: Any) -> Answer:
    """The answer to a check request (`topocallbacks.pipeline.CheckRequest`)."""
    evaluation = request.run(pipeline)
    record = None if evaluation.record is None else evaluation.record.as_dict()
    return Answer(
        record=record,
        shared=pipeline.share(),
        figures=evaluation.figures,
        others=[r.as_dict() for r in evaluation.others],
    )


def _serve(receive: Connection, send: Connection) -> int:
    from .functional._jit import core_kernel
    from .pipeline import CheckPipeline, CheckRequest, LayeredPipeline, make_pipeline
    from .settings import MonitorSettings

    core_kernel()  # numba's import and the cached machine code: now, not in the first check
    import scipy.optimize  # noqa: F401 - the diagram distance's assignment: now, not in the second check (~1 s busy)

    pipeline: CheckPipeline | LayeredPipeline | None = None
    while True:
        try:
            message = receive.recv()
        except EOFError:
            return 0
        reply: Ready | Answer | Failure
        try:
            if isinstance(message, Start):
                pipeline = make_pipeline(MonitorSettings.from_dict(message.settings))
                if message.state is not None:
                    pipeline.load_state_dict(message.state)
                reply = Ready()
            elif not isinstance(message, CheckRequest):
                raise RuntimeError(f"the worker got an unknown message: {type(message).__name__}")
            elif pipeline is None:
                raise RuntimeError("the worker got a check request before its Start")
            else:
                reply = _evaluate(pipeline, message)
        except Exception:  # any failure goes back to the training process, with its traceback
            reply = Failure(traceback.format_exc())
        try:
            send.send(reply)
        except OSError:  # the training process closed the pipes (it stopped us, or it ended): nothing to answer
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m topocallbacks._worker READ_FD WRITE_FD``."""
    args = list(sys.argv[1:] if argv is None else argv)
    receive = Connection(int(args[0]), writable=False)
    send = Connection(int(args[1]), readable=False)
    try:
        return _serve(receive, send)
    finally:
        receive.close()
        send.close()


#: Workers told to stop whose exit a reaper thread waits for (killed at the interpreter's exit if still there).
_REAPING: set[subprocess.Popen[bytes]] = set()


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(timeout=_STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    finally:
        _REAPING.discard(process)


@atexit.register
def _kill_unreaped() -> None:
    for process in list(_REAPING):
        with contextlib.suppress(OSError):
            process.kill()


def _shutdown(
    process: subprocess.Popen[bytes], send: Connection, receive: Connection, outbox: Any, wait: bool = True
) -> None:
    """Tell the worker to stop; wait for its exit (killed after a grace period) here, or in a reaper thread."""
    outbox.put(None)  # the sending thread ends (a write under way fails once the pipe is closed)
    send.close()  # the worker reads the end of its requests, or fails to answer: either way it exits
    receive.close()
    if wait:
        _reap(process)
    else:  # the training loop does not wait for the interpreter's exit (a few hundred milliseconds)
        _REAPING.add(process)
        threading.Thread(target=_reap, args=(process,), name="topocallbacks-reaper", daemon=True).start()


class WorkerFailed(RuntimeError):
    """The worker died, did not answer in time, or its evaluation failed (the message says which).

    Attributes:
        in_check: the check itself raised in the worker (its traceback is in the message), not the process.
    """

    def __init__(self, message: str, *, in_check: bool = False) -> None:
        super().__init__(message)
        self.in_check = in_check


class WorkerProcess:
    """The training process's handle on a worker: start it, send requests, read replies, stop it.

    Args:
        settings: the monitor's settings as a dict (``MonitorSettings.as_dict()``).
        state: a pipeline state to start from (a resumed run), or None.
        threads: threads the worker's numerical libraries may use (``OMP_NUM_THREADS`` and friends).

    Raises:
        RuntimeError: the worker could not be started.
    """

    def __init__(self, settings: dict[str, Any], state: dict[str, Any] | None, *, threads: int) -> None:
        to_worker_read, to_worker_write = os.pipe()
        from_worker_read, from_worker_write = os.pipe()
        env = dict(os.environ)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(threads)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", "topocallbacks._worker", str(to_worker_read), str(from_worker_write)]
        try:
            self.process = subprocess.Popen(
                command, pass_fds=(to_worker_read, from_worker_write), env=env, stdin=subprocess.DEVNULL
            )
        finally:
            os.close(to_worker_read)
            os.close(from_worker_write)
        self.send = Connection(to_worker_write, readable=False)
        self.receive = Connection(from_worker_read, writable=False)
        # Requests go out from a thread of their own: writing a probe's features into the pipe waits for the worker
        # to read them, which the training loop need not do (the thread releases the interpreter lock while it
        # writes). One thread keeps them in order.
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # a Start or a CheckRequest; None ends it
        self._send_error: OSError | None = None
        self._ready = False  # the worker answered its Start
        self._early: Answer | Failure | None = None  # a first answer that was not Ready (a Start that failed)
        self._sender = threading.Thread(target=self._send_all, name="topocallbacks-requests", daemon=True)
        self._sender.start()
        self._finalizer = weakref.finalize(self, _shutdown, self.process, self.send, self.receive, self._outbox)
        self._outbox.put(Start(settings, state))

    def _send_all(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.send.send(message)
            except OSError as exc:  # the worker is gone: the next request or reply says so
                self._send_error = exc
                return

    def request(self, message: Any) -> None:
        """Queue one request (sent beside the loop; answered later, in order, by `reply`).

        Raises:
            WorkerFailed: the worker is gone.
        """
        if self._send_error is not None or self.process.poll() is not None:
            raise self._died()
        self._outbox.put(message)

    @property
    def ready(self) -> bool:
        """Whether the worker has started and set up its pipeline (read without waiting)."""
        if not self._ready and self._early is None:
            with contextlib.suppress(EOFError, OSError):
                if self.receive.poll(0):
                    answer = self.receive.recv()
                    if isinstance(answer, Ready):
                        self._ready = True
                    else:
                        self._early = answer
        return self._ready

    @property
    def status(self) -> str:
        """``"ready"`` (it set up its pipeline), ``"starting"`` or ``"failed"`` (it died); read without waiting."""
        if self.ready:
            return "ready"
        return "starting" if self.process.poll() is None else "failed"

    def _next(self, timeout: float | None) -> Answer | Failure:
        """The next answer that is not `Ready`, waiting at most ``timeout`` seconds once the worker is ready.

        A worker still starting gets up to `START_TIMEOUT` seconds (or ``timeout`` if longer) to say it is
        ready, and ``timeout`` from then on: a slow start on a busy machine is not a stuck check.
        """

        def limit() -> float | None:
            if timeout is None:
                return None
            return time.perf_counter() + (timeout if self._ready else max(timeout, START_TIMEOUT))

        deadline = limit()
        while True:
            if self._early is not None:
                early, self._early = self._early, None
                return early
            if deadline is not None and not self.receive.poll(max(0.0, deadline - time.perf_counter())):
                what = f"did not answer within {timeout:g} s" if self._ready else (
                    f"did not start within {max(timeout or 0.0, START_TIMEOUT):g} s")  # fmt: skip
                raise WorkerFailed(f"the background check worker (pid {self.process.pid}) {what}")
            answer: Ready | Answer | Failure = self.receive.recv()
            if not isinstance(answer, Ready):
                return answer
            self._ready = True
            deadline = limit()  # the check's own timeout, from the worker's start on

    def reply(self, timeout: float | None = None) -> tuple[Answer, float]:
        """The next answer, waiting for it if needed (at most ``timeout`` seconds), and the seconds spent waiting.

        Raises:
            WorkerFailed: the evaluation failed in the worker (with its traceback), the worker died, or it did not
                answer within ``timeout`` seconds.
        """
        start = time.perf_counter()
        try:
            answer = self._next(timeout)
        except (EOFError, OSError) as exc:
            raise self._died() from exc
        waited = time.perf_counter() - start
        if isinstance(answer, Failure):
            message = f"a check failed in the background worker (pid {self.process.pid}):\n{answer.traceback}"
            raise WorkerFailed(message, in_check=True)
        return answer, waited

    def close(self) -> None:
        """Stop the worker (it finishes the request in hand, if any; killed after a grace period), without waiting."""
        arguments = self._finalizer.detach()
        if arguments is not None:
            process, send, receive, outbox = arguments[2]
            _shutdown(process, send, receive, outbox, wait=False)

    def kill(self) -> None:
        """Kill the worker at once (a stuck one too), and close the pipes."""
        with contextlib.suppress(OSError):
            self.process.kill()
        self._finalizer()

    def _died(self) -> WorkerFailed:
        code = self.process.poll()
        return WorkerFailed(
            f"the background check worker (pid {self.process.pid}) died (exit code {code}; its error, if any, is "
            "above on stderr)"
        )


if __name__ == "__main__":
    sys.exit(main())
