"""Waiting in tests for a condition, never for a length of time.

A test that must see something happen (a mount up, a receiver listed, a
version committed, a process gone) polls for it with `wait_for`, which
returns as soon as it holds; the timeout only bounds how long a broken build
keeps the test running, it is never what the test waits for. A test that
must see something *not* happen waits for a later event that proves the
moment has passed, then checks; the comment at such a check names the event.
"""

import time


def wait_for(predicate, timeout, what, interval=0.02):
    """Calls predicate() every `interval` seconds until it returns a true
    value, and returns that value. After `timeout` seconds raises
    AssertionError naming `what` (a string, or a callable that makes one,
    called once at the failure so that it can show the state then)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for "
                                 f"{what() if callable(what) else what}")
        time.sleep(interval)
