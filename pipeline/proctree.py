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
statuses that ``subprocess.Popen`` objects elsewhere wait for. The stage keeper
(``pipeline.stage_keeper``), a process of its own between the worker and the stage, is the subreaper
instead; the deployments also run under an init (docker --init, ECS initProcessEnabled).

Every stage process also carries its job's mark (``JOB_NAME``: the job's work directory, so one
host's deployments that share a job id stay apart) and its attempt (``ATTEMPT_NAME``): a
worker that is about to start a step of a job first ends whatever process of an older attempt of that
job is still alive on the host (``end_job_survivors``), such as the trainer of a worker that was
stopped (SIGSTOP) or whose keeper could not outlive it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

TOKEN_NAME = "VOICE_WORKER_STAGE_RUN"
JOB_NAME = "VOICE_WORKER_JOB"
ATTEMPT_NAME = "VOICE_WORKER_ATTEMPT"
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
    # Never members: the keeper's parent (the worker) reads the same pipe the stage writes.
    spared: frozenset[int] = frozenset()

    def members(self) -> set[int]:
        """Pids of the stage's live (non-zombie) processes; never this process or a spared one."""
        if not self.proc_root.is_dir():
            return {self.pgid} if _group_exists(self.pgid) else set()
        me = os.getpid()
        token = f"{TOKEN_NAME}={self.token}".encode()
        pipe = f"pipe:[{self.pipe_inode}]" if self.pipe_inode is not None else None
        found = set()
        for pid, fields in live_processes(self.proc_root):
            if pid == me or pid in self.spared:
                continue
            in_group = len(fields) >= 3 and int(fields[2]) == self.pgid
            if in_group or self._has_token(pid, token) or (pipe and self._holds(pid, pipe)):
                found.add(pid)
        return found

    def signal(self, signum: int, *, group: bool = True) -> set[int]:
        """Send ``signum`` to the group and to every member found; returns the members found.

        ``group=False`` is for a caller inside the group (the keeper), which must not signal itself.
        """
        # The group first: it also reaches members that appear between the scan and the kills.
        if group:
            _send(lambda: os.killpg(self.pgid, signum))
        members = self.members()
        for pid in members:
            _send(lambda pid=pid: os.kill(pid, signum))
        return members

    def _has_token(self, pid: int, token: bytes) -> bool:
        return has_env_entry(self.proc_root, pid, token)

    def _holds(self, pid: int, pipe: str) -> bool:
        try:
            with os.scandir(self.proc_root / str(pid) / "fd") as fds:
                return any(_readlink(fd.path) == pipe for fd in fds)
        except OSError:
            return False


def end_tree(proc: subprocess.Popen, tree: StageTree, grace_s: float) -> bool:
    """SIGTERM every process of the stage, SIGKILL what is left after the grace; reap the main one.

    Returns whether SIGKILL was needed (something outlived the grace)."""
    tree.signal(signal.SIGTERM)
    deadline = time.monotonic() + max(0.0, grace_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None and not tree.members():
            return False
        time.sleep(_POLL_S)
    killed = False
    for _ in range(_KILL_ROUNDS):
        if not tree.signal(signal.SIGKILL):
            break
        killed = True
        time.sleep(_POLL_S)
    proc.wait()
    return killed


def _environ(proc_root: Path, pid: int) -> list[bytes]:
    """Process ``pid``'s environment entries; none when it is gone, or not ours to read (and so not
    ours to kill either)."""
    try:
        return (proc_root / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return []


def has_env_entry(proc_root: Path, pid: int, entry: bytes) -> bool:
    """Whether process ``pid``'s environment holds exactly ``entry`` (``NAME=value``)."""
    return entry in _environ(proc_root, pid)


def env_value(proc_root: Path, pid: int, name: str) -> str | None:
    """The value of ``name`` in process ``pid``'s environment, or None."""
    prefix = f"{name}=".encode()
    return next((e[len(prefix):].decode(errors="replace") for e in _environ(proc_root, pid)
                 if e.startswith(prefix)), None)


def job_processes(job_mark: str, proc_root: Path = Path("/proc")) -> set[int]:
    """Live processes on this host that carry ``job_mark`` (``JOB_NAME``) in their environment; never this one."""
    me, entry = os.getpid(), f"{JOB_NAME}={job_mark}".encode()
    return {pid for pid, _ in live_processes(proc_root) if pid != me and has_env_entry(proc_root, pid, entry)}


def end_job_survivors(job_mark: str, grace_s: float, proc_root: Path = Path("/proc"),
                      give_up_s: float = 10.0, spare: Callable[[int], bool] = lambda _pid: False) -> set[int]:
    """End every live process of ``job_mark`` (SIGTERM, SIGKILL after the grace) and wait until all are gone.

    Returns the pids found; raises ``OSError`` naming those still alive ``give_up_s`` after the
    first SIGKILL (a process stuck in uninterruptible sleep): better no new attempt than two.
    """
    def find() -> set[int]:
        return {pid for pid in job_processes(job_mark, proc_root) if not spare(pid)}

    found = find()
    if not found:
        return found
    for pid in found:
        _send(lambda pid=pid: os.kill(pid, signal.SIGTERM))
        # A stopped survivor (its worker was SIGSTOPped) acts on the SIGTERM only once continued.
        _send(lambda pid=pid: os.kill(pid, signal.SIGCONT))
    deadline = time.monotonic() + max(0.0, grace_s)
    left = find()
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        left = find()
    give_up = time.monotonic() + give_up_s
    while left:
        for pid in left:
            _send(lambda pid=pid: os.kill(pid, signal.SIGKILL))
        if time.monotonic() >= give_up:
            raise OSError(f"processes {sorted(left)} of an earlier attempt of job {job_mark} did not end")
        time.sleep(_POLL_S)
        left = find()
    return found


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
