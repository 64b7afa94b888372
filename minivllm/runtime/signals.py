"""Signals in a multi-process engine.

Every rank runs each step's collectives in the same order, so a step must not be abandoned
half-way on one rank: a Ctrl-C (SIGINT) that arrives during a step is held until the step ends
and then raised, which leaves the ranks in lockstep and the engine usable (a chat can drop the
reply and go on). A second Ctrl-C during the same step raises at once; the engine then stops its
workers, since the ranks can no longer agree on what runs next.

SIGTERM, by default, kills a process without running `atexit`; rank 0 turns it into SystemExit
so that its workers are stopped on the way out.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deferred_sigint():
    """Hold one SIGINT until the block ends, then deliver it (KeyboardInterrupt under Python's
    default handler). Outside the main thread signals cannot be handled, and this does nothing."""
    if not _in_main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    pending = []

    def hold(signum, frame):
        if pending:  # the second one: give up on the step
            raise KeyboardInterrupt
        pending.append(frame)

    signal.signal(signal.SIGINT, hold)
    # Held means unfelt: a blocking system call the SIGINT lands in restarts instead of failing
    # with EINTR, which the C code of a step (a collective's library) could report as an error.
    signal.siginterrupt(signal.SIGINT, False)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        if callable(previous):
            previous(signal.SIGINT, pending[0])
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def exit_on_sigterm() -> None:
    """SIGTERM -> SystemExit(143) in this process, unless someone already handles SIGTERM."""
    if _in_main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
