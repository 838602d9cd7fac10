"""The heartbeat fails safe: a blocked renewal past the deadline or a crashed heartbeat loses the lease."""

from __future__ import annotations

import threading
import time

from worker.errors import Stopped
from worker.lease import Lease, Shutdown
from worker.queue import Message


class BlockingQueue:
    """A queue whose renewals block for ``block_s`` and then succeed."""

    def __init__(self, block_s: float):
        self.block_s = block_s
        self.renewals = 0

    def extend(self, message, timeout_s):
        time.sleep(self.block_s)
        self.renewals += 1


def message() -> Message:
    return Message(message_id="m-1", receipt_handle="r", body="{}", receive_count=1,
                   received_at_s=time.monotonic())


def lease_on(queue, **kw) -> Lease:
    args = dict(visibility_timeout_s=1, interval_s=0.2, time_limit_s=60, shutdown=Shutdown(), shutdown_grace_s=5)
    args.update(kw)
    return Lease(queue, message(), **args)


def test_deadline_passing_during_a_blocked_renewal_loses_the_lease_on_close():
    """A renewal still blocked when the 1 s deadline passes and the handler returns: the lease counts as lost."""
    lease = lease_on(BlockingQueue(block_s=1.5))
    lease.start()
    time.sleep(1.2)  # the handler "finishes" while the first renewal is still blocked
    lease.close()
    assert lease.lost and lease.stop.reason == Stopped.LEASE_LOST


def test_a_crashed_heartbeat_loses_the_lease_and_stops_the_handler():
    """An unexpected error inside the heartbeat thread stops the handler instead of silently ending renewals."""
    lease = lease_on(BlockingQueue(block_s=0), visibility_timeout_s=30)

    def broken_callback():
        raise KeyError("a record of an unexpected shape")

    lease.on_renew(broken_callback)
    lease.start()
    assert lease.stop.wait(2)
    lease.close()
    assert lease.lost and "KeyError" in lease.lost_reason


def test_a_lease_that_holds_is_not_lost_on_close():
    """Closing a healthy lease before its deadline does not lose it."""
    lease = lease_on(BlockingQueue(block_s=0), visibility_timeout_s=30)
    lease.start()
    time.sleep(0.5)
    lease.close()
    assert not lease.lost and lease.renewals >= 2
    assert not [t for t in threading.enumerate() if t.name == "heartbeat-m-1"]
