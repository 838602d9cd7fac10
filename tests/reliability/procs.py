"""Worker processes for the reliability tests: `python -m worker run`, its JSON log, and a hard kill.

A kill here stands for what a power cut, an OOM kill of the container or ``systemctl kill`` does:
SIGKILL to the worker and to every process it started (the stage runner puts each stage in its own
session, so only a walk of the process tree finds them; systemd and ECS find them by cgroup).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.stages import live_processes
from tests.reliability.stack import REPO


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def _parents() -> dict[int, int]:
    return {pid: int(fields[1]) for pid, fields in live_processes() if len(fields) > 1}


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` in the process tree."""
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        found.extend(children)
        frontier.extend(children)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X")


class WorkerProcess:
    """One daemon process; its stderr (JSON log lines) goes to ``log_path``."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.env, self.log_path = env, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker", "run"], env=self.env, cwd=REPO,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_tree(self) -> list[int]:
        """SIGKILL the worker and everything it started, as a cgroup stop would; returns the children killed."""
        children = descendants(self.pid)
        os.kill(self.pid, signal.SIGKILL)
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        wait_until(lambda: not any(is_alive(c) for c in children), 10, "the killed stage processes to end")
        return children

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM and wait for the exit code."""
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            raise AssertionError(f"worker {self.pid} did not stop within {timeout_s} s of SIGTERM") from None

    def ensure_dead(self) -> None:
        """Cleanup for any path out of a test: nothing this test started may outlive it."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill_tree()

    def events(self) -> list[dict]:
        """The structured log events the worker wrote (non-JSON lines, e.g. tracebacks, are kept as text)."""
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "<text>", "text": line}
            events.append(event if isinstance(event, dict) else {"event": "<text>", "text": line})
        return events

    def event_names(self) -> list[str]:
        return [e.get("event", "") for e in self.events()]
