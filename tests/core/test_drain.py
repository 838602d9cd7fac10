"""Drain (SIGUSR2): stop receiving, let the job in flight run to its end, settle it, exit 0."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time

import boto3
import pytest
from structlog.testing import capture_logs

from tests.support import create_queues, events_after, events_until, start_sleepy_worker
from worker.core.daemon import EXIT_OK, SignalRelay, run_worker
from worker.core.loop import keep_receiving, stop_reason


def events(logs, name):
    return [entry for entry in logs if entry["event"] == name]


def bounded(worker, queue, also=None, receives=3):
    """Have ``queue`` stop ``worker`` after ``receives`` receives (running ``also`` on each), so a loop
    that ignores its drain ends, and fails the test, instead of polling for ever."""
    count = itertools.count(1)

    def on_receive(_message):
        if also is not None:
            also()
        if next(count) > receives:
            worker.stop()
            worker.stop()

    queue.faults["receive"] = on_receive
    return worker


@pytest.mark.parametrize(("shutdown", "draining", "receives", "reason"), [
    (False, False, True, "shutdown"),
    (False, True, False, "drain"),
    (True, False, False, "shutdown"),
    (True, True, False, "shutdown"),
])
def test_the_loop_receives_until_a_shutdown_or_a_drain(shutdown, draining, receives, reason):
    """Either request ends receiving; a shutdown, also one during a drain, is what the exit reports."""
    assert keep_receiving(shutdown, draining) is receives
    assert stop_reason(shutdown, draining) == reason


def test_a_drained_worker_finishes_its_job_past_the_grace_acks_it_and_takes_no_other(
        memory_queue, make_memory_worker, fake_clock):
    """The job in flight at the drain runs on well past the shutdown grace, is acked, and the next message stays queued."""
    seen = {}

    def handler(message, lease):
        worker.drain()
        fake_clock.advance(600)  # ten minutes of a 1 s grace: a shutdown would have stopped it long ago
        seen["stopped"] = lease.stop.is_set()
        return "trained"

    worker = bounded(make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=1), memory_queue)
    first, second = memory_queue.send(), memory_queue.send()
    with capture_logs() as logs:
        worker.run()
    assert seen == {"stopped": False}
    assert memory_queue.ops().count("receive") == 1
    assert [call.op for call in memory_queue.calls if call.message_id == first][-1] == "delete"
    [left] = memory_queue.messages
    assert left.message_id == second and left.receive_count == 0
    assert len(events(logs, "worker.drain_requested")) == 1
    assert [e["reason"] for e in events(logs, "worker.stopped")] == ["drain"]


def test_a_drained_job_still_stops_at_its_time_limit(memory_queue, make_memory_worker, fake_clock):
    """Drain waits for the job up to its time limit, not beyond: there it is stopped and dead-lettered as usual."""
    def handler(message, lease):
        worker.drain()
        assert fake_clock.advance(100, until=lease.stop.is_set)
        lease.stop.raise_if_set()

    worker = bounded(make_memory_worker(handler, JOB_TIME_LIMIT_SECONDS=30, SHUTDOWN_GRACE_SECONDS=1),
                     memory_queue)
    memory_queue.send()
    worker.run()
    assert memory_queue.counts() == (0, 0)
    [dead] = memory_queue.dead_letter_queue.messages
    assert dead.message_attributes["ErrorType"]["StringValue"] == "TimeLimitExceeded"


def test_an_idle_drained_worker_ends_after_its_current_poll(memory_queue, make_memory_worker):
    """A drain during an empty long poll ends the loop when that poll returns: one receive, nothing else."""
    worker = make_memory_worker(lambda message, lease: None, SQS_WAIT_TIME_SECONDS=20)
    bounded(worker, memory_queue, also=lambda: worker.drain())
    with capture_logs() as logs:
        worker.run()
    assert memory_queue.ops() == ["receive"]
    assert [e["reason"] for e in events(logs, "worker.stopped")] == ["drain"]


def test_a_message_arriving_in_the_last_poll_of_a_drain_is_handed_back_unworked(memory_queue, make_memory_worker):
    """A message the poll returns after the drain request is released at once, its handler never run."""
    ran = []
    worker = make_memory_worker(lambda message, lease: ran.append(message))
    bounded(worker, memory_queue, also=lambda: worker.drain())
    memory_queue.send()
    worker.run()
    assert ran == [] and memory_queue.ops() == ["receive", "release"]
    assert memory_queue.counts() == (1, 0)


def test_sigterm_during_a_drain_is_the_usual_graceful_shutdown(memory_queue, make_memory_worker, fake_clock):
    """A stop after a drain starts the shutdown grace; past it the job is stopped and its message released."""
    seen = {}

    def handler(message, lease):
        worker.drain()
        fake_clock.advance(50)
        worker.stop()
        assert fake_clock.advance(60, until=lease.stop.is_set)
        seen["grace_s"] = fake_clock() - message.received_at_s - 50
        lease.stop.raise_if_set()

    worker = bounded(make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=5), memory_queue)
    memory_queue.send()
    with capture_logs() as logs:
        worker.run()
    assert seen["grace_s"] == pytest.approx(5)
    assert memory_queue.ops()[-1] == "release" and memory_queue.counts() == (1, 0)
    assert [e["reason"] for e in events(logs, "worker.stopped")] == ["shutdown"]


def test_a_second_drain_request_changes_nothing(memory_queue, make_memory_worker, fake_clock):
    """Two SIGUSR2s are one drain: logged once, the job still finishes and is acked."""
    def handler(message, lease):
        worker.drain()
        fake_clock.advance(10)
        worker.drain()
        return "trained"

    worker = bounded(make_memory_worker(handler), memory_queue)
    memory_queue.send()
    with capture_logs() as logs:
        worker.run()
    assert len(events(logs, "worker.drain_requested")) == 1
    assert memory_queue.ops()[-1] == "delete"


def test_sigusr2_reaches_drain_through_the_relay_and_the_old_handler_comes_back(make_memory_worker):
    """SIGUSR2 through the relay drains without requesting a shutdown; afterwards the previous handler is back."""
    before = signal.getsignal(signal.SIGUSR2)
    worker = make_memory_worker(lambda message, lease: None)
    relay = SignalRelay(worker.stop, worker.drain)
    relay.install()
    try:
        assert signal.getsignal(signal.SIGUSR2) == relay.on_signal
        os.kill(os.getpid(), signal.SIGUSR2)
        assert worker.draining.wait(2)
        assert not worker.shutdown.requested.is_set()
    finally:
        relay.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_a_relay_without_drain_leaves_sigusr2_alone():
    """A relay made with ``stop`` alone (the dev stack's) installs no SIGUSR2 handler."""
    before = signal.getsignal(signal.SIGUSR2)
    relay = SignalRelay(lambda: None)
    relay.install()
    try:
        assert signal.getsignal(signal.SIGUSR2) == before
    finally:
        relay.uninstall()


def test_run_worker_drained_by_sigusr2_mid_job_acks_it_and_exits_zero(memory_queue, make_memory_worker, fake_clock):
    """SIGUSR2 to the process during a job: run_worker returns 0 once that job is acked, the next message untouched."""
    def handler(message, lease):
        os.kill(os.getpid(), signal.SIGUSR2)
        assert worker.draining.wait(5)  # the relay thread's call, in real time
        fake_clock.advance(120)
        return "trained"

    worker = bounded(make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=1), memory_queue)
    memory_queue.send()
    second = memory_queue.send()
    # Should run_worker not take SIGUSR2, the signal lands here instead of ending the test process.
    before = signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        assert run_worker(worker) == EXIT_OK
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert [m.message_id for m in memory_queue.messages] == [second]
    assert memory_queue.ops().count("receive") == 1 and memory_queue.ops()[-1] == "delete"


@pytest.mark.server
def test_sigusr2_mid_job_lets_a_real_worker_finish_ack_and_exit_zero(moto_server):
    """A real worker process given SIGUSR2 mid-job runs the job to its end past the grace, deletes it, takes no other, exits 0."""
    sqs = boto3.client("sqs", region_name="us-east-1", endpoint_url=moto_server)
    q = create_queues(sqs, name=f"drain-{os.getpid()}-{time.monotonic_ns()}")
    q.send('{"job": 1}')
    # A job longer than the grace: under SIGTERM it would be stopped and released, not deleted.
    proc = start_sleepy_worker(moto_server, q.url, job_s=4)
    try:
        events = events_until(proc, "message.received")
        received = events[-1]["message_id"]
        q.send('{"job": 2}')  # waiting when the drain begins: it must stay queued
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(60) == 0
        rest = events_after(proc)
    finally:
        proc.kill()
    names = [e["event"] for e in rest]
    assert "worker.drain_requested" in names
    assert [e for e in rest if e["event"] == "message.deleted"][0]["message_id"] == received
    assert "message.released" not in names and names.count("message.received") == 0
    assert [e["reason"] for e in rest if e["event"] == "worker.stopped"] == ["drain"]
    [left] = q.receive_now(wait_s=0)
    assert json.loads(left["Body"]) == {"job": 2} and left["Attributes"]["ApproximateReceiveCount"] == "1"
