"""Stopping a run on SIGINT/SIGTERM without losing what it spent.

The first signal asks the run to stop after the step in progress (the loop then writes a
checkpoint and the summary) and says so at once. A second one stops sooner: it interrupts the step
or the evaluation in progress; the loop then keeps the newest checkpoint, or writes one if no step
was half done, so the ledger of everything released stays on disk.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Callable


class Interrupted(BaseException):
    """Raised by a second signal inside the work of a step or an evaluation."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def graceful_stop(request_stop: Callable[[int], None], say: Callable[[str], None] | None = None,
                  then: str = "stopping after the current step (again to stop sooner; what was spent is kept)"):
    """Within the block, the first SIGINT/SIGTERM calls ``request_stop(signum)`` and ``say``s what
    happens ``then``; the second raises :class:`Interrupted`."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    seen: list[int] = []

    def handler(signum, frame):
        if seen:
            raise Interrupted(signum)
        seen.append(signum)
        request_stop(signum)
        say(f"{signal.Signals(signum).name}: {then}")

    old = {}
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, handler)
    except ValueError:  # not the main thread: signals keep their handlers
        old = {}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
