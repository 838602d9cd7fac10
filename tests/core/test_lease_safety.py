"""The heartbeat fails safe: a blocked renewal past the deadline, a crashed heartbeat or a handler that
outlives the hard cap loses the lease; after the time limit it keeps a steady pace."""

from __future__ import annotations

import threading

from worker.core.core_config import LeaseTimings
from worker.core.errors import Stopped
from worker.core.lease import Lease, Shutdown
from worker.core.queue import Message
from worker.core.testing import FakeClock


class BlockingQueue:
    """A queue whose renewals take ``block_s`` of the fake clock's time and then succeed."""

    def __init__(self, clock: FakeClock, block_s: float):
        self.clock = clock
        self.block_s = block_s
        self.renewals = 0
        self.sent_at: list[float] = []

    def extend(self, message, timeout_s):
        self.sent_at.append(self.clock())
        self.clock.sleep(self.block_s)
        self.renewals += 1


def lease_on(queue: BlockingQueue, clock=None, **timings) -> Lease:
    """A lease on ``queue``'s fake clock (started by ``started``), its heartbeat parked there."""
    args = dict(visibility_timeout_s=1, interval_s=0.2, time_limit_s=60, shutdown_grace_s=5)
    args.update(timings)
    message = Message(message_id="m-1", receipt_handle="r", body="{}", receive_count=1, received_at_s=queue.clock())
    return Lease(queue, message, LeaseTimings(**args), shutdown=Shutdown(), clock=clock or queue.clock,
                 wait=queue.clock.wait)


def started(lease: Lease, clock: FakeClock) -> Lease:
    lease.start()
    clock.block_until_waiting()
    return lease


def closing(lease: Lease) -> threading.Thread:
    """``lease.close()`` from another thread: it joins a heartbeat that only the test's clock can move on."""
    thread = threading.Thread(target=lease.close, name="closing", daemon=True)
    thread.start()
    return thread


def test_deadline_passing_during_a_blocked_renewal_loses_the_lease_on_close():
    """A renewal still blocked when the 1 s deadline passes and the handler returns: the lease counts as lost."""
    clock = FakeClock()
    queue = BlockingQueue(clock, block_s=1.5)
    lease = started(lease_on(queue), clock)
    clock.advance(1.2)  # the handler "finishes" while the first renewal (sent at 0.2 s) is still blocked
    assert queue.sent_at and queue.renewals == 0 and not lease.lost
    closer = closing(lease)
    clock.advance(0.5)  # the renewal comes back at 1.7 s; close has been waiting for it
    closer.join(5)
    assert not closer.is_alive()
    assert lease.lost and lease.stop.reason == Stopped.LEASE_LOST


def test_a_crashed_heartbeat_loses_the_lease_and_stops_the_handler():
    """An unexpected error inside the heartbeat thread stops the handler instead of silently ending renewals."""
    clock = FakeClock()
    lease = lease_on(BlockingQueue(clock, block_s=0), visibility_timeout_s=30)

    def broken_callback():
        raise KeyError("a record of an unexpected shape")

    lease.on_renew(broken_callback)
    started(lease, clock)
    assert clock.advance(2, until=lease.stop.is_set)
    lease.close()
    assert lease.lost and "KeyError" in lease.lost_reason


def test_a_lease_that_holds_is_not_lost_on_close():
    """Closing a healthy lease before its deadline does not lose it."""
    clock = FakeClock()
    lease = started(lease_on(BlockingQueue(clock, block_s=0), visibility_timeout_s=30), clock)
    clock.advance(0.5)
    lease.close()
    assert not lease.lost and lease.renewals == 2
    assert not [t for t in threading.enumerate() if t.name == "heartbeat-m-1"]


def heartbeat_alive() -> bool:
    return any(t.name == "heartbeat-m-1" and t.is_alive() for t in threading.enumerate())


def test_heartbeat_keeps_a_steady_pace_after_the_time_limit():
    """Past the time limit the heartbeat wakes once per interval, not in a busy loop, while it keeps renewing."""
    clock, reads = FakeClock(), []

    def counting_clock() -> float:
        reads.append(clock())
        return reads[-1]

    lease = lease_on(BlockingQueue(clock, block_s=0), clock=counting_clock, visibility_timeout_s=30,
                     interval_s=0.05, time_limit_s=0.1)
    limit_at = lease.message.received_at_s + 0.1
    started(lease, clock)
    assert clock.advance(2, until=lease.stop.is_set) and lease.stop.reason == Stopped.TIME_LIMIT
    clock.advance(0.5)  # the handler takes its time to stop: ten intervals
    lease.close()
    # A tick reads the clock about three times; a busy loop reads it hundreds of thousands of times.
    assert len([t for t in reads if t >= limit_at]) <= 6 * 10
    assert not lease.lost and lease.renewals >= 10


def test_no_renewal_after_the_hard_cap_while_the_handler_keeps_blocking():
    """A handler that ignores the time limit gets renewals until the limit plus the wind-down, then none, and the lease is lost."""
    clock = FakeClock()
    queue, stored = BlockingQueue(clock, block_s=0), []
    lease = lease_on(queue, visibility_timeout_s=30, interval_s=0.05, time_limit_s=0.2, wind_down_s=0.3)
    lease.on_renew(lambda: stored.append(clock()))
    limit_at, cap_at = lease.message.received_at_s + 0.2, lease.message.received_at_s + 0.5
    started(lease, clock)
    clock.advance(0.8)  # the handler blocks on, well past the cap
    assert not heartbeat_alive()
    lease.close()
    assert lease.lost and lease.lost_reason == "hard cap: the time limit plus the stop grace passed"
    assert lease.stop.reason == Stopped.TIME_LIMIT  # the first reason stays the one reported
    assert max(queue.sent_at) > limit_at  # the wind-down was renewed
    assert max(queue.sent_at) < cap_at and max(stored) < cap_at


def test_a_renewal_blocked_past_the_hard_cap_runs_no_store_callback():
    """A queue renewal that returns only after the hard cap does not renew the store as well."""
    clock, stored = FakeClock(), []
    lease = lease_on(BlockingQueue(clock, block_s=0.4), visibility_timeout_s=30, interval_s=0.05,
                     time_limit_s=0.1, wind_down_s=0.2)
    lease.on_renew(lambda: stored.append(clock()))
    started(lease, clock)
    # The first renewal, sent at 0.05 s, comes back at 0.45 s: past the cap at 0.3 s.
    assert clock.advance(2, until=lease.stop.is_set)
    lease.close()
    assert lease.lost and "hard cap" in lease.lost_reason
    assert stored == []
