"""Finding and ending every process a stage started, including those that left its process group.

A stage runs in its own session, but a trainer may start further sessions (a daemonising helper, a
data loader that calls ``setsid``): such a process is outside the group a group signal reaches, and
once the stage's main process exits it is reparented to init, so it is no longer a descendant either.
It may still hold the stage's output pipe (the output reader never sees end-of-file) or a GPU.

So a stage's processes are recognised by any of three marks, whichever survived what they did:
- the stage's process group (everything that did not call ``setsid``/``setpgid``);
- a per-run token in the environment (``TOKEN_NAME``), inherited by every descendant that does not
  build its environment from scratch;
- an open descriptor on the stage's output pipe (exactly what would keep the reader waiting).

Why not ``prctl(PR_SET_CHILD_SUBREAPER)`` on the worker: it changes the whole worker process. Every
orphan of every child would become the worker's to reap, and reaping with ``waitpid(-1)`` takes exit
statuses that ``subprocess.Popen`` objects elsewhere wait for. The deployments run under an init
(docker --init, ECS initProcessEnabled) that already reaps what a killed stage leaves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TOKEN_NAME = "VOICE_WORKER_STAGE_RUN"
_POLL_S = 0.05
# SIGKILL cannot be ignored; a few rounds catch children forked between a scan and its signals.
_KILL_ROUNDS = 20


@dataclass(frozen=True)
class StageTree:
    """The marks of one stage run's processes: its group id, environment token and pipe inode."""

    pgid: int
    token: str
    pipe_inode: int | None = None
    proc_root: Path = Path("/proc")

    def members(self) -> set[int]:
        """Pids of the stage's live (non-zombie) processes; never the worker itself."""
        if not self.proc_root.is_dir():
            return {self.pgid} if _group_exists(self.pgid) else set()
        me = os.getpid()
        token = f"{TOKEN_NAME}={self.token}".encode()
        pipe = f"pipe:[{self.pipe_inode}]" if self.pipe_inode is not None else None
        found = set()
        for pid, fields in live_processes(self.proc_root):
            if pid == me:
                continue
            in_group = len(fields) >= 3 and int(fields[2]) == self.pgid
            if in_group or self._has_token(pid, token) or (pipe and self._holds(pid, pipe)):
                found.add(pid)
        return found

    def signal(self, signum: int) -> set[int]:
        """Send ``signum`` to the group and to every member found; returns the members found."""
        # The group first: it also reaches members that appear between the scan and the kills.
        _send(lambda: os.killpg(self.pgid, signum))
        members = self.members()
        for pid in members:
            _send(lambda pid=pid: os.kill(pid, signum))
        return members

    def _has_token(self, pid: int, token: bytes) -> bool:
        try:
            return token in (self.proc_root / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read (and so not ours to kill either)
            return False

    def _holds(self, pid: int, pipe: str) -> bool:
        try:
            with os.scandir(self.proc_root / str(pid) / "fd") as fds:
                return any(_readlink(fd.path) == pipe for fd in fds)
        except OSError:
            return False


def end_tree(proc: subprocess.Popen, tree: StageTree, grace_s: float) -> None:
    """SIGTERM every process of the stage, SIGKILL what is left after the grace; reap the main one."""
    tree.signal(signal.SIGTERM)
    deadline = time.monotonic() + max(0.0, grace_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None and not tree.members():
            return
        time.sleep(_POLL_S)
    for _ in range(_KILL_ROUNDS):
        if not tree.signal(signal.SIGKILL):
            break
        time.sleep(_POLL_S)
    proc.wait()


def live_processes(proc_root: Path = Path("/proc")) -> Iterator[tuple[int, list[str]]]:
    """(pid, the /proc stat fields after the command name) of every process that is not a zombie."""
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # The command name in parentheses may hold spaces; the fixed fields follow the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields and fields[0] not in ("Z", "X"):
            yield int(entry.name), fields


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _send(kill) -> None:
    try:
        kill()
    except (ProcessLookupError, PermissionError):
        pass
