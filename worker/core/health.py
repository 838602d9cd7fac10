"""Signs of life for supervisors: a liveness file for container health checks, sd_notify for systemd.

Both are fed by one ``Pulse``: the loop beats after every receive, the heartbeat after every successful
renewal (a three-hour job is alive as long as its lease is). Nothing happens when neither is configured.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def notify(socket_path: str | None, state: str) -> bool:
    """Send one sd_notify datagram (``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``); False if not sent."""
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


class Pulse:
    def __init__(self, liveness_file: str | None = None, notify_socket: str | None = None,
                 min_interval_s: float = 1.0, clock=time.monotonic):
        self._file = Path(liveness_file) if liveness_file else None
        self._socket = notify_socket
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._last: float | None = None

    def beat(self) -> None:
        """Record that the worker is alive (at most once per ``min_interval_s``)."""
        now = self._clock()
        if self._last is not None and now - self._last < self._min_interval_s:
            return
        self._last = now
        if self._file is not None:
            try:
                self._file.touch()
            except OSError as exc:
                log.warning("health.liveness_write_failed", path=str(self._file), error=str(exc))
        notify(self._socket, "WATCHDOG=1")

    def ready(self) -> None:
        notify(self._socket, "READY=1")
        self.beat()

    def stopping(self) -> None:
        notify(self._socket, "STOPPING=1")


def liveness_problem(path: str | None, max_age_s: float, now_s: float | None = None) -> str | None:
    """Why the worker does not look alive, or None when the liveness file is fresh enough."""
    if not path:
        return "LIVENESS_FILE is not set: nothing to check"
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return f"liveness file {path} does not exist (yet)"
    age_s = (time.time() if now_s is None else now_s) - mtime
    if age_s > max_age_s:
        return f"liveness file {path} is {age_s:.0f} s old (limit {max_age_s:.0f} s)"
    return None
