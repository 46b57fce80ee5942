"""Killing a command at random moments of its run."""

import signal
import statistics
import subprocess
import time


def timed_run(argv, env):
    """Runs argv to the end (it must succeed); returns how long it took."""
    start = time.monotonic()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return time.monotonic() - start


def kill_after(argv, env, delay):
    """Starts argv, SIGKILLs it after `delay` seconds (None: never); returns
    whether it was still running then, and how long it ran."""
    start = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p.wait(timeout=120 if delay is None else delay)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
    return p.wait() == -signal.SIGKILL, time.monotonic() - start


def fractions(n, rng, reach=1.2):
    """n moments spread evenly (with jitter) over [0, reach] of a run."""
    return [(i + rng.random()) / n * reach for i in range(n)]


class RunLength:
    """How long an unkilled run takes: the probes' median at first, then the
    shortest run a trial saw finish. Kill moments are fractions of it, so
    probes slowed by a busy machine do not push the kills past the end of
    the runs that follow."""

    def __init__(self, probes):
        self.seconds = statistics.median(probes)

    def at(self, fraction):
        return None if fraction is None else fraction * self.seconds

    def kill(self, argv, env, fraction):
        """kill_after at that fraction of the run; True if it was still running."""
        killed, ran = kill_after(argv, env, self.at(fraction))
        if not killed:
            self.seconds = min(self.seconds, ran)
        return killed
