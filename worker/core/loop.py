"""The worker loop: one message at a time, acknowledged only after the handler durably finished.

    receive (the lease starts with the receipt) -> heartbeat -> handler -> close the heartbeat -> settle

Settling maps the handler's result to exactly one queue action:

    handler returned                 -> delete (the job is completed, cancelled, or a duplicate)
    RetryableError                   -> visibility := jittered backoff for the receive count; no delete
                                        (the handler makes its last allowed failure RetriesExhausted:
                                        ``retry_budget``)
    PermanentError / time limit      -> copy to the DLQ with why, then delete; no DLQ -> max backoff
    Stopped(shutdown)                -> visibility := 0, another worker takes it now
    HostFault                        -> visibility := 0, and this worker takes no other message
                                        (``unfit``: the daemon exits 7, the host is replaced)
    LeaseLost, or a lost lease       -> nothing, whatever the result: the message is not ours to touch

Each error class names its own action (``WorkerError.action``, see ``worker.core.errors``).

A handler is any callable ``handler(message, lease) -> str | None``: it returns to acknowledge (the
optional string names the outcome for the logs), raises a project error otherwise, and waits on
``lease.stop`` to learn that it must stop. The queue is any ``worker.core.broker.Queue``: the SQS
adapter (``worker.core.queue.Queue``) in production, ``worker.core.testing.MemoryQueue`` in tests.

Two ways to stop receiving: ``stop()`` (SIGTERM) gives the job in flight the shutdown grace, then
releases it; ``drain()`` (SIGUSR2) lets it run to its end or its time limit and settles it as usual.
A message that arrives after either (during the last long poll) is released unworked.

``activity`` hears ``busy(for_at_most_s)`` when a job starts and ``idle()`` once it is settled, so
a deployment can keep a busy worker from being scaled in (worker/core/ecs_agent.py); it should answer
within seconds: it runs on the loop's thread. A call that raises is logged and the loop goes on: the
job runs (or the loop takes the next one) as if it had answered.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from worker.core.broker import Message, Queue
from worker.core.core_config import Backoff, LeaseTimings, LoopConfig
from worker.core.errors import Action, HostFault, QueueError, RetriesExhausted, WorkerError
from worker.core.faults import NEVER, CrashPoints
from worker.core.lease import Lease, Shutdown
from worker.core.metrics import (
    COUNT,
    JOB_DURATION,
    NULL_METRICS,
    OUTCOME_METRICS,
    RECEIVE_COUNT_AT_COMPLETION,
    SECONDS,
    Metrics,
    Outcome,
    outcome_of,
)
from worker.core.reporting import Reporter

log = structlog.get_logger(__name__)

Handler = Callable[[Message, Lease], "str | None"]

ACK, RETRY, DEAD_LETTER, RELEASE, ABANDON = Action


def retry_ceiling_s(receive_count: int, base_s: int = 30, max_s: int = 900) -> int:
    """The longest backoff for a message received ``receive_count`` times: base * 2^(n-1), capped."""
    n = max(1, receive_count)
    if base_s == 0:
        return 0
    # Cap the exponent first: a receive count in the thousands must not build a huge integer.
    return min(max_s, base_s * 2 ** min(n - 1, 32))


def retry_delay_s(receive_count: int, base_s: int = 30, max_s: int = 900,
                  rng: random.Random | None = None) -> int:
    """The backoff with full jitter: uniform in [1, ceiling] whole seconds (0 when the ceiling is 0).

    Messages that failed together (an outage) would otherwise all return together and fail together
    again; spread over the whole range they come back a few at a time.
    """
    ceiling_s = retry_ceiling_s(receive_count, base_s, max_s)
    if ceiling_s < 1:
        return ceiling_s
    # By default the random module's own generator: seeded from the OS and reseeded in a forked child,
    # so workers draw apart.
    draw = rng.randint if rng is not None else random.randint
    return draw(1, ceiling_s)


def retry_delay_for(error: WorkerError | None, receive_count: int, backoff: Backoff,
                    rng: random.Random | None = None) -> int:
    """The error's own hint (capped like the backoff, not jittered: it names when the holder's lease
    ends), else the jittered backoff for the receive count."""
    hint_s = getattr(error, "retry_after_s", None)
    if hint_s is not None:
        return int(min(max(1.0, hint_s), backoff.max_s))
    return retry_delay_s(receive_count, backoff.base_s, backoff.max_s, rng)


@dataclass(frozen=True)
class Decision:
    action: Action
    error: WorkerError | None = None


def decide(outcome: WorkerError | None, lease_lost: bool) -> Decision:
    """What to do with the message, from the handler's result and the lease's state: a lost lease
    abandons whatever the result, a return acknowledges, an error names its own action."""
    if lease_lost:
        return Decision(ABANDON, outcome)
    if outcome is None:
        return Decision(ACK)
    return Decision(outcome.action, outcome.settled_as())


def retry_budget(failed_attempts: int, limit: int, error: WorkerError) -> Action:
    """What a recorded failure does with the message: a retryable one that brought the job's failed
    attempts (this one included) to ``limit`` dead-letters it, any other takes the error's own action.

    Releases and crashes never reach here (they record no failure), so only real failures spend
    the budget; SQS's receive count, which counts them all, is left as the backstop.
    """
    if error.retryable and failed_attempts >= limit:
        return DEAD_LETTER
    return error.action


def spend_retry(error: WorkerError, failed_attempts: int, limit: int) -> WorkerError:
    """The error the handler ends with after recording ``error``: ``RetriesExhausted`` (permanent)
    once ``retry_budget`` says the budget is spent, else ``error`` itself."""
    if error.retryable and retry_budget(failed_attempts, limit, error) is DEAD_LETTER:
        return RetriesExhausted(error, failed_attempts, limit)
    return error


def keep_receiving(shutdown_requested: bool, draining: bool, unfit: bool = False) -> bool:
    """Whether the loop takes another message: not once a shutdown or a drain was requested, nor once
    a job found the host unfit."""
    return not (shutdown_requested or draining or unfit)


def stop_reason(shutdown_requested: bool, draining: bool, unfit: bool = False) -> str:
    """Why the loop ended, for the log: the host found unfit, a shutdown (also one that came during a
    drain) or the drain."""
    if unfit:
        return "host_unfit"
    return "shutdown" if shutdown_requested or not draining else "drain"


def busy_for_s(timings: LeaseTimings) -> float:
    """The longest one job can keep the worker busy, from its receipt: the time limit, then the wind
    down the heartbeat allows past it (a handler that honours its stop is done by then)."""
    return timings.time_limit_s + (timings.wind_down_s or 0.0)


class Activity(Protocol):
    """Hears when the worker takes on a job and when it is free again (see the module's docstring)."""

    def busy(self, for_at_most_s: float) -> None: ...

    def idle(self) -> None: ...


class NoActivity:
    """Nobody to tell: outside ECS a busy worker needs no protection."""

    def busy(self, for_at_most_s: float) -> None:
        pass

    def idle(self) -> None:
        pass


class Worker:
    def __init__(
        self,
        config: LoopConfig,
        queue: Queue,
        handler: Handler,
        *,
        reporter: Reporter | None = None,
        alive: Callable[[], None] | None = None,
        crash_points: CrashPoints = NEVER,
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[threading.Event, float], object] = threading.Event.wait,
        activity: Activity | None = None,
        log_fields: Callable[[Message], Mapping[str, object]] | None = None,
        reached: Callable[[str], None] | None = None,
    ):
        self._config = config
        # What the handler can tell of a message before it parses it (the voice job: its jobId), bound
        # to every log line of the message from its receipt to its delete; never trusted beyond logs.
        self._log_fields = log_fields
        self._clock, self._wait = clock, wait  # the heartbeat's; tests pass a FakeClock
        self._rng = rng  # the backoff's jitter; tests pass a seeded one
        self._metrics = metrics or NULL_METRICS
        self._queue = queue
        self._handler = handler
        self._reporter = reporter or Reporter(None)
        # Called after every receive and every successful renewal: feeds liveness and the watchdog.
        self._alive = alive or (lambda: None)
        # Hears "queue" after every receive or renewal SQS answered: health's unreachable clock.
        self._reached = reached or (lambda _part: None)
        self._crash = crash_points.reached
        self._activity = activity or NoActivity()
        self.shutdown = Shutdown()
        self._in_flight: str | None = None  # the message being worked on, for the shutdown's log line
        # Set once by drain(): no more receives, while the job in flight keeps its own clocks.
        self.draining = threading.Event()
        # Why the host is unfit, once a job ended in a HostFault: no more receives; the daemon exits 7.
        self.unfit: str | None = None

    # --- public surface
    def run(self) -> None:
        """Take messages until a shutdown or a drain is requested. Unexpected errors propagate to the caller."""
        while self._receiving():
            self.run_once()
        log.info("worker.stopped",
                 reason=stop_reason(self.shutdown.requested.is_set(), self.draining.is_set(), self.unfit is not None))

    def stop(self, *, notice: bool = False) -> None:
        """Request a shutdown (a second request skips the grace); from any thread, never from a signal
        handler: it takes locks (see ``worker.core.daemon`` for how signals get here). ``notice``: the
        request of a notice, not a signal (``Shutdown.request``): never the first of two."""
        self.shutdown.request(notice=notice)
        hurried = self.shutdown.hurried.is_set()
        log.info("worker.shutdown_requested", in_flight=self._in_flight, hurried=hurried, notice=notice,
                 grace_s=0.0 if hurried else self._config.lease.shutdown_grace_s,
                 note="the grace is over" if hurried else "a second signal ends the grace at once")

    def drain(self) -> None:
        """Stop receiving; the job in flight runs on (up to its time limit) and is settled as usual, then
        ``run`` returns. A later ``stop()`` still starts the shutdown grace. From any thread, never from
        a signal handler (see ``stop``)."""
        if self.draining.is_set():
            return
        self.draining.set()
        log.info("worker.drain_requested", shutdown_requested=self.shutdown.requested.is_set())

    def _receiving(self) -> bool:
        return keep_receiving(self.shutdown.requested.is_set(), self.draining.is_set(), self.unfit is not None)

    def run_once(self) -> str | None:
        """Receive at most one message and see it through; returns the action taken, or None."""
        c = self._config
        try:
            message = self._queue.receive(
                wait_s=c.wait_s, visibility_timeout_s=c.lease.visibility_timeout_s
            )
        except QueueError as exc:
            # botocore already retried; pause a little so a dead endpoint does not spin the loop.
            log.warning("queue.receive_failed", error=str(exc))
            self.shutdown.requested.wait(min(5.0, max(1.0, c.wait_s / 4)))
            return None
        else:
            self._reached("queue")
        finally:
            self._alive()
        if message is None:
            return None
        fields = {**self._handler_log_fields(message), "message_id": message.message_id,
                  "receive_count": message.receive_count}
        structlog.contextvars.bind_contextvars(**fields)
        try:
            if not self._receiving():
                # Arrived while we were stopping or draining: hand it straight back.
                self._settle(message, Decision(RELEASE), lease_lost=False)
                self._count_outcome(message, RELEASE, None, 0.0)
                return RELEASE
            return self._process(message)
        finally:
            structlog.contextvars.unbind_contextvars(*fields)

    def _renewed(self) -> None:
        self._reached("queue")
        self._alive()

    def _handler_log_fields(self, message: Message) -> dict[str, object]:
        if self._log_fields is None:
            return {}
        try:
            return dict(self._log_fields(message))
        except Exception:  # noqa: BLE001 - a hint for the logs must never cost the message
            return {}

    # --- one message
    def _process(self, message: Message) -> str:
        lease = Lease(self._queue, message, self._config.lease, shutdown=self.shutdown, clock=self._clock,
                      wait=self._wait, on_renewed=self._renewed, metrics=self._metrics)
        log.info("message.received")
        started_s = self._clock()
        outcome: WorkerError | None = None
        label = None
        lease.start()
        self._in_flight = message.message_id
        self._tell_activity("busy", lambda: self._activity.busy(busy_for_s(self._config.lease)))
        self._crash("after_receive")
        try:
            label = self._handler(message, lease)
        except WorkerError as exc:
            outcome = exc
        finally:
            # Stopped and joined before anything touches the message again.
            lease.close()
        decision = decide(outcome, lease.lost)
        if decision.error is not None and decision.action in (RETRY, DEAD_LETTER):
            self._reporter.capture(decision.error)
        log.info(
            "message.handled",
            action=decision.action,
            outcome=label,
            error=str(decision.error) if decision.error else None,
            error_type=decision.error.error_type if decision.error else None,
            lease_lost_reason=lease.lost_reason,
            renewals=lease.renewals,
            duration_s=round(self._clock() - started_s, 3),
        )
        if isinstance(outcome, HostFault):
            # Before the settle: whatever happens to the message, this host takes no other.
            self.unfit = str(outcome)
            log.error("worker.host_fault", error=str(outcome),
                      note="message released to another host; this worker takes no other and exits 7")
        try:
            self._settle(message, decision, lease_lost=lease.lost)
            self._count_outcome(message, decision.action, label, self._clock() - started_s)
        finally:
            # Only now: until its message is deleted or handed back, the job is not over. In a finally:
            # a settle that raised ends the loop, and the task must not stay protected after it.
            self._in_flight = None
            self._tell_activity("idle", self._activity.idle)
        return decision.action

    def _tell_activity(self, call: str, tell: Callable[[], None]) -> None:
        try:
            tell()
        except Exception as exc:  # noqa: BLE001 - a courtesy to the orchestrator must not end the loop
            # busy() runs with the heartbeat already started: an error leaving here would leave the
            # loop with the lease thread renewing a message nobody works on.
            # The type alone: the traceback carries the text, and a str() that fails must not fail here.
            log.exception("worker.activity_failed", call=call, error=type(exc).__name__)

    def _count_outcome(self, message: Message, action: Action, label: str | None, duration_s: float) -> None:
        outcome = outcome_of(action, label)
        if outcome not in OUTCOME_METRICS:
            return
        values: dict[str, tuple[float, str]] = {OUTCOME_METRICS[outcome]: (1, COUNT)}
        if outcome == Outcome.COMPLETED:
            values[JOB_DURATION] = (duration_s, SECONDS)
            values[RECEIVE_COUNT_AT_COMPLETION] = (message.receive_count, COUNT)
        self._metrics.emit(values, outcome=outcome, messageId=message.message_id)

    def _settle(self, message: Message, decision: Decision, *, lease_lost: bool) -> None:
        try:
            if decision.action == ACK and not lease_lost:
                self._queue.delete(message)
                log.info("message.deleted")
            elif decision.action == RETRY:
                delay_s = retry_delay_for(decision.error, message.receive_count, self._config.backoff,
                                          self._rng)
                self._queue.set_visibility(message, delay_s)
                log.info("message.retry_scheduled", delay_s=delay_s)
            elif decision.action == DEAD_LETTER:
                self._dead_letter(message, decision.error)
            elif decision.action == RELEASE:
                self._queue.release(message)
                log.info("message.released")
            else:
                log.warning("message.left_to_expire", reason="lease lost: not ours to touch")
        except WorkerError as exc:
            # The message stays where SQS has it; it returns when its visibility runs out.
            log.error("message.settle_failed", action=decision.action, error=str(exc))

    def _dead_letter(self, message: Message, error: WorkerError | None) -> None:
        assert error is not None
        try:
            sent = self._queue.dead_letter(message, error)
        except WorkerError as exc:
            log.error("message.dead_letter_failed", error=str(exc))
            self._park(message)
            return
        if not sent:
            log.error("message.no_dead_letter_queue", hint="the queue has no RedrivePolicy")
            self._park(message)
            return
        log.info("message.dead_lettered")
        self._queue.delete(message)
        log.info("message.deleted")

    def _park(self, message: Message) -> None:
        """Keep a message we could not dead-letter away for the longest backoff; never delete it."""
        self._queue.set_visibility(message, self._config.backoff.max_s)
