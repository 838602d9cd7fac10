"""Fleet presence: each worker keeps one small record saying it is alive and what it is doing.

A thread of its own writes the record every ``interval_s`` (the heartbeat interval), idle or busy, so
an idle worker is seen too; a job taken or finished wakes it to write at once (a stop or a drain
asked for shows as ``stopping`` from the next write). The core knows no store: the record goes to a
``PresenceSink`` the wiring injects (the voice records store implements it). A write that fails is a
warning and the next tick tries again: presence is for operators and must never stop the loop.

    state      idle | working | stopping | unfit
    since      when this state began (this host's clock; the start-up checked it against the store's)
    lastSeen   set by the sink, on the store's clock: the reader judges staleness on one clock

``close(remove=True)`` deletes the record on a clean exit; a worker that crashed or was killed leaves
its record behind, and readers mark it stale once ``lastSeen`` is older than a few intervals.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

import structlog

from worker.core.errors import WorkerError

if TYPE_CHECKING:
    from worker.core.loop import Activity

log = structlog.get_logger(__name__)

IDLE, WORKING, STOPPING, UNFIT = "idle", "working", "stopping", "unfit"
STATES = (IDLE, WORKING, STOPPING, UNFIT)


class PresenceSink(Protocol):
    """Where presence records live (the records store); lastSeen is the sink's to stamp."""

    def upsert_worker(self, presence: Mapping[str, object]) -> None: ...

    def remove_worker(self, worker_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Identity:
    """What does not change while the process lives."""

    worker_id: str
    host: str
    version: str
    device: str | None = None  # what the pipeline's stages train on, when it says


def state_of(busy: bool, stopping: bool, unfit: bool) -> str:
    """The one state a worker reports: unfit wins (the host is the problem), then a requested stop, then work."""
    if unfit:
        return UNFIT
    if stopping:
        return STOPPING
    return WORKING if busy else IDLE


class Presence:
    """The worker's presence record and the thread that writes it (see the module docstring).

    ``stopping()`` tells whether a stop or a drain was requested, ``unfit()`` whether a job found the host
    unfit (the loop's state; an unfit worker's record stays behind on exit, saying so, until it goes
    stale); ``on_written`` hears
    every successful write (the liveness file's store contact); ``now`` stamps ``since``.
    """

    def __init__(self, identity: Identity, sink: PresenceSink, *, interval_s: float,
                 stopping: Callable[[], bool] = lambda: False, unfit: Callable[[], bool] = lambda: False,
                 on_written: Callable[[], None] | None = None,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC),
                 wait: Callable[[threading.Event, float], object] = threading.Event.wait):
        self.identity = identity
        self._sink = sink
        self._interval_s = interval_s
        self._stopping, self._unfit = stopping, unfit
        self._on_written = on_written or (lambda: None)
        self._now, self._wait = now, wait
        self._lock = threading.Lock()
        self._job_id: str | None = None
        self._busy = False
        self._state = IDLE
        self._since = now()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    # --- what the loop tells it (the loop's Activity, through ``activity``)
    def busy(self, job_id: str | None) -> None:
        with self._lock:
            self._busy, self._job_id = True, job_id
        self._wake.set()

    def idle(self) -> None:
        with self._lock:
            self._busy, self._job_id = False, None
        self._wake.set()

    def activity(self, inner: Activity) -> Activity:
        """``inner`` with the job's start and end also told to this presence."""
        return _Tracking(self, inner)

    # --- the record
    def snapshot(self) -> dict[str, object]:
        """The record as the sink receives it (without lastSeen, which the sink stamps)."""
        with self._lock:
            state = state_of(self._busy, self._stopping(), self._unfit())
            if state != self._state:
                self._state, self._since = state, self._now()
            ident = self.identity
            return {"workerId": ident.worker_id, "host": ident.host, "version": ident.version,
                    "state": state, "jobId": self._job_id if state in (WORKING, STOPPING) else None,
                    "since": self._since, "device": ident.device, "intervalS": self._interval_s}

    def write(self) -> bool:
        """One write of the record; False (and a warning) when the sink failed."""
        try:
            self._sink.upsert_worker(self.snapshot())
        except WorkerError as exc:
            log.warning("presence.write_failed", error=str(exc), error_type=exc.error_type)
            return False
        self._on_written()
        return True

    # --- the thread
    def start(self) -> None:
        self.write()  # before the first receive: a worker shows from its start
        self._thread = threading.Thread(target=self._run, name="presence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wait(self._wake, self._interval_s)
            self._wake.clear()
            if self._closing:
                return
            try:
                self.write()
            except Exception as exc:  # noqa: BLE001 - a bug here must not end presence for the process
                log.exception("presence.crashed", error=f"{type(exc).__name__}: {exc}")

    def close(self, *, remove: bool) -> None:
        """Stop the thread; with ``remove`` (a clean exit, a fit host) delete the record, else write it
        once more so it says how the worker ended (unfit)."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self._interval_s))
        if remove and not self._unfit():
            try:
                self._sink.remove_worker(self.identity.worker_id)
            except WorkerError as exc:
                log.warning("presence.remove_failed", error=str(exc), error_type=exc.error_type)
            return
        self.write()


class _Tracking:
    def __init__(self, presence: Presence, inner: Activity):
        self._presence, self.inner = presence, inner

    def busy(self, for_at_most_s: float) -> None:
        # The loop binds the message's fields to the log context before it calls busy(): the job id the
        # logs carry is the one the record shows (None when the body named none).
        job_id = structlog.contextvars.get_contextvars().get("job_id")
        self._presence.busy(job_id if isinstance(job_id, str) else None)
        self.inner.busy(for_at_most_s)

    def idle(self) -> None:
        self.inner.idle()
        self._presence.idle()
