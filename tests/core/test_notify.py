"""sd_notify as systemd reads it: STATUS lines for idle, a job, a drain and a stop, and STOPPING=1 the
moment a stop signal arrives (never for a drain), read from a unix datagram socket standing in for
NOTIFY_SOCKET."""

from __future__ import annotations

import signal
import socket

import pytest
import structlog

from worker.core.daemon import install_signal_handlers
from worker.core.health import Liveness


class Supervisor:
    """The NOTIFY_SOCKET end systemd would hold: every datagram the worker sent, in order."""

    def __init__(self, path: str):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)

    def received(self, timeout_s: float = 0.05) -> list[str]:
        """What arrived so far; waits ``timeout_s`` for each next datagram before returning."""
        self._sock.settimeout(timeout_s)
        got = []
        while True:
            try:
                got.append(self._sock.recv(4096).decode())
            except TimeoutError:
                return got

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def supervisor(tmp_path):
    listening = Supervisor(str(tmp_path / "notify.sock"))
    yield listening
    listening.close()


def _pulse(supervisor) -> Liveness:
    return Liveness(None, supervisor.path)


class RecordingActivity:
    def __init__(self):
        self.calls = []

    def busy(self, for_at_most_s: float) -> None:
        self.calls.append(("busy", for_at_most_s))

    def idle(self) -> None:
        self.calls.append(("idle",))


class StoppableWorker:
    """A worker whose stop and drain are only recorded: the loop has not ended when they return."""

    def __init__(self, supervisor):
        self.supervisor, self.calls = supervisor, []

    def stop(self) -> None:
        self.calls.append(("stop", self.supervisor.received()))

    def drain(self) -> None:
        self.calls.append(("drain", self.supervisor.received()))


def test_ready_reports_idle_after_ready(supervisor):
    """READY=1 comes first and alone, then STATUS=idle and the first watchdog ping."""
    _pulse(supervisor).ready()
    assert supervisor.received() == ["READY=1", "STATUS=idle", "WATCHDOG=1"]


def test_a_job_shows_its_message_id_while_it_runs_and_idle_after(supervisor):
    """busy() says which message is being worked on (the id the logs carry), idle() says idle, and the
    inner activity (task protection) hears both."""
    inner = RecordingActivity()
    activity = _pulse(supervisor).announcing(inner)
    structlog.contextvars.bind_contextvars(message_id="m-123")
    try:
        activity.busy(3600.0)
    finally:
        structlog.contextvars.unbind_contextvars("message_id")
    activity.idle()
    assert supervisor.received() == ["STATUS=working on message m-123", "STATUS=idle"]
    assert inner.calls == [("busy", 3600.0), ("idle",)]


def test_stopping_sends_status_then_stopping_once(supervisor):
    """STATUS=stopping then STOPPING=1, and a second stopping() (the loop's end after the signal's) sends nothing."""
    pulse = _pulse(supervisor)
    pulse.stopping()
    pulse.stopping()
    assert supervisor.received() == ["STATUS=stopping", "STOPPING=1"]


def test_a_status_is_one_line(supervisor):
    """A newline in a status cannot smuggle a second assignment (say STOPPING=1) into the datagram."""
    _pulse(supervisor).status("bad\nSTOPPING=1")
    assert supervisor.received() == ["STATUS=bad STOPPING=1"]


def test_sigterm_sends_stopping_before_the_loop_has_ended(supervisor):
    """The stop signal's relay sends STOPPING=1 before it asks the worker to stop, not when run() returns."""
    worker = StoppableWorker(supervisor)
    relay = install_signal_handlers(worker, _pulse(supervisor))
    try:
        relay.on_signal(signal.SIGTERM, None)
    finally:
        relay.uninstall()  # joins the relay thread: the call has been made
    assert worker.calls == [("stop", ["STATUS=stopping", "STOPPING=1"])]


def test_a_drain_reports_draining_without_stopping(supervisor):
    """SIGUSR2 shows STATUS=draining but never STOPPING=1, which would start systemd's stop timeout
    and SIGKILL a job draining for hours."""
    worker = StoppableWorker(supervisor)
    relay = install_signal_handlers(worker, _pulse(supervisor))
    try:
        relay.on_signal(signal.SIGUSR2, None)
    finally:
        relay.uninstall()
    (call,) = worker.calls
    assert call[0] == "drain"
    assert [d.split(":")[0] for d in call[1]] == ["STATUS=draining"]
    assert supervisor.received() == []
