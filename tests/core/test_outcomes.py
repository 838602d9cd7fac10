"""What happens to the message after the handler: ack, retry with backoff, dead-letter, or leave it."""

from __future__ import annotations

import random
import sys
import threading

import pytest

from pipeline.errors import BadRecording, DownloadError
from tests.support import FAST, FaultyClient, client_error, create_queues
from worker.core.errors import InvalidMessage, Stopped
from worker.core.loop import Worker, retry_ceiling_s, retry_delay_for, retry_delay_s
from worker.core.queue import Queue
from worker.settings import load_settings
from worker.voice.errors import JobBusy
from worker.voice.records.errors import StoreError


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("heartbeat-") and t.is_alive()]


class TopOfRange:
    """A jitter source that records the range it was asked for and draws its top."""

    def __init__(self):
        self.ranges = []

    def randint(self, low, high):
        self.ranges.append((low, high))
        return high


def worker_with_jitter(queues, handler, rng, **env):
    """A worker on the moto queue whose backoff draws from ``rng``; returns (worker, recording client)."""
    client = FaultyClient(queues.sqs)
    settings = load_settings({**FAST, "SQS_QUEUE_URL": queues.url, **{k: str(v) for k, v in env.items()}})
    return Worker(settings.loop_config(), Queue(client, queues.url), handler, rng=rng), client


def test_backoff_for_receive_counts_one_to_seven():
    """Receive counts 1..7 back off at most 30, 60, 120, 240, 480, 900, 900 seconds."""
    assert [retry_ceiling_s(n) for n in range(1, 8)] == [30, 60, 120, 240, 480, 900, 900]


def test_backoff_base_and_cap_are_configurable_and_bounded():
    """Base and cap come from settings, and a huge receive count stays at the cap."""
    assert [retry_ceiling_s(n, 5, 40) for n in range(1, 6)] == [5, 10, 20, 40, 40]
    assert retry_ceiling_s(10_000, 30, 900) == 900
    assert retry_ceiling_s(0, 30, 900) == 30
    assert retry_ceiling_s(3, 0, 900) == retry_delay_s(3, 0, 900) == 0


def test_jittered_backoff_stays_between_one_second_and_the_ceiling():
    """Every jittered delay is a whole number of seconds from 1 up to the ceiling for its receive count."""
    rng = random.Random(1)
    for n in range(1, 9):
        ceiling = retry_ceiling_s(n)
        delays = [retry_delay_s(n, rng=rng) for _ in range(500)]
        assert all(isinstance(d, int) and 1 <= d <= ceiling for d in delays), (n, min(delays), max(delays))
    assert {retry_delay_s(5, 1, 1, rng=rng) for _ in range(50)} == {1}


def test_jittered_backoff_spreads_over_its_whole_range():
    """Messages failing together come back spread out: many draws give many distinct delays across the range."""
    rng = random.Random(2)
    delays = [retry_delay_s(6, rng=rng) for _ in range(2000)]  # ceiling 900
    assert len(set(delays)) > 700
    assert min(delays) < 50 and max(delays) > 850
    assert 350 < sum(delays) / len(delays) < 550  # about half the ceiling on average


def test_retry_hint_is_not_jittered():
    """A busy job's retry hint (when the holder's lease ends) is used as is, capped, without drawing any jitter."""
    backoff, rng = load_settings({}).loop_config().backoff, TopOfRange()
    assert retry_delay_for(JobBusy("held", retry_after_s=200.4), 1, backoff, rng) == 200
    assert retry_delay_for(JobBusy("held", retry_after_s=5000), 1, backoff, rng) == 900
    assert retry_delay_for(JobBusy("held", retry_after_s=0.2), 1, backoff, rng) == 1
    assert rng.ranges == []
    assert retry_delay_for(StoreError("down"), 3, backoff, rng) == 120 and rng.ranges == [(1, 120)]


def test_ack_only_after_the_handler_returned(memory_queue, make_memory_worker, fake_clock):
    """The delete comes after the handler returned, never while it runs."""
    ops_when_done = []

    def handler(message, lease):
        fake_clock.advance(0.3)
        ops_when_done.extend(memory_queue.ops())
        return "done"

    worker = make_memory_worker(handler)
    memory_queue.send()
    assert worker.run_once() == "ack"
    assert ops_when_done == ["receive", "extend"]  # one renewal, at 0.2 s, and no delete yet
    assert memory_queue.ops() == ["receive", "extend", "delete"]
    assert memory_queue.counts() == (0, 0)


def joining(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``Thread.join``: how a test tells "waits for the heartbeat" from "has not
    got that far yet" without giving it real time to get there."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "join" and frame.f_globals.get("__name__") == "threading":
            return True
        frame = frame.f_back
    return False


def test_heartbeat_is_joined_before_the_delete(memory_queue, make_memory_worker, fake_clock):
    """A renewal still in flight when the handler returns finishes before the delete; no heartbeat thread is alive then."""
    alive_at_delete, renewal_ends, returned, deleted = [], [], threading.Event(), threading.Event()

    def slow_renewal(message):
        fake_clock.sleep(0.3)
        renewal_ends.append(fake_clock())

    def handler(message, lease):
        fake_clock.advance(0.3)  # returns while the first renewal (sent at 0.2 s) is still in flight
        returned.set()

    def delete(message):
        alive_at_delete.append((len(heartbeat_threads()), fake_clock()))
        deleted.set()

    worker = make_memory_worker(handler)
    memory_queue.faults["extend"] = slow_renewal
    memory_queue.faults["delete"] = delete
    memory_queue.send()
    loop = threading.Thread(target=worker.run_once, daemon=True)
    loop.start()
    assert returned.wait(5)
    for _ in range(5000):  # until the loop waits for the heartbeat, or (the bug) deletes without waiting
        if joining(loop) or deleted.wait(0.001):
            break
    fake_clock.advance(0.3)  # the renewal comes back at 0.5 s
    loop.join(5)
    [(alive, deleted_at)] = alive_at_delete
    assert alive == 0
    assert renewal_ends and max(renewal_ends) <= deleted_at
    assert memory_queue.ops()[-1] == "delete"


def test_retryable_error_sets_backoff_and_does_not_delete(queues):
    """A retryable failure leaves the message and sets its visibility to a jittered backoff for its receive count."""
    def handler(message, lease):
        raise StoreError("store down")

    rng = TopOfRange()
    worker, client = worker_with_jitter(queues, handler, rng)
    queues.send()
    # Two earlier deliveries that came back: this is the third receive.
    for _ in range(2):
        msg = queues.receive_now()[0]
        queues.sqs.change_message_visibility(QueueUrl=queues.url, ReceiptHandle=msg["ReceiptHandle"], VisibilityTimeout=0)
    assert worker.run_once() == "retry"
    assert "delete_message" not in client.ops()
    last = [c for c in client.calls if c[0] == "change_message_visibility"][-1]
    assert rng.ranges == [(1, 120)] and last[1]["VisibilityTimeout"] == 120
    assert queues.counts() == (0, 1)


def test_failed_backoff_change_still_deletes_nothing(queues):
    """If setting the backoff fails too, the message is left alone: no delete."""
    def handler(message, lease):
        raise DownloadError("503 from media host")

    worker, client = worker_with_jitter(queues, handler, TopOfRange())  # the backoff is 30 s
    client.faults["change_message_visibility"] = (
        lambda kw: client_error("ServiceUnavailable") if kw["VisibilityTimeout"] == 30 else None
    )
    queues.send()
    assert worker.run_once() == "retry"
    assert "delete_message" not in client.ops()
    assert queues.counts() == (0, 1)


def test_permanent_error_moves_body_to_dlq_with_attributes_then_deletes(queues, make_worker):
    """A permanent failure copies the body to the DLQ with why, and deletes the original only after that."""
    def handler(message, lease):
        raise InvalidMessage(["jobId: field required", "input: must not be empty"])

    worker, client = make_worker(handler)
    queues.send('{"not": "a job"}', MessageAttributes={"trace": {"DataType": "String", "StringValue": "t-1"}})
    assert worker.run_once() == "dead_letter"
    ops = client.ops()
    assert ops.index("send_message") < ops.index("delete_message")
    assert queues.counts() == (0, 0)
    [dead] = queues.receive_now(queues.dlq_url)
    assert dead["Body"] == '{"not": "a job"}'
    attrs = {k: v["StringValue"] for k, v in dead["MessageAttributes"].items()}
    assert attrs["ErrorType"] == "InvalidMessage"
    assert "jobId: field required" in attrs["ErrorMessage"]
    assert attrs["ReceiveCount"] == "1"
    assert attrs["SourceQueue"] == queues.url
    assert attrs["trace"] == "t-1"


def test_dlq_send_failure_never_deletes(queues, make_worker):
    """When the copy to the DLQ fails, the original is kept (parked at the longest backoff)."""
    def handler(message, lease):
        raise BadRecording("recording 0 is not audio")

    worker, client = make_worker(handler)
    client.faults["send_message"] = lambda kw: client_error("InternalError")
    queues.send()
    worker.run_once()
    assert "delete_message" not in client.ops()
    assert queues.counts() == (0, 1)
    assert client.calls[-1][0] == "change_message_visibility"
    assert client.calls[-1][1]["VisibilityTimeout"] == 900


def test_no_dlq_means_no_delete_and_the_longest_backoff(sqs, make_worker):
    """Without a RedrivePolicy a permanent failure is not deleted; it waits at the maximum backoff."""
    bare = create_queues(sqs, name="bare", with_dlq=False)

    def handler(message, lease):
        raise BadRecording("gone")

    client = FaultyClient(sqs)
    worker = Worker(load_settings({**FAST, "SQS_QUEUE_URL": bare.url}).loop_config(), Queue(client, bare.url), handler)
    bare.send()
    assert worker.run_once() == "dead_letter"
    assert "delete_message" not in client.ops()
    assert "send_message" not in client.ops()
    assert client.calls[-1][1]["VisibilityTimeout"] == 900
    assert bare.counts() == (0, 1)


def test_time_limit_stops_the_handler_and_dead_letters(memory_queue, make_memory_worker, fake_clock):
    """Past JOB_TIME_LIMIT_SECONDS the handler is told to stop and the job is dead-lettered as TimeLimitExceeded."""
    def handler(message, lease):
        assert fake_clock.advance(5, until=lease.stop.is_set)
        assert fake_clock() - message.received_at_s == pytest.approx(1.0)
        lease.stop.raise_if_set()

    worker = make_memory_worker(handler, JOB_TIME_LIMIT_SECONDS=1)
    memory_queue.send()
    assert worker.run_once() == "dead_letter"
    [dead] = memory_queue.dead_letter_queue.messages
    assert dead.message_attributes["ErrorType"]["StringValue"] == "TimeLimitExceeded"
    assert memory_queue.messages == []


def test_handler_ignoring_the_time_limit_is_abandoned_after_the_hard_cap(memory_queue, make_memory_worker, fake_clock):
    """A handler still busy past the time limit plus the stop grace gets no more renewals and its message is left to SQS."""
    seen = {}

    def handler(message, lease):
        seen["received_at"] = message.received_at_s
        assert fake_clock.advance(5, until=lease.stop.is_set) and lease.stop.reason == Stopped.TIME_LIMIT
        fake_clock.advance(1.0)  # hung in the stop: the cap is at 1 + 0.5 + 0.2 s

    worker = make_memory_worker(handler, JOB_TIME_LIMIT_SECONDS=1, SHUTDOWN_GRACE_SECONDS=0.5)
    memory_queue.send()
    assert worker.run_once() == "abandon"
    renewals = [c.at_s for c in memory_queue.calls if c.op == "extend"]
    assert renewals and seen["received_at"] + 1.0 < max(renewals) < seen["received_at"] + 1.7
    assert memory_queue.ops()[-1] == "extend" and memory_queue.counts() == (0, 1)


def test_unexpected_exception_propagates_without_delete(queues, make_worker):
    """A bug in the handler ends the loop (non-zero exit upstream); the heartbeat is stopped and nothing is deleted."""
    def handler(message, lease):
        raise KeyError("bug")

    worker, client = make_worker(handler)
    queues.send()
    with pytest.raises(KeyError):
        worker.run_once()
    assert heartbeat_threads() == []
    assert "delete_message" not in client.ops()


def test_cancellation_not_recorded_by_handler_is_retried_not_acked(queues, make_worker):
    """A Stopped(cancelled) escaping the handler is not acknowledged: the redelivery records the cancel."""
    def handler(message, lease):
        raise Stopped(Stopped.CANCELLED)

    worker, client = make_worker(handler)
    queues.send()
    assert worker.run_once() == "retry"
    assert "delete_message" not in client.ops()


def test_empty_queue_returns_none(queues, make_worker):
    """An empty long poll does nothing."""
    worker, client = make_worker(lambda message, lease: None)
    assert worker.run_once() is None
    assert client.ops() == ["receive_message"]


def test_receive_asks_for_the_lease_and_receive_count(queues, make_worker):
    """The receive itself sets the visibility timeout, one message, the long-poll wait and asks for the receive count."""
    worker, client = make_worker(lambda message, lease: None, SQS_WAIT_TIME_SECONDS=1)
    queues.send()
    worker.run_once()
    kw = client.calls[0][1]
    assert kw["VisibilityTimeout"] == 2 and kw["MaxNumberOfMessages"] == 1 and kw["WaitTimeSeconds"] == 1
    assert "ApproximateReceiveCount" in kw["MessageSystemAttributeNames"]
