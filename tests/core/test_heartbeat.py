"""The heartbeat keeps the message ours, and says so the moment it is not."""

from __future__ import annotations

import boto3
import pytest

from tests.support import client_error
from worker.core.errors import LeaseLost, QueueError, Stopped
from worker.core.queue import is_lease_lost_error
from worker.voice.records.errors import StoreError


def extends(queue) -> list:
    return [c for c in queue.calls if c.op == "extend"]


def test_renews_every_interval_with_a_full_reset(memory_queue, make_memory_worker, fake_clock):
    """Renewals happen once per interval, each resetting the visibility to the full timeout."""
    seen = {}

    def handler(message, lease):
        fake_clock.advance(1.1)
        seen["renewals"] = lease.renewals
        seen["received_at_s"] = message.received_at_s

    worker = make_memory_worker(handler)  # 200 ms interval, 2 s timeout
    memory_queue.send()
    worker.run_once()
    renewals = extends(memory_queue)
    assert len(renewals) == seen["renewals"] == 5  # 1.1 s / 0.2 s
    assert {c.timeout_s for c in renewals} == {2}
    assert [c.at_s - seen["received_at_s"] for c in renewals] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_the_message_stays_invisible_past_its_timeout(memory_queue, make_memory_worker, fake_clock):
    """A job longer than the visibility timeout keeps its message: no other consumer sees it meanwhile."""
    peeks = []

    def handler(message, lease):
        for _ in range(6):
            fake_clock.advance(0.5)
            peeks.append(memory_queue.counts())

    worker = make_memory_worker(handler, SQS_VISIBILITY_TIMEOUT_SECONDS=1, SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300)
    memory_queue.send()
    assert worker.run_once() == "ack"
    assert peeks == [(0, 1)] * 6
    assert memory_queue.counts() == (0, 0)


def test_requests_per_job_are_two_plus_one_per_interval(queues, make_worker, fake_clock):
    """A job lasting N heartbeat intervals costs 2 + N SQS requests, counted with a botocore event hook."""
    sqs = boto3.client("sqs", region_name="us-east-1")
    counted = []
    sqs.meta.events.register("before-call.sqs", lambda model, **kw: counted.append(model.name))
    n = 5

    def handler(message, lease):
        fake_clock.advance(0.2 * n + 0.1)

    worker, _ = make_worker(handler, client=sqs, clock=fake_clock)
    queues.send()
    worker.run_once()
    assert counted.count("ReceiveMessage") == 1 and counted.count("DeleteMessage") == 1
    assert counted.count("ChangeMessageVisibility") == n
    assert len(counted) == 2 + n


def test_rejected_renewal_loses_the_lease_stops_the_handler_and_forbids_the_delete(queues, make_worker, fake_clock):
    """A renewal answered ReceiptHandleIsInvalid tells the handler to stop, and the message is not deleted."""
    stop_reasons = []

    def handler(message, lease):
        assert fake_clock.advance(3, until=lease.stop.is_set)
        stop_reasons.append(lease.stop.reason)
        # Told on the first rejected tick (0.2 s), not only when the 2 s deadline passes.
        assert fake_clock() - message.received_at_s == pytest.approx(0.2)
        return "finished anyway"  # even a handler that claims success must not be acked

    worker, client = make_worker(handler, clock=fake_clock)
    client.faults["change_message_visibility"] = lambda kw: client_error(
        "ReceiptHandleIsInvalid", "The input receipt handle is invalid."
    )
    queues.send()
    assert worker.run_once() == "abandon"
    assert stop_reasons == [Stopped.LEASE_LOST]
    assert "delete_message" not in client.ops()


def test_twelve_hour_limit_answer_is_a_lost_lease(queues, make_worker, fake_clock):
    """InvalidParameterValue about the 12-hour ceiling is a lost lease, not a transient error."""
    def handler(message, lease):
        assert fake_clock.advance(3, until=lease.stop.is_set)
        assert fake_clock() - message.received_at_s == pytest.approx(0.2)  # at the first tick, not the deadline
        lease.stop.raise_if_set()

    worker, client = make_worker(handler, clock=fake_clock)
    client.faults["change_message_visibility"] = lambda kw: client_error(
        "InvalidParameterValue",
        "Value 2 for parameter VisibilityTimeout is invalid. Reason: Total VisibilityTimeout for the message is beyond the limit [43200 seconds]",
    )
    queues.send()
    assert worker.run_once() == "abandon"
    assert "delete_message" not in client.ops()


def test_no_renewal_before_the_deadline_loses_the_lease(queues, make_worker, fake_clock):
    """Renewals that keep failing transiently until the visibility deadline lose the lease; no delete."""
    seen = {}

    def handler(message, lease):
        assert fake_clock.advance(3, until=lease.stop.is_set)
        seen["reason"] = lease.stop.reason
        seen["failed"] = lease.failed_renewals
        seen["elapsed"] = fake_clock() - message.received_at_s

    worker, client = make_worker(handler, clock=fake_clock, SQS_VISIBILITY_TIMEOUT_SECONDS=1,
                                 SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300)
    client.faults["change_message_visibility"] = lambda kw: client_error("ServiceUnavailable", "try later")
    queues.send()
    assert worker.run_once() == "abandon"
    assert seen["reason"] == Stopped.LEASE_LOST
    assert seen["failed"] == 3  # at 0.3, 0.6 and 0.9 s, each retried on the next tick
    assert seen["elapsed"] == pytest.approx(1.0)  # the deadline itself, not a tick after it
    assert "delete_message" not in client.ops()


def test_one_failed_renewal_is_retried_and_the_job_completes(memory_queue, make_memory_worker, fake_clock):
    """A single failed tick is reported and retried next tick; the lease holds and the job is acked."""
    failures = iter([QueueError("ChangeMessageVisibility (renewal) failed: ThrottlingException: slow down")])

    def handler(message, lease):
        fake_clock.advance(0.9)
        assert not lease.stop.is_set()
        assert (lease.failed_renewals, lease.renewals) == (1, 3)

    worker = make_memory_worker(handler)
    memory_queue.faults["extend"] = lambda message: next(failures, None)
    memory_queue.send()
    assert worker.run_once() == "ack"


def test_renewal_callbacks_run_on_each_tick(memory_queue, make_memory_worker, fake_clock):
    """The handler's renewal callback runs in the heartbeat after every successful renewal."""
    ticks = []

    def handler(message, lease):
        lease.on_renew(lambda: ticks.append(fake_clock()))
        fake_clock.advance(0.7)
        return None

    worker = make_memory_worker(handler)
    memory_queue.send()
    worker.run_once()
    assert ticks == [c.at_s for c in extends(memory_queue)] and len(ticks) == 3


def test_callback_losing_the_store_lease_loses_the_message_lease(memory_queue, make_memory_worker, fake_clock):
    """A renewal callback raising LeaseLost (fencing token replaced) stops the handler and forbids the delete."""
    def handler(message, lease):
        def renew_store():
            raise LeaseLost("token replaced by a newer attempt")
        lease.on_renew(renew_store)
        assert fake_clock.advance(2, until=lease.stop.is_set)
        lease.stop.raise_if_set()

    worker = make_memory_worker(handler)
    memory_queue.send()
    assert worker.run_once() == "abandon"
    assert "delete" not in memory_queue.ops() and memory_queue.counts() == (0, 1)


def test_failing_callback_is_reported_and_does_not_lose_the_lease(memory_queue, make_memory_worker, fake_clock):
    """A renewal callback hitting a store outage is logged and retried; the job still completes."""
    calls = []

    def handler(message, lease):
        def renew_store():
            calls.append(1)
            raise StoreError("store unavailable")
        lease.on_renew(renew_store)
        fake_clock.advance(0.5)
        assert not lease.stop.is_set()

    worker = make_memory_worker(handler)
    memory_queue.send()
    assert worker.run_once() == "ack"
    assert len(calls) == 2


@pytest.mark.parametrize("code,text,lost", [
    ("ReceiptHandleIsInvalid", "The input receipt handle is invalid.", True),
    ("AWS.SimpleQueueService.MessageNotInflight", "Message does not exist or is not available", True),
    ("MessageNotInflight", "", True),
    ("InvalidParameterValue", "Value x for parameter ReceiptHandle is invalid. Reason: Message does not exist", True),
    ("InvalidParameterValue", "Total VisibilityTimeout for the message is beyond the limit [43200 seconds]", True),
    ("InvalidParameterValue", "VisibilityTimeout must be an integer", False),
    ("ThrottlingException", "Rate exceeded", False),
    ("ServiceUnavailable", "", False),
])
def test_which_answers_mean_the_lease_is_lost(code, text, lost):
    """Only answers about the receipt handle or the 12-hour ceiling count as a lost lease."""
    assert is_lease_lost_error(code, text) is lost
