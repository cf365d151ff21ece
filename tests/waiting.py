"""Waiting in tests: for an event, never for a duration (issue 34: the suite passes on a busy machine).

``HANG_SECONDS`` is the one limit after which a test that waits (a subprocess, a launched job, a worker's answer, a
browser) counts as hung: it turns a hang into a failure and says nothing about speed. It is generous on purpose: the
slowest job of the suite (a two-process DDP fit) takes about 70 s with two busy loops beside the suite on two cores.
"""

import time
from collections.abc import Callable

HANG_SECONDS = 900.0


def wait_until(event: Callable[[], bool], timeout: float = HANG_SECONDS) -> bool:
    """Whether ``event()`` became true within ``timeout`` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not event():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
