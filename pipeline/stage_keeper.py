"""The stage keeper: ``python -m pipeline.stage_keeper PARENT_PID LIFELINE_FD GRACE_S -- ARGV...``.

A stage (and the dataset step) does not run as the worker's own child but under this small process,
so that no stage process outlives its worker, not even after ``kill -9`` of the worker:

- It asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), then checks
  ``getppid()`` against ``PARENT_PID``: a worker that died before the ``prctl`` would never send it.
- PDEATHSIG fires when the parent *thread* that forked the keeper ends, not the parent process. The
  worker starts stages from its main thread (the loop calls the handler there), where the two are
  the same; for any other caller the lifeline covers it: ``LIFELINE_FD`` is one end of a socket pair
  whose other end only the worker holds, so end-of-file on it means the worker is gone, whichever
  thread started the keeper.
- It is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a stage's orphans (a daemonising helper)
  become the keeper's children, not init's, and the keeper reaps them.
- The stage runs as the keeper's child in the keeper's process group (the keeper leads the session
  the worker gave it), so the worker's group mark still reaches every process that did not leave it.
  Its stdin is the keeper's: /dev/null, or the pipe on which the worker releases a held stage
  (``pipeline.stages.start_supervised``).
- When the worker dies, or on SIGTERM (the worker's stop), the keeper ends the whole tree, found as
  ``pipeline.proctree`` finds it (group, environment token, output pipe): SIGTERM, SIGKILL to what
  is left after ``GRACE_S``. When the stage exits by itself, the keeper ends whatever it left
  running the same way. Then it exits as the stage did: the same code, or the same signal.

The worker can ask it on the lifeline to send the stage's own process a signal (``signal <n>``: the
stage's checkpoint signal when a shutdown starts). The keeper does it, not the worker, because only
the stage's parent knows the pid is still the stage's: it has not reaped it yet.

It tells the worker on the lifeline whether the stage started (``started``) or could not be
(``failed <reason>``), and otherwise writes nothing: after the worker's death nobody reads the
stage's output pipe, and a write there would fail. It imports nothing beyond the standard library
and ``pipeline.proctree``, so it starts quickly.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time

from pipeline.proctree import TOKEN_NAME, StageTree

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STARTED = b"started\n"
FAILED = b"failed "
SIGNAL = b"signal "
_POLL_S = 0.5
_KILL_ROUNDS = 20
_KILL_POLL_S = 0.05


def keeper_argv(python: str, parent_pid: int, lifeline_fd: int, grace_s: float, argv: list[str]) -> list[str]:
    """The argv that runs ``argv`` under a keeper."""
    return [python, "-m", "pipeline.stage_keeper", str(parent_pid), str(lifeline_fd), repr(float(grace_s)),
            "--", *argv]


def parse_argv(argv: list[str]) -> tuple[int, int, float, list[str]]:
    """(parent pid, lifeline fd, grace in seconds, the stage's argv) from the keeper's arguments."""
    if len(argv) < 5 or argv[3] != "--":
        raise ValueError("usage: stage_keeper PARENT_PID LIFELINE_FD GRACE_S -- ARGV...")
    return int(argv[0]), int(argv[1]), max(0.0, float(argv[2])), argv[4:]


def exit_status_code(status: int) -> tuple[int | None, int | None]:
    """(exit code, None) or (None, signal number) of a ``waitpid`` status."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status), None


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


class Keeper:
    def __init__(self, parent_pid: int, lifeline: socket.socket, grace_s: float):
        self._parent_pid = parent_pid
        self._lifeline = lifeline
        self._grace_s = grace_s
        self._stage_pid: int | None = None
        self._stage_status: int | None = None
        self._requests = b""
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._wakeup = read_fd
        # Signals only wake the poll below; the loop decides. SIGCHLD: a child ended.
        signal.set_wakeup_fd(write_fd)
        self._terminate = False
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_terminate)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def _on_terminate(self, *_args) -> None:
        self._terminate = True

    def run(self, argv: list[str]) -> int | None:
        """The stage's ``waitpid`` status, or None when no stage was started."""
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self._parent_pid:
            return None  # the worker died before the prctl: start nothing
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        try:
            stage = subprocess.Popen(argv)  # stdin: the keeper's, which the worker chose
        except OSError as exc:
            self._tell(FAILED + (exc.strerror or str(exc)).encode(errors="replace") + b"\n")
            return None
        self._stage_pid = stage.pid
        # Reaped below with waitpid(-1): the keeper has no other children to mix up.
        stage.returncode = 0
        self._tell(STARTED)
        tree = StageTree(pgid=os.getpgid(0), token=os.environ.get(TOKEN_NAME, ""),
                         pipe_inode=_stdout_inode(), spared=frozenset({self._parent_pid}))
        while self._stage_status is None and not self._terminate:
            self._wait_for_event()
            self._reap()
        self._end_tree(tree)
        # Not reaped even after the SIGKILL rounds (it cannot be, short of a kernel fault): say killed.
        return self._stage_status if self._stage_status is not None else signal.SIGKILL

    def _tell(self, message: bytes) -> None:
        try:
            self._lifeline.sendall(message)
        except OSError:
            self._terminate = True  # the worker is already gone

    def _wait_for_event(self) -> None:
        poller = select.poll()
        poller.register(self._lifeline.fileno(), select.POLLIN | select.POLLHUP)
        poller.register(self._wakeup, select.POLLIN)
        for fd, _events in poller.poll(_POLL_S * 1000):
            if fd == self._wakeup:
                _drain(self._wakeup)
            else:
                self._read_lifeline()

    def _read_lifeline(self) -> None:
        """End-of-file: the worker is gone. Otherwise its requests, one per line."""
        try:
            data = self._lifeline.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._terminate = True
            return
        *lines, self._requests = (self._requests + data).split(b"\n")
        for line in lines:
            if line.startswith(SIGNAL) and line[len(SIGNAL):].isdigit():
                self._signal_stage(int(line[len(SIGNAL):]))

    def _signal_stage(self, signum: int) -> None:
        # Not reaped yet (no status), so the pid cannot have been reused by another process.
        if self._stage_pid is None or self._stage_status is not None:
            return
        try:
            os.kill(self._stage_pid, signum)
        except (OSError, ValueError):
            pass  # exited in between, or a number the kernel refuses: nothing to notify

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self._stage_pid:
                self._stage_status = status

    def _end_tree(self, tree: StageTree) -> None:
        """SIGTERM every process of the stage, SIGKILL what is left after the grace; reap as they end."""
        if not tree.signal(signal.SIGTERM, group=False) and self._stage_status is not None:
            return
        deadline = time.monotonic() + self._grace_s
        while time.monotonic() < deadline:
            self._reap()
            if self._stage_status is not None and not tree.members():
                return
            time.sleep(_KILL_POLL_S)
        for _ in range(_KILL_ROUNDS):
            self._reap()
            if not tree.signal(signal.SIGKILL, group=False) and self._stage_status is not None:
                break
            time.sleep(_KILL_POLL_S)
        self._reap()


def _stdout_inode() -> int | None:
    try:
        return os.fstat(1).st_ino
    except OSError:
        return None


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def exit_as(status: int) -> None:
    """End this process the way the stage ended: its exit code, or death by its signal."""
    code, signum = exit_status_code(status)
    if signum is None:
        assert code is not None  # exit_status_code sets exactly one of the two
        os._exit(code)
    sys.stdout.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the stage's core dump, if any, is its own
    signal.set_wakeup_fd(-1)
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL and SIGSTOP keep their default anyway
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    time.sleep(1.0)
    os._exit(128 + signum)  # a signal whose default is not to terminate: the shell's convention


def main(argv: list[str]) -> None:
    parent_pid, lifeline_fd, grace_s, command = parse_argv(argv)
    lifeline = socket.socket(fileno=lifeline_fd)
    os.set_inheritable(lifeline_fd, False)  # the stage must not hold the worker's lifeline open
    status = Keeper(parent_pid, lifeline, grace_s).run(command)
    lifeline.close()
    if status is None:
        os._exit(1)
    exit_as(status)


if __name__ == "__main__":
    main(sys.argv[1:])
