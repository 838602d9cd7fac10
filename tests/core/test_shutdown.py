"""Shutdown: stop receiving at once, finish within the grace, otherwise hand the message back."""

from __future__ import annotations

import os
import signal
import time

import boto3
import pytest

from tests.support import create_queues, events_after, events_until, start_sleepy_worker


def test_job_finishing_within_the_grace_is_acked(memory_queue, make_memory_worker, fake_clock):
    """A shutdown requested mid-job lets the job finish within the grace and acks it."""
    def handler(message, lease):
        fake_clock.advance(0.1)
        worker.stop()
        fake_clock.advance(0.4)
        assert not lease.stop.is_set()

    worker = make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=3)
    memory_queue.send()
    assert worker.run_once() == "ack"
    assert memory_queue.counts() == (0, 0)


def test_job_past_the_grace_is_stopped_and_released(memory_queue, make_memory_worker, fake_clock):
    """Past the grace the handler is told to stop and the message becomes visible at once."""
    seen = {}

    def handler(message, lease):
        fake_clock.advance(0.1)
        worker.stop()
        assert fake_clock.advance(5, until=lease.stop.is_set)
        seen["after_s"] = fake_clock() - message.received_at_s
        lease.stop.raise_if_set()

    worker = make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=0.5)
    memory_queue.send()
    assert worker.run_once() == "release"
    assert seen["after_s"] == pytest.approx(0.6)  # the request at 0.1 s plus the 0.5 s grace
    assert memory_queue.ops()[-1] == "release" and memory_queue.counts() == (1, 0)


def test_second_signal_skips_the_grace(memory_queue, make_memory_worker, fake_clock):
    """A second stop request ends the grace immediately."""
    seen = {}

    def handler(message, lease):
        worker.stop()
        fake_clock.advance(0.2)
        worker.stop()
        assert fake_clock.advance(5, until=lease.stop.is_set)
        seen["after_s"] = fake_clock() - message.received_at_s
        lease.stop.raise_if_set()

    worker = make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=60)
    memory_queue.send()
    assert worker.run_once() == "release"
    assert seen["after_s"] == pytest.approx(0.2)  # at the second request, not 60 s later


def test_message_arriving_during_shutdown_is_handed_back_unworked(queues, make_worker):
    """A message received after the stop request is released without running the handler."""
    ran = []
    worker, client = make_worker(lambda message, lease: ran.append(1))
    worker.stop()
    queues.send()
    assert worker.run_once() == "release"
    assert ran == []
    worker.run()  # returns at once: the loop does not receive again
    assert client.ops().count("receive_message") == 1


@pytest.mark.server
def test_sigterm_past_grace_releases_and_exits_zero(moto_server, tmp_path):
    """A real worker process given SIGTERM mid-job past its grace releases the message (visible at once) and exits 0."""
    sqs = boto3.client("sqs", region_name="us-east-1", endpoint_url=moto_server)
    q = create_queues(sqs, name=f"sigterm-{os.getpid()}-{time.monotonic_ns()}")
    q.send('{"job": 1}')
    proc = start_sleepy_worker(moto_server, q.url, job_s=120)
    try:
        events = events_until(proc, "message.received")
        assert events[-1]["message_id"] and events[-1]["receive_count"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        rest = events_after(proc)
    finally:
        proc.kill()
    assert [e["event"] for e in rest if e["event"].startswith("message.")][-1] == "message.released"
    [again] = q.receive_now(wait_s=0)  # visible at once, not when its 30 s visibility runs out
    assert again["Attributes"]["ApproximateReceiveCount"] == "2"


def test_a_shutdown_request_announces_the_stop_before_the_grace_ends(memory_queue, make_memory_worker, fake_clock):
    """The job's stop is forewarned when the shutdown is requested, long before the grace ends it."""
    seen = {}

    def handler(message, lease):
        assert not lease.stop.forewarned()
        worker.stop()
        assert fake_clock.advance(1, until=lease.stop.forewarned)
        seen["stopped"] = lease.stop.is_set()

    worker = make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=60)
    memory_queue.send()
    assert worker.run_once() == "ack"
    assert seen == {"stopped": False}


def test_a_notice_then_a_signal_keeps_the_grace_and_two_signals_end_it():
    """A spot notice starts the shutdown but is never the first of two: the SIGTERM after it keeps the
    grace; a second SIGTERM still ends it."""
    from worker.core.lease import Shutdown

    shutdown = Shutdown()
    shutdown.request(notice=True)
    shutdown.request()
    assert shutdown.requested.is_set() and not shutdown.hurried.is_set()
    shutdown.request()
    assert shutdown.hurried.is_set()
