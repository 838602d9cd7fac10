"""One download's deadline and stop signal, enforced in every phase of the request.

A download can block where no loop of ours gets to check anything: in the resolver (getaddrinfo), in
connect(), in the TLS handshake, while sending, while waiting for the status line and headers, and in
each body read. A per-read socket timeout does not bound the whole, since a server that drips one
header line or one byte at a time never lets a single read time out.

So each fetch runs under a ``Guard``, which, when the deadline passes or the stop signal is set,
shuts down every socket the download opened. A blocked connect, handshake, send or read on a
shut-down socket returns at once, whichever library made it. One watchdog thread for the process
(``_Watchdog``) looks at every open guard each ``POLL_S``: a step's files in flight cost one thread
between them instead of one started and joined per file, and a stop they all answer to cuts them
all in the same sweep.

The guard learns the sockets from Python's audit events, for threads inside ``Guard.own_sockets``
only: ``socket.connect`` hands over a new socket before it connects, ``http.client.send`` a
kept-alive one before a request goes out. That covers urllib3 (https) and botocore (s3) alike
without reaching into either one's internals. Once fired, the guard refuses new connections and
sends from those threads.

Calls that block without a socket of ours, getaddrinfo and botocore's backoff sleeps between retries,
run through ``Guard.call`` in a helper thread, which the caller leaves behind when the guard fires;
the helper ends when the call returns (its socket was cut; a resolver gives up on its own).

The audit hook is process-wide and cannot be removed; for every event outside a guarded thread it
costs one string comparison and one dict look-up.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, TypeVar

from worker.core.stop import StopSignal

# How often the watchdog looks at the clock and the stop signal, and how often a waiting caller looks
# at the guard: the worst-case delay between a stop and the end of the download.
POLL_S = 0.05

T = TypeVar("T")

# How long the watchdog thread stays up with no guard open: a job's files come one after another on
# each of the step's threads, and a short gap between two of them need not end and start a thread.
WATCHDOG_LINGER_S = 1.0

_GUARDED: dict[int, Guard] = {}  # thread ident -> the guard owning that thread's sockets
_hook_lock = threading.Lock()
_hook_installed = False


class CutReason(StrEnum):
    """Why a guard fired."""

    STOP = "stop"  # the stop signal was set: the download ends as the stop's ``Stopped``
    DEADLINE = "deadline"  # the download's own deadline passed


class Cut(Exception):
    """The guard fired for ``reason``. The downloader turns it into its error."""

    def __init__(self, reason: CutReason):
        super().__init__(f"download cut: {reason}")
        self.reason = reason


class Guard:
    """The watchdog for one fetch; use as a context manager around the whole fetch."""

    def __init__(self, remaining_s: Callable[[], float], stop: StopSignal | None):
        self.remaining_s = remaining_s
        self.stop = stop
        self.fired: CutReason | None = None
        self._lock = threading.Lock()
        self._sockets: dict[int, socket.socket] = {}  # socket inode -> our duplicate of it
        self._helpers = 0  # helper threads of ``call`` still running, left behind or not
        self._released = False
        self._closed = False  # the fetch is over: the watchdog no longer fires this guard

    def __enter__(self) -> Guard:
        _install_audit_hook()
        _WATCHDOG.watch(self)
        return self

    def __exit__(self, *_exc) -> None:
        _WATCHDOG.forget(self)
        with self._lock:
            # The watchdog may be in a sweep that still holds this guard: once closed, it leaves it
            # alone, as the joined thread of old did (the connection may be another download's now).
            self._closed = True
        self.release()

    def check(self) -> None:
        """Raise ``Cut`` when the guard fired, a stop was requested or the deadline has passed."""
        if self.fired is None:
            if self.stop is not None and self.stop.is_set():
                self._fire(CutReason.STOP)
            elif self.remaining_s() <= 0:
                self._fire(CutReason.DEADLINE)
        if self.fired is not None:
            raise Cut(self.fired)

    @contextmanager
    def own_sockets(self) -> Iterator[None]:
        """Hand every socket this thread connects or sends on, until the block ends, to the guard."""
        ident = threading.get_ident()
        previous = _GUARDED.get(ident)
        _GUARDED[ident] = self
        try:
            yield
        finally:
            if previous is None:
                _GUARDED.pop(ident, None)
            else:
                _GUARDED[ident] = previous

    def call(self, fn: Callable[[], T], discard: Callable[[T], None] | None = None) -> T:
        """``fn()`` in a helper thread that owns its sockets; ``Cut`` as soon as the guard fires.

        A call left behind passes its late result to ``discard``, so nothing it opened stays open.
        """
        outcome: dict[str, Any] = {}  # flags, and the call's value or exception
        finished = threading.Event()
        lock = threading.Lock()

        def run() -> None:
            try:
                with self.own_sockets():
                    try:
                        outcome["value"] = fn()
                    except BaseException as exc:  # handed over to the caller, who re-raises it
                        outcome["error"] = exc
                with lock:
                    outcome["finished"] = True
                    # Finished after the firing: the guard has shut its sockets down under it, so what
                    # it returns is not to be trusted, and the caller gets the cut, as the deadline says.
                    outcome["after_cut"] = self.fired is not None
                    left_behind = "abandoned" in outcome or outcome["after_cut"]
                finished.set()
                if left_behind and "value" in outcome and discard is not None:
                    discard(outcome["value"])
            finally:
                self._helper_done()

        with self._lock:
            self._helpers += 1
        threading.Thread(target=run, name="download-call", daemon=True).start()
        while not finished.wait(POLL_S):
            try:
                self.check()
            except Cut:
                with lock:
                    if "finished" not in outcome:
                        outcome["abandoned"] = True
                        raise
                break  # it finished at the same moment: the result is ours after all
        if outcome.get("after_cut"):
            self.check()  # raises the cut (the call's value went to ``discard``)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def adopt(self, sock: socket.socket) -> None:
        """Keep a duplicate of ``sock`` to shut down on firing; refuse the socket once fired."""
        with self._lock:
            if self.fired is not None:
                raise ConnectionAbortedError(errno.ECONNABORTED, f"download cut: {self.fired}")
            try:
                fd = sock.fileno()
                if fd < 0:
                    return
                # The inode names the socket itself, which a reused fd number would not.
                inode = os.fstat(fd).st_ino
                if inode not in self._sockets:
                    # A duplicate, because the TLS wrapper detaches the socket object it was given.
                    self._sockets[inode] = socket.socket(fileno=os.dup(fd))
            except OSError:
                return  # already closed: nothing left to cut

    def release(self) -> None:
        """Forget the sockets adopted so far (their connections are closed or handed back).

        While a helper left behind still runs, its sockets stay adopted: the last helper to end
        releases them (``_helper_done``).
        """
        with self._lock:
            self._released = True
            if self._helpers:
                return
            sockets, self._sockets = list(self._sockets.values()), {}
        for dup in sockets:
            dup.close()

    def _helper_done(self) -> None:
        """A helper thread ended. After a firing, shut its sockets down once more: a socket whose
        connect was still in flight when the guard fired could not be shut down then, and the
        library may not close it after the refused send; now it is connected, and this ends it."""
        with self._lock:
            self._helpers -= 1
            last = self._helpers == 0
            sockets = list(self._sockets.values()) if self.fired is not None else []
        for dup in sockets:
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if last and self._released:
            self.release()

    def _look(self) -> None:
        """The watchdog's look at this guard: fire it when its stop is set or its deadline passed."""
        if self.fired is not None:
            return
        if self.stop is not None and self.stop.is_set():
            self._fire(CutReason.STOP, from_watchdog=True)
        elif self.remaining_s() <= 0:
            self._fire(CutReason.DEADLINE, from_watchdog=True)

    def _fire(self, reason: CutReason, *, from_watchdog: bool = False) -> None:
        with self._lock:
            if self.fired is not None or (from_watchdog and self._closed):
                return
            self.fired = reason
            sockets = list(self._sockets.values())
        for dup in sockets:
            try:
                # Shutdown acts on the socket, not the descriptor: the library's blocked call wakes up.
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected (yet or any more): a connect in progress still fails


class _Watchdog:
    """The one thread that fires the open guards: started with the first, ended a while after the last."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._guards: set[Guard] = set()
        self._thread: threading.Thread | None = None

    def watch(self, guard: Guard) -> None:
        with self._cond:
            self._guards.add(guard)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="download-guard", daemon=True)
                self._thread.start()
            else:
                self._cond.notify()  # the thread may be lingering with nothing to watch

    def forget(self, guard: Guard) -> None:
        with self._cond:
            self._guards.discard(guard)

    def _run(self) -> None:
        try:
            self._sweep_until_idle()
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None  # it died: the next guard to open starts another

    def _sweep_until_idle(self) -> None:
        while True:
            with self._cond:
                if not self._guards:
                    self._cond.wait(WATCHDOG_LINGER_S)
                    if not self._guards:
                        self._thread = None
                        return
                guards = list(self._guards)
            for guard in guards:
                guard._look()
            # A plain sleep, not the condition: a guard opening does not need an early sweep.
            time.sleep(POLL_S)

    def _reset_after_fork(self) -> None:
        # A forked child has none of the parent's threads; its guards (if any) need a thread of its own.
        self._cond = threading.Condition()
        self._guards = set()
        self._thread = None


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG._reset_after_fork)


def guard_of_this_thread() -> Guard | None:
    return _GUARDED.get(threading.get_ident())


def _on_audit(event: str, args: tuple) -> None:
    if event == "socket.connect":
        sock = args[0]
    elif event == "http.client.send":
        sock = getattr(args[0], "sock", None)
    else:
        return
    guard = _GUARDED.get(threading.get_ident())
    if guard is not None and sock is not None:
        guard.adopt(sock)


def _install_audit_hook() -> None:
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            sys.addaudithook(_on_audit)
            _hook_installed = True
