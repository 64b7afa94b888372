"""runtime.signals.deferred_sigint: a Ctrl-C during a step is held until the step ends. Each
check runs in a fresh interpreter that handles SIGINT as a terminal's foreground process does:
a test process started in the background of a non-interactive shell ignores SIGINT, and passes
that on."""

import subprocess
import sys
import textwrap

HELD_READ = """
import ctypes, os, signal, threading
from minivllm.runtime.signals import deferred_sigint

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
buf = ctypes.create_string_buffer(1)
main = threading.main_thread().ident
threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()  # into the read
threading.Timer(0.6, os.write, (w, b"x")).start()
got = None
try:
    with deferred_sigint():
        got = libc.read(r, buf, 1)  # blocks until the write, across the SIGINT
        errno = ctypes.get_errno()
    print("not raised")
except KeyboardInterrupt:
    print("raised after the block", got, buf.raw, errno)
print("handler restored", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""

SECOND = """
import os, signal
from minivllm.runtime.signals import deferred_sigint

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
try:
    with deferred_sigint():
        os.kill(os.getpid(), signal.SIGINT)
        print("first held")
        os.kill(os.getpid(), signal.SIGINT)
        print("not reached")
except KeyboardInterrupt:
    print("second raised at once")
"""


def run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_held_sigint_restarts_the_system_call_it_lands_in_and_is_raised_after():
    """A C library's blocking read (as gloo's inside a collective) must not see EINTR: under
    Python's own handlers it would, and a collective that fails so fails the step."""
    assert run(HELD_READ) == ["raised after the block 1 b'x' 0", "handler restored True"]


def test_a_second_sigint_gives_up_on_the_step_at_once():
    assert run(SECOND) == ["first held", "second raised at once"]
