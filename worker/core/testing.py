"""Test doubles for the core, shipped with the package the way dramatiq ships ``StubBroker`` and httpx
``MockTransport``: a clock that moves only when a test moves it, and a queue that lives in memory.

``FakeClock`` stands in for ``time.monotonic`` and, through ``FakeClock.wait``, for ``Event.wait``:

    clock = FakeClock()
    lease = Lease(queue, message, ..., clock=clock, wait=clock.wait)
    lease.start()
    clock.block_until_waiting()      # the heartbeat thread is parked on the clock
    clock.advance(1.0)               # every tick due in that second runs, in order, before this returns

``advance`` steps from one parked wait's deadline to the next and, after each step, waits (in real
time, bounded by ``settle_timeout_s``) until every thread it woke is parked on the clock again or has
ended. So a heartbeat test reads the same every run: no sleeps, no "at least 4 and at most 6 renewals".

``MemoryQueue`` implements ``worker.core.broker.Queue``, the queue the loop and the heartbeat take
(receive, extend, set the visibility, release, delete, dead-letter), as the SQS adapter does, over a
``FakeClock``: a received message is invisible until its visibility runs out on that clock, each
receive counts and hands out a new receipt handle, and a handle that no longer holds the message is
refused with ``LeaseLost``, as SQS refuses it.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from worker.core.broker import Message, Queue
from worker.core.errors import LeaseLost, QueueError, WorkerError
from worker.core.queue import MAX_VISIBILITY_S, dead_letter_attributes

# How often, in real time, a parked wait looks at its event: an Event cannot wake a Condition, and
# ``close()`` joins the heartbeat after setting one. Time-driven wake-ups do not wait for this.
_POLL_S = 0.001


@dataclass(eq=False)
class _Parked:
    thread: threading.Thread
    deadline_s: float
    event: threading.Event


class FakeClock:
    """Monotonic seconds that move only through ``advance`` (or setting ``now``), with the matching wait."""

    def __init__(self, start_s: float = 1000.0, *, settle_timeout_s: float = 5.0):
        self._now_s = float(start_s)
        self._settle_timeout_s = settle_timeout_s
        self._cond = threading.Condition(threading.RLock())
        self._parked: list[_Parked] = []
        # Threads a step woke that have not parked again yet: the step is not over until they have.
        self._woken: set[threading.Thread] = set()

    # --- what the code under test sees
    def __call__(self) -> float:
        with self._cond:
            return self._now_s

    def wait(self, event: threading.Event, timeout_s: float | None = None) -> bool:
        """``event.wait(timeout_s)`` with the timeout on this clock; returns whether the event is set."""
        if event.is_set():
            return True
        with self._cond:
            deadline_s = math.inf if timeout_s is None else self._now_s + max(0.0, timeout_s)
            if deadline_s <= self._now_s:
                return False  # a zero timeout: the thread runs on and is not parked yet
            me = threading.current_thread()
            parked = _Parked(me, deadline_s, event)
            self._parked.append(parked)
            self._woken.discard(me)
            self._cond.notify_all()
            try:
                while not event.is_set() and self._now_s < deadline_s:
                    self._cond.wait(_POLL_S)
            finally:
                self._parked.remove(parked)
            return event.is_set()

    def sleep(self, seconds: float) -> None:
        """Take ``seconds`` of this clock's time in the calling thread (a fake that is slow to answer)."""
        self.wait(threading.Event(), seconds)

    # --- what the test does
    @property
    def now(self) -> float:
        return self()

    @now.setter
    def now(self, value_s: float) -> None:
        self.advance(value_s - self())

    def advance(self, seconds: float, *, until: Callable[[], bool] | None = None) -> bool:
        """Move the clock ``seconds`` forward, waking each parked wait at its own deadline in turn.

        With ``until``, stop at the first step after which ``until()`` is true and return True; return
        ``until()`` at the end otherwise. Without it, return True.
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds} s)")
        me = threading.current_thread()
        with self._cond:
            target_s = self._now_s + seconds
            while True:
                self._settle(me)
                if until is not None and until():
                    return True
                due = [p.deadline_s for p in self._parked if p.deadline_s <= target_s and p.thread is not me]
                if not due:
                    break
                self._now_s = max(self._now_s, min(due))
                self._cond.notify_all()  # _settle counts the threads whose deadline came as woken
            self._now_s = max(self._now_s, target_s)
            self._cond.notify_all()
            return True if until is None else until()

    def block_until_waiting(self, count: int = 1) -> None:
        """Wait (real time, bounded) until ``count`` other threads are parked on the clock.

        A thread just started (a heartbeat) has not read the clock yet: advancing before it parks
        would start it late.
        """
        me = threading.current_thread()
        limit_s = time.monotonic() + self._settle_timeout_s
        with self._cond:
            while self._parked_count(me) < count:
                if time.monotonic() >= limit_s:
                    raise TimeoutError(f"FakeClock: {self._parked_count(me)} of {count} thread(s) parked "
                                       f"after {self._settle_timeout_s} s of real time")
                self._cond.wait(_POLL_S)

    @property
    def waiting(self) -> int:
        """How many threads are parked on the clock now."""
        with self._cond:
            return self._parked_count(threading.current_thread())

    # --- internals, called with the condition held
    def _resting(self, p: _Parked) -> bool:
        """Parked and not about to run: neither its deadline has come nor its event been set."""
        return p.deadline_s > self._now_s and not p.event.is_set()

    def _parked_count(self, me: threading.Thread) -> int:
        return sum(1 for p in self._parked if p.thread is not me and self._resting(p))

    def _settle(self, me: threading.Thread) -> None:
        """Return once every woken thread is parked again (its event unset) or has ended."""
        limit_s = time.monotonic() + self._settle_timeout_s
        while True:
            # A parked wait whose event was set (a close, a shutdown) is about to run: it counts as woken.
            self._woken.update(p.thread for p in self._parked if not self._resting(p))
            self._woken = {t for t in self._woken if t is not me and t.is_alive()}
            resting = {p.thread for p in self._parked if self._resting(p)}
            busy = self._woken - resting
            if not busy:
                return
            if time.monotonic() >= limit_s:
                names = ", ".join(sorted(t.name for t in busy))
                raise TimeoutError(f"FakeClock: {names} did not come back to the clock within "
                                   f"{self._settle_timeout_s} s of real time (blocked elsewhere, or spinning)")
            self._cond.wait(_POLL_S)


@dataclass
class QueuedMessage:
    """One message as the queue holds it; ``MemoryQueue.messages`` returns copies of these."""

    message_id: str
    body: str
    message_attributes: dict[str, Any] = field(default_factory=dict)
    receive_count: int = 0
    visible_at_s: float = 0.0
    receipt_handle: str | None = None
    received_at_s: float | None = None


@dataclass(frozen=True)
class QueueCall:
    """One call the queue answered (or refused): what, for which message, with which timeout, when."""

    op: str
    message_id: str | None
    timeout_s: int | None
    at_s: float
    thread: str


Fault = Callable[[Message | None], "Exception | None"]


class MemoryQueue:
    """The loop's ``Queue`` (``worker.core.broker``) in memory, its visibility timed by a ``FakeClock``.

    ``faults[op](message)`` runs before ``op`` (``receive`` gets None); an exception it returns is raised
    instead of the call, as ``tests.support.FaultyClient`` does for botocore. It may also take time with
    ``clock.sleep``. ``calls`` records every call in order, with the clock's time when it was made.
    """

    def __init__(self, clock: FakeClock | None = None, *, url: str = "memory://jobs",
                 dead_letter_queue: MemoryQueue | None = None, max_receive_count: int | None = None):
        self.clock = clock or FakeClock()
        self.url = url
        self.dead_letter_queue = dead_letter_queue
        # SQS's redrive policy: a message received this many times goes to the DLQ on the next receive.
        self.max_receive_count = max_receive_count
        self.faults: dict[str, Fault] = {}
        self.calls: list[QueueCall] = []
        self._held: dict[str, QueuedMessage] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    # --- the test's side
    def send(self, body: str = "{}", *, message_attributes: dict[str, Any] | None = None,
             delay_s: float = 0.0) -> str:
        visible_at_s = self.clock() + delay_s  # read before the lock: see _holding
        with self._lock:
            message_id = f"m-{next(self._ids)}"
            self._held[message_id] = QueuedMessage(message_id, body, dict(message_attributes or {}),
                                          visible_at_s=visible_at_s)
        return message_id

    @property
    def messages(self) -> list[QueuedMessage]:
        with self._lock:
            return [replace(held) for held in self._held.values()]

    def counts(self) -> tuple[int, int]:
        """(visible, in flight) now, like SQS's ApproximateNumberOfMessages and ...NotVisible."""
        now_s = self.clock()
        with self._lock:
            visible = sum(1 for held in self._held.values() if held.visible_at_s <= now_s)
        return visible, len(self._held) - visible

    def ops(self) -> list[str]:
        return [call.op for call in self.calls]

    # --- the loop's side
    def receive(self, *, wait_s: int, visibility_timeout_s: int) -> Message | None:
        """The first visible message, invisible for ``visibility_timeout_s`` from now on.

        With none visible, the long poll takes up to ``wait_s`` of the clock's time: it ends when a
        message becomes visible within it, or empty when the wait is over.
        """
        self._enter("receive", None, visibility_timeout_s)
        message = self._take(visibility_timeout_s)
        if message is None and wait_s > 0:
            soonest_s = self._soonest_visible_s()
            now_s = self.clock()
            if soonest_s is not None and soonest_s <= now_s + wait_s:
                self.clock.advance(soonest_s - now_s)
                message = self._take(visibility_timeout_s)
            else:
                self.clock.advance(wait_s)
        return message

    def set_visibility(self, message: Message, timeout_s: int) -> None:
        self._enter("set_visibility", message, timeout_s)
        self._change_visibility(message, timeout_s, "ChangeMessageVisibility")

    def extend(self, message: Message, timeout_s: int) -> None:
        self._enter("extend", message, timeout_s)
        self._change_visibility(message, timeout_s, "ChangeMessageVisibility (renewal)")

    def release(self, message: Message) -> None:
        self._enter("release", message, 0)
        self._change_visibility(message, 0, "ChangeMessageVisibility")

    def delete(self, message: Message) -> None:
        self._enter("delete", message, None)
        now_s = self.clock()
        with self._lock:
            held = self._holding(message, "DeleteMessage", now_s, in_flight=False)
            del self._held[held.message_id]

    def check_exists(self) -> None:
        self._enter("check_exists", None, None)

    def dead_letter_url(self) -> str | None:
        return None if self.dead_letter_queue is None else self.dead_letter_queue.url

    def dead_letter(self, message: Message, error: WorkerError) -> bool:
        """Copy the body to the DLQ with why it failed (the attributes ``Queue`` sends); False without one."""
        self._enter("dead_letter", message, None)
        if self.dead_letter_queue is None:
            return False
        self.dead_letter_queue.send(message.body,
                                    message_attributes=dead_letter_attributes(message, error, self.url))
        return True

    # --- internals
    def _enter(self, op: str, message: Message | None, timeout_s: int | None) -> None:
        self.calls.append(QueueCall(op, message.message_id if message else None, timeout_s, self.clock(),
                               threading.current_thread().name))
        fault = self.faults.get(op)
        if fault is not None:
            exc = fault(message)
            if exc is not None:
                raise exc

    def _take(self, visibility_timeout_s: int) -> Message | None:
        now_s = self.clock()
        redriven: list[QueuedMessage] = []
        taken: Message | None = None
        with self._lock:
            for held in list(self._held.values()):
                if held.visible_at_s > now_s:
                    continue
                if (self.max_receive_count is not None and self.dead_letter_queue is not None
                        and held.receive_count >= self.max_receive_count):
                    redriven.append(self._held.pop(held.message_id))
                    continue
                held.receive_count += 1
                held.receipt_handle = f"{held.message_id}/{held.receive_count}"
                held.visible_at_s = now_s + visibility_timeout_s
                held.received_at_s = now_s
                taken = Message(
                    message_id=held.message_id, receipt_handle=held.receipt_handle, body=held.body,
                    receive_count=held.receive_count, received_at_s=now_s,
                    attributes={"ApproximateReceiveCount": str(held.receive_count)},
                    message_attributes=dict(held.message_attributes),
                )
                break
        dead_letters = self.dead_letter_queue  # set whenever anything was redriven
        for held in redriven:  # outside the lock: the DLQ reads the clock
            assert dead_letters is not None
            dead_letters.send(held.body, message_attributes=held.message_attributes)
        return taken

    def _soonest_visible_s(self) -> float | None:
        with self._lock:
            return min((held.visible_at_s for held in self._held.values()), default=None)

    def _change_visibility(self, message: Message, timeout_s: int, action: str) -> None:
        if not 0 <= timeout_s <= MAX_VISIBILITY_S:
            raise QueueError(f"{action} failed: InvalidParameterValue: VisibilityTimeout {timeout_s}")
        now_s = self.clock()
        with self._lock:
            held = self._holding(message, action, now_s, in_flight=True)
            if now_s + timeout_s - (held.received_at_s or now_s) > MAX_VISIBILITY_S:
                raise LeaseLost(f"{action}: receipt handle no longer valid (InvalidParameterValue: "
                                f"total VisibilityTimeout beyond the limit [{MAX_VISIBILITY_S} seconds])")
            held.visible_at_s = now_s + timeout_s

    def _holding(self, message: Message, action: str, now_s: float, *, in_flight: bool) -> QueuedMessage:
        """The held message when ``message``'s receipt handle is still its latest; LeaseLost otherwise.

        Stricter than SQS on delete, which may accept an old handle without deleting anything: here an
        old handle is refused, so a test sees the mistake. Callers read the clock before taking the
        lock: a test's ``advance(until=...)`` may look at the queue while it holds the clock.
        """
        held = self._held.get(message.message_id)
        if held is None or held.receipt_handle != message.receipt_handle:
            raise LeaseLost(f"{action}: receipt handle no longer valid (ReceiptHandleIsInvalid)")
        if in_flight and held.visible_at_s <= now_s:
            raise LeaseLost(f"{action}: receipt handle no longer valid (MessageNotInflight)")
        return held


if TYPE_CHECKING:
    # mypy holds MemoryQueue to the protocol the loop takes: a method that drifts fails the type check.
    _IS_A_QUEUE: type[Queue] = MemoryQueue
