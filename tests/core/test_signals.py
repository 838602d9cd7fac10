"""Signals: a handler that takes no lock, so signals arriving together can never hang the worker."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

from worker.core.daemon import SignalRelay
from worker.core.loop import Worker
from worker.settings import load_settings

ROUNDS = 300
ROUND_LIMIT_S = 2.0


class Lines:
    """Reads a child's stdout line by line, each read bounded in time."""

    def __init__(self, fd: int):
        self._fd, self._buffer = fd, b""

    def next(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                return None
            chunk = os.read(self._fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


def spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_signal_pairs_close_together_never_hang_the_worker():
    """Two SIGTERMs 0-300 µs apart, 300 times over, each end run_worker with exit 0 within two seconds."""
    rng = random.Random(20240611)
    proc = subprocess.Popen([sys.executable, "-m", "tests.core.signal_rounds"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=os.getcwd())
    lines = Lines(proc.stdout.fileno())
    try:
        for round_no in range(ROUNDS):
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            assert lines.next(10 if round_no == 0 else ROUND_LIMIT_S) == "ready", f"round {round_no} never polled"
            gap_s = rng.uniform(0, 300e-6)
            os.kill(proc.pid, signal.SIGTERM)
            spin(gap_s)
            os.kill(proc.pid, signal.SIGTERM)
            done = lines.next(ROUND_LIMIT_S)
            assert done == "done 0", f"round {round_no}: no exit within {ROUND_LIMIT_S} s ({gap_s * 1e6:.0f} µs apart)"
        proc.stdin.close()
        assert proc.wait(5) == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_signal_handler_returns_while_the_shutdown_event_lock_is_held():
    """The handler returns at once even while the shutdown event's internal lock is held; the stop follows when it is free."""
    worker = Worker(load_settings({}).loop_config(), queue=None, handler=lambda message, lease: None)
    relay = SignalRelay(worker.stop)
    relay.install()
    try:
        # What the main thread holds inside Event.wait or Event.set when a signal interrupts it.
        with worker.shutdown.requested._cond:
            caller = threading.Thread(target=relay.on_signal, args=(signal.SIGTERM, None), daemon=True)
            caller.start()
            caller.join(1)
            assert not caller.is_alive(), "the handler waited for the event's lock"
            assert not worker.shutdown.requested.is_set()
        assert worker.shutdown.requested.wait(2)
    finally:
        relay.uninstall()


def test_two_signals_become_two_stop_requests_and_the_old_handlers_come_back():
    """Two SIGTERMs through the relay request the shutdown and hurry it; afterwards the previous handler is back."""
    before = signal.getsignal(signal.SIGTERM)
    worker = Worker(load_settings({}).loop_config(), queue=None, handler=lambda message, lease: None)
    relay = SignalRelay(worker.stop)
    relay.install()
    try:
        assert signal.getsignal(signal.SIGTERM) == relay.on_signal
        os.kill(os.getpid(), signal.SIGTERM)
        assert worker.shutdown.requested.wait(2) and not worker.shutdown.hurried.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert worker.shutdown.hurried.wait(2)
    finally:
        relay.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
    assert not [t for t in threading.enumerate() if t.name == "signal-relay"]
