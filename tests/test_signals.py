"""runtime.signals.deferred_sigint: a Ctrl-C during a step is held until the step ends."""

import ctypes
import os
import signal
import threading

import pytest

from minivllm.runtime.signals import deferred_sigint


def test_a_held_sigint_restarts_the_system_call_it_lands_in_and_is_raised_after():
    """A C library's blocking read (as gloo's inside a collective) must not see EINTR: under
    Python's own handlers it would, and a collective that fails so fails the step."""
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    buf = ctypes.create_string_buffer(1)
    got = []
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    threading.Timer(0.6, os.write, (w, b"x")).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_sigint():
                got.append(libc.read(r, buf, 1))  # blocks until the write, across the SIGINT
                got.append(ctypes.get_errno())
    finally:
        os.close(r)
        os.close(w)
    assert got[0] == 1 and buf.raw == b"x", got
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_sigint_gives_up_on_the_step_at_once():
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("not reached: the second SIGINT raises in the block")
