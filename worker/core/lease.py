"""The heartbeat: keeps one received message invisible while the handler works on it.

One thread per message. Every ``interval_s`` it sets the message's visibility back to the full timeout
(a reset, never an addition), then runs the handler's renewal callbacks (the store's lease, the cancel
check) on the same tick. It also watches these clocks for the handler, which waits on ``lease.stop``:

- the visibility deadline: no successful renewal before it means another consumer may already hold the
  message, so the lease is lost;
- the job time limit, measured from the receipt;
- the shutdown grace, once a shutdown was requested;
- the hard cap, when the loop sets one (``wind_down_s``): the time limit plus the stage runner's stop
  grace (``settings.stage_stop_grace_s``, its SIGTERM to SIGKILL wait) plus one heartbeat interval.
  A handler told to stop at the time limit has had every chance to stop by then; past the cap the
  heartbeat stops renewing (SQS and the store callbacks alike) whatever the handler does, and the
  lease is lost. The loop then leaves the message alone and SQS redelivers it once its visibility
  lapses, instead of a hung job keeping it forever.

``close()`` stops the thread through an event and joins it. The loop calls it before any delete or
visibility change, so no renewal can race the acknowledgement.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable

import structlog

from worker.core.broker import Message, Queue
from worker.core.core_config import LeaseTimings
from worker.core.errors import LeaseLost, Stopped, WorkerError
from worker.core.metrics import HEARTBEAT_FAILURES, NULL_METRICS, Metrics
from worker.core.stop import StopSignal

log = structlog.get_logger(__name__)


class Shutdown:
    """Shutdown requests: the first starts the grace period, a second one ends it at once.

    Every running lease registers its wake-up event here so it notices without polling. ``request``
    takes locks, so it must never run inside a signal handler: the daemon's signal relay calls it from
    a thread of its own.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.hurried = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[threading.Event] = []
        self._signalled = False  # a request that was not a notice came already

    def request(self, *, notice: bool = False) -> None:
        """Start the shutdown; a second request ends the grace. ``notice``: a request that no one sent
        twice on purpose (the spot watch's): it starts the grace but is never the first of two, so the
        SIGTERM that follows a spot notice still gets the whole grace."""
        with self._lock:
            if not notice:
                if self._signalled:
                    self.hurried.set()
                self._signalled = True
            self.requested.set()
            listeners = tuple(self._listeners)
        for wake in listeners:
            wake.set()

    def listen(self, wake: threading.Event) -> None:
        with self._lock:
            self._listeners.append(wake)

    def unlisten(self, wake: threading.Event) -> None:
        with self._lock:
            if wake in self._listeners:
                self._listeners.remove(wake)


class Lease:
    def __init__(
        self,
        queue: Queue,
        message: Message,
        timings: LeaseTimings,
        *,
        shutdown: Shutdown,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[threading.Event, float], object] = threading.Event.wait,
        on_renewed: Callable[[], None] | None = None,
        metrics: Metrics | None = None,
    ):
        self.message = message
        self.stop = StopSignal()
        self.renewals = 0
        self.failed_renewals = 0
        self._queue = queue
        self._visibility_timeout_s = timings.visibility_timeout_s
        self._interval_s = timings.interval_s
        self._time_limit_at = message.received_at_s + timings.time_limit_s
        self._hard_cap_at = (None if timings.wind_down_s is None
                             else self._time_limit_at + timings.wind_down_s)
        self._shutdown = shutdown
        self._grace_s = timings.shutdown_grace_s
        self._clock = clock
        # How the heartbeat waits on its wake-up event; tests pass FakeClock.wait (worker.core.testing)
        # so that time passes only when they move it.
        self._wait = wait
        self._deadline = message.received_at_s + timings.visibility_timeout_s
        self._callbacks: list[Callable[[], None]] = []
        self._on_renewed = on_renewed
        self._metrics = metrics or NULL_METRICS
        self._lost_reason: str | None = None
        self._closing = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the handler's side
    def on_renew(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in the heartbeat thread after each successful renewal.

        A callback raising ``LeaseLost`` (for example the store's fencing token was replaced) loses
        the lease; any other project error is logged and retried on the next tick.
        """
        self._callbacks.append(callback)

    @property
    def interval_s(self) -> float:
        return self._interval_s

    @property
    def lost(self) -> bool:
        return self._lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        return self._lost_reason

    # --- the loop's side
    def start(self) -> None:
        ctx = contextvars.copy_context()  # keep the message's log context in the thread
        self._thread = threading.Thread(
            target=ctx.run, args=(self._beat,), name=f"heartbeat-{self.message.message_id}", daemon=True
        )
        self._shutdown.listen(self._wake)
        self._thread.start()

    def close(self) -> None:
        """Stop renewing and wait for the heartbeat thread to end.

        A deadline that passed while the thread was blocked in a renewal still loses the lease: the
        loop must not settle a message another consumer may already hold.
        """
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._shutdown.unlisten(self._wake)
        if self._clock() >= self._deadline:
            self._lose("the visibility deadline passed before the heartbeat stopped")

    # --- the heartbeat thread
    def _beat(self) -> None:
        try:
            self._beat_until_closed()
        except Exception as exc:
            # A heartbeat that died silently would stop renewing while the job runs on: fail safe.
            log.exception("heartbeat.crashed", error=f"{type(exc).__name__}: {exc}")
            self._lose(f"heartbeat crashed: {type(exc).__name__}")

    def _beat_until_closed(self) -> None:
        next_tick = self._clock() + self._interval_s
        shutdown_at: float | None = None
        while True:
            if self._shutdown.requested.is_set() and shutdown_at is None:
                shutdown_at = self._clock() + self._grace_s
                self.stop.forewarn()  # the stage may checkpoint inside the grace (checkpoint_signal)
            if self._shutdown.hurried.is_set():
                shutdown_at = self._clock()
            wake_at = min(next_tick, self._deadline)
            if self._hard_cap_at is not None:
                wake_at = min(wake_at, self._hard_cap_at)
            # Once the stop is set, the time limit and the grace have done their part: a moment already
            # past kept in the min() would make every wait return at once, a busy loop.
            if not self.stop.is_set():
                wake_at = min(wake_at, self._time_limit_at)
                if shutdown_at is not None:
                    wake_at = min(wake_at, shutdown_at)
            self._wait(self._wake, max(0.0, wake_at - self._clock()))
            self._wake.clear()
            if self._closing:
                return
            now = self._clock()
            if shutdown_at is not None and now >= shutdown_at:
                if self.stop.set(Stopped.SHUTDOWN, "shutdown grace period over"):
                    log.warning("worker.grace_over", message_id=self.message.message_id, grace_s=self._grace_s,
                                note="the job is stopped and its message handed back")
            if now >= self._time_limit_at:
                self.stop.set(Stopped.TIME_LIMIT, "JOB_TIME_LIMIT_SECONDS reached")
            if now >= self._deadline:
                self._lose("no successful renewal before the visibility deadline")
                return
            if self._past_hard_cap():
                return
            if now >= next_tick:
                # Fixed rate, so renewals track elapsed time; after a stall, start afresh from now.
                next_tick += self._interval_s
                if next_tick <= now:
                    next_tick = now + self._interval_s
                if not self._renew():
                    return

    def _past_hard_cap(self) -> bool:
        """True, and the lease lost, once the hard cap passed: no renewal of any kind after it."""
        if self._hard_cap_at is None or self._clock() < self._hard_cap_at:
            return False
        self._lose("hard cap: the time limit plus the stop grace passed")
        return True

    def _renew(self) -> bool:
        """One renewal; False once the lease is lost and the thread should end."""
        sent_at = self._clock()
        try:
            self._queue.extend(self.message, self._visibility_timeout_s)
        except LeaseLost as exc:
            self._lose(str(exc))
            return False
        except WorkerError as exc:
            self.failed_renewals += 1
            log.warning("heartbeat.renewal_failed", error=str(exc), failures=self.failed_renewals)
            self._metrics.count(HEARTBEAT_FAILURES, part="queue", messageId=self.message.message_id)
            return True
        # The new deadline counts from when the request left, not when the answer came back.
        self._deadline = sent_at + self._visibility_timeout_s
        self.renewals += 1
        if self._past_hard_cap():  # the SQS call may have blocked until past it
            return False
        if self._on_renewed is not None:
            self._on_renewed()
        for callback in tuple(self._callbacks):
            try:
                callback()
            except LeaseLost as exc:
                self._lose(str(exc))
                return False
            except WorkerError as exc:
                log.warning("heartbeat.callback_failed", error=str(exc), error_type=exc.error_type)
                self._metrics.count(HEARTBEAT_FAILURES, part="store", messageId=self.message.message_id)
        return True

    def _lose(self, reason: str) -> None:
        if self._lost_reason is None:
            self._lost_reason = reason
            log.error("heartbeat.lease_lost", reason=reason)
        self.stop.set(Stopped.LEASE_LOST, reason)
