"""Running a Worker as a process: signals in, an exit code out.

A Python signal handler runs on the main thread between any two bytecodes, also while that thread
holds a lock: the one inside a ``threading.Event`` it is waiting on or setting, say. A handler that
takes such a lock can deadlock the process for good (two SIGTERMs close together did, and one during
the main thread's ``Event.wait`` can), leaving the job leased until SIGKILL. So the handler takes no
lock: it writes one byte to a pipe (the signal's number), and a relay thread turns each byte into
its call: ``Worker.stop()`` for SIGTERM and SIGINT, ``Worker.drain()`` for SIGUSR2.

The daemon installs its relay before its start-up (``cmd_run``): the queue check, the store's connect
retries and the clock check take seconds to minutes, and a signal then must not meet its default
action, which ends the process for SIGUSR1 and SIGUSR2 (and a restart by ``Restart=on-failure`` would
undo the drain). Until the worker exists, ``Requests`` keeps what was asked for; the start-up ends at
its next ``wait`` and the process exits 0, having received nothing.

Exit codes: 0 after a requested shutdown or a drain, 1 when the loop ended for any other reason, 2
when the settings cannot work, 7 when the host cannot (a host check at start-up failed: the base
model, the trainer's GPU, the work file system; no message was received; or a job met a host fault
mid-way, ``HostFault``: its message was released to another host, and this worker took no other).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import structlog

from worker.core.health import Liveness
from worker.core.loop import Worker

log = structlog.get_logger(__name__)

EXIT_OK, EXIT_CRASHED, EXIT_CONFIG = 0, 1, 2
# Not a settings problem: the same settings may work on another host, or on this one once it is fixed
# (a base model fetched, a GPU back). 3 to 6 are the operator commands' own codes.
EXIT_HOST_UNFIT = 7

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Finish the job in flight, however long it takes (up to its time limit), take no other, exit 0.
DRAIN_SIGNAL = signal.SIGUSR2
# Print every thread's stack, the worker running on.
STACKS_SIGNAL = signal.SIGUSR1
# What signal.signal returns and takes back: a callable, SIG_DFL/SIG_IGN, or None (set outside Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalRelay:
    """SIGTERM and SIGINT in, one ``stop()`` call per signal out, from a thread of its own; with
    ``drain``, SIGUSR2 in, one ``drain()`` call out."""

    def __init__(self, stop: Callable[[], None], drain: Callable[[], None] | None = None,
                 stacks: Callable[[], None] | None = None):
        self._calls: dict[int, Callable[[], None]] = dict.fromkeys(STOP_SIGNALS, stop)
        if drain is not None:
            self._calls[DRAIN_SIGNAL] = drain
        if stacks is not None:
            self._calls[STACKS_SIGNAL] = stacks
        self._read_fd, self._write_fd = os.pipe()
        # A full pipe must not block the handler: 64 KiB of unread signals already mean "hurry".
        os.set_blocking(self._write_fd, False)
        self._previous: dict[int, Handler] = {}
        self._thread = threading.Thread(target=self._relay, name="signal-relay", daemon=True)

    def on_signal(self, signum, _frame) -> None:
        """The signal handler: one write to the pipe, nothing that can wait on another thread."""
        try:
            os.write(self._write_fd, bytes((signum,)))  # signal numbers fit a byte
        except BlockingIOError:
            pass

    def install(self) -> None:
        for sig in self._calls:
            self._previous[sig] = signal.signal(sig, self.on_signal)
        self._thread.start()  # a signal before this waits in the pipe

    def uninstall(self) -> None:
        """Put the previous handlers back, then end the relay thread and close the pipe."""
        for sig, previous in self._previous.items():
            # None: a handler set outside Python, which cannot be put back; the default is the nearest.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        # Only now: a handler writing to a closed (or reused) descriptor number would be worse than none.
        os.close(self._write_fd)
        self._thread.join()
        os.close(self._read_fd)

    def _relay(self) -> None:
        while chunk := os.read(self._read_fd, 64):  # b"" once uninstall closed the write end
            for signum in chunk:
                log.info("worker.signal", signal=signal.Signals(signum).name)
                try:
                    self._calls[signum]()
                except Exception as exc:  # the relay must outlive a failing call, or later signals go unheard
                    log.error("worker.stop_failed", signal=signal.Signals(signum).name,
                              error=f"{type(exc).__name__}: {exc}")


class StartUpStopped(Exception):
    """A stop or a drain was requested before the worker existed: the start-up ends, exit 0."""

    def __init__(self, reason: str):
        super().__init__(f"a {reason} was requested during the start-up")
        self.reason = reason


class Requests:
    """Stop and drain requests from the relay, kept until there is a worker to hand them to.

    Before ``attach`` a request is kept, and the start-up's next ``wait`` raises ``StartUpStopped``;
    ``attach`` hands the kept ones to the worker in the order they came, and every later one goes to
    it at once. Called from the relay thread (and ``attach`` from the main thread), never from a
    signal handler: it takes a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made = threading.Event()
        self._kept: list[str] = []
        self._worker: Worker | None = None
        self._pulse: Liveness | None = None

    def stop(self) -> None:
        self._request("shutdown")

    def drain(self) -> None:
        self._request("drain")

    @property
    def reason(self) -> str | None:
        """What the start-up was asked for, a shutdown winning over a drain; None when nothing was."""
        with self._lock:
            return ("shutdown" if "shutdown" in self._kept else "drain") if self._kept else None

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``, or raise ``StartUpStopped`` as soon as a stop or drain was requested."""
        if self._made.wait(seconds) and (reason := self.reason):
            raise StartUpStopped(reason)

    def attach(self, worker: Worker, pulse: Liveness | None = None) -> None:
        """From now on requests go to ``worker``, the kept ones first; with a ``pulse``, systemd hears
        STOPPING=1 (or the drain's STATUS) the moment a signal arrives, not when the loop ends."""
        with self._lock:
            self._worker, self._pulse = worker, pulse
            for request in self._kept:
                self._tell(request)

    def _request(self, request: str) -> None:
        with self._lock:
            if self._worker is not None:
                self._tell(request)
                return
            self._kept.append(request)
            # The line the worker writes for a request, with no worker yet to write it.
            log.info("worker.shutdown_requested" if request == "shutdown" else "worker.drain_requested",
                     during="start-up")
        self._made.set()

    def _tell(self, request: str) -> None:
        assert self._worker is not None
        if request == "shutdown":
            if self._pulse is not None:
                self._pulse.stopping()
            self._worker.stop()
        else:
            if self._pulse is not None:
                self._pulse.draining()
            self._worker.drain()


def relay_signals(requests: Requests, *, json_stacks: bool = False) -> SignalRelay:
    """Route SIGTERM/SIGINT to ``requests.stop`` and SIGUSR2 to ``requests.drain`` through a relay;
    ``uninstall()`` it when the worker is done.

    `kill -USR1 <pid>` prints every thread's stack to stderr: the way to see where a worker that does
    not stop (or start) is stuck, without stopping it. With ``json_stacks`` (LOG_FORMAT=json) as one
    log line (``worker.stacks``) from the relay, so the log stays JSON; otherwise as faulthandler's
    text, which it writes from the signal handler itself and so also for a process whose threads are
    all stuck in C code holding the GIL (for that case in JSON mode: ``py-spy dump --pid``)."""
    relay = SignalRelay(requests.stop, requests.drain, stacks=log_stacks if json_stacks else None)
    relay.install()
    if not json_stacks:
        faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
    return relay


def install_signal_handlers(worker: Worker, pulse: Liveness | None = None, *, json_stacks: bool = False) -> SignalRelay:
    """``relay_signals`` for a worker that already exists: SIGTERM/SIGINT to ``worker.stop``, SIGUSR2 to
    ``worker.drain``, with ``pulse`` told first (``Requests.attach``)."""
    requests = Requests()
    requests.attach(worker, pulse)
    return relay_signals(requests, json_stacks=json_stacks)


def log_stacks() -> None:
    """Every thread's stack as one ``worker.stacks`` log line (innermost frame last, as in a traceback)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    threads = [{"thread": names.get(ident, str(ident)),
                "stack": [f"{frame.filename}:{frame.lineno} in {frame.name}"
                          for frame in traceback.extract_stack(top)]}
               for ident, top in sys._current_frames().items()]
    log.warning("worker.stacks", threads=threads)


def run_worker(worker: Worker, close: Callable[[], None] | None = None, pulse: Liveness | None = None, *,
               json_stacks: bool = False, requests: Requests | None = None) -> int:
    """Run until shutdown, then leave in this order:
    1. the loop has settled its last message (``run`` returned: deleted, released or left to SQS;
       after a drain, the job in flight ran to its end first);
    2. tell systemd we are stopping (unless the stop signal already did);
    3. close the store and other clients;
    4. put the previous signal handlers back;
    5. return the exit code: 0 for a requested stop or a drain, 7 when a job found the host unfit
       (the liveness file says ``unfit=``, so the health check fails too), 1 for anything else.

    With ``requests``, the relay was installed before the start-up by the caller, who uninstalls it
    (step 4); what was requested since reaches the worker before its first receive."""
    pulse = pulse or Liveness()
    code = EXIT_OK
    relay = None
    if requests is None:
        relay = install_signal_handlers(worker, pulse, json_stacks=json_stacks)
    else:
        requests.attach(worker, pulse)
    try:
        pulse.ready()
        log.info("worker.started")
        try:
            worker.run()
        except Exception as exc:
            log.exception("worker.crashed", error=f"{type(exc).__name__}: {exc}")
            code = EXIT_CRASHED
        if code == EXIT_OK and worker.unfit is not None:
            code = EXIT_HOST_UNFIT
            pulse.unfit(worker.unfit)
        pulse.stopping()
        if close is not None:
            try:
                close()
            except Exception as exc:  # closing must not turn a clean stop into a crash
                log.error("worker.close_failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        if relay is not None:
            relay.uninstall()
    return code
