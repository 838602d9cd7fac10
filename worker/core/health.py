"""Signs of life for supervisors: a liveness file for container health checks, sd_notify for systemd.

Both are fed by one ``Liveness``: the loop beats after every receive, the heartbeat after every successful
renewal (a three-hour job is alive as long as its lease is). Nothing happens when neither is configured.
With an unreachable limit, every beat rewrites the file whole with when the queue and the store last
answered (``reached``), which ``worker.core.healthcheck`` judges beside the file's age.

``systemctl status`` shows the last ``STATUS=`` line: "idle", "working on message <id>", "draining: ...",
"stopping". ``STOPPING=1`` goes out once, as soon as a stop signal arrives, but never for a drain: on
``STOPPING=1`` systemd starts ``TimeoutStopSec`` and would SIGKILL a job that drains for hours.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from worker.core.healthcheck import CONTACT_PARTS, LIMIT_KEY, contact_lines, mark_unfit

if TYPE_CHECKING:  # `worker health` imports this module and needs none of the loop's
    from worker.core.loop import Activity

log = structlog.get_logger(__name__)


def notify(socket_path: str | None, state: str) -> bool:
    """Send one sd_notify datagram (``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``, ``STATUS=...``); False
    if not sent."""
    if not socket_path:
        return False
    address = "\0" + socket_path[1:] if socket_path.startswith("@") else socket_path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), address)
        return True
    except OSError as exc:  # a supervisor that went away must not take the worker with it
        log.warning("health.notify_failed", state=state, error=str(exc))
        return False


class Liveness:
    """What tells the outside the worker is alive: the liveness file (``worker health``, the container's
    check) and systemd's notify socket (READY, WATCHDOG=1), each beat at most every ``min_interval_s``."""

    def __init__(self, liveness_file: str | None = None, notify_socket: str | None = None,
                 min_interval_s: float = 1.0, clock=time.monotonic, max_age_s: float | None = None,
                 unreachable_after_s: float | None = None, wall=time.time):
        self._file = Path(liveness_file) if liveness_file else None
        # Written into the file at start, so the container's check needs no settings (worker.core.healthcheck).
        self._max_age_s = max_age_s
        # With it, every beat rewrites the file with when the queue and the store last answered.
        self._unreachable_after_s = unreachable_after_s
        self._wall = wall
        self._reached: dict[str, float] = {}
        self._unfit = False  # the file says unfit=: a beat only touches it from then on
        # The loop's thread and the heartbeat's both beat; they share the temp file's name.
        self._write_lock = threading.Lock()
        self._socket = notify_socket
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._last: float | None = None
        self._stopping_sent = False

    def beat(self) -> None:
        """Record that the worker is alive (at most once per ``min_interval_s``)."""
        now = self._clock()
        if self._last is not None and now - self._last < self._min_interval_s:
            return
        self._last = now
        if self._file is not None and self._unreachable_after_s is not None and not self._unfit:
            self._write_content()
        elif self._file is not None:
            try:
                self._file.touch()
            except OSError as exc:
                log.warning("health.liveness_write_failed", path=str(self._file), error=str(exc))
        notify(self._socket, "WATCHDOG=1")

    def reached(self, part: str) -> None:
        """``part`` ("queue" or "store") answered just now; written into the file at the next beat."""
        self._reached[part] = self._wall()

    def ready(self) -> None:
        # The start-up has just reached both (the queue's check, the store's open and clock check).
        for part in CONTACT_PARTS:
            self._reached.setdefault(part, self._wall())
        self._write_content()
        notify(self._socket, "READY=1")
        self.status("idle")
        self.beat()

    def _write_content(self) -> None:
        if self._file is None or (self._max_age_s is None and self._unreachable_after_s is None):
            return
        content = f"{LIMIT_KEY}{self._max_age_s:g}\n" if self._max_age_s is not None else ""
        if self._unreachable_after_s is not None:
            content += contact_lines(self._unreachable_after_s, dict(self._reached))
        temp = self._file.with_name(f".{self._file.name}.tmp-{os.getpid()}")
        with self._write_lock:
            try:
                temp.write_text(content, encoding="utf-8")
                os.replace(temp, self._file)
            except OSError as exc:
                temp.unlink(missing_ok=True)
                log.warning("health.liveness_write_failed", path=str(self._file), error=str(exc))

    def status(self, text: str) -> None:
        """The one-line state ``systemctl status`` shows (one line: systemd keeps what follows a newline
        as a separate assignment)."""
        notify(self._socket, "STATUS=" + " ".join(text.split()))

    def unfit(self, why: str) -> None:
        """The host is unfit (a job met a host fault): the health check fails from now on, however fresh
        the file (``worker.core.healthcheck.mark_unfit``)."""
        self._unfit = True
        if self._file is not None:
            with self._write_lock:  # after a beat's rewrite in flight, never before it
                mark_unfit(str(self._file), why)
        self.status(f"host unfit: {why}")

    def draining(self) -> None:
        # No STOPPING=1 here: see the module's docstring.
        self.status("draining: finishing the job in flight, taking no other")

    def stopping(self) -> None:
        """From the signal relay when SIGTERM/SIGINT arrives, and again when the loop ends; sent once.
        STATUS first, so STOPPING=1 is the last datagram a supervisor reads."""
        if self._stopping_sent:
            return
        self._stopping_sent = True
        self.status("stopping")
        notify(self._socket, "STOPPING=1")

    def announcing(self, inner: Activity | None) -> Activity:
        """``inner`` (task protection, or None off ECS) with the job's start and end shown as STATUS."""
        from worker.core.loop import NoActivity  # here: `worker health` never builds an activity

        return _Announcing(self, inner or NoActivity())


class _Announcing:
    def __init__(self, pulse: Liveness, inner: Activity):
        self._pulse, self.inner = pulse, inner

    def busy(self, for_at_most_s: float) -> None:
        # The loop binds the message id to the log context before it hears of the job: the same id the
        # logs carry, so STATUS points at the lines to read.
        message_id = structlog.contextvars.get_contextvars().get("message_id", "?")
        self._pulse.status(f"working on message {message_id}")
        self.inner.busy(for_at_most_s)

    def idle(self) -> None:
        self.inner.idle()
        self._pulse.status("idle")
