"""Fleet presence in the core: the state a worker reports, written through an injected sink, never fatal."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from worker.core.errors import QueueError, RetryableError
from worker.core.loop import NoActivity
from worker.core.presence import IDLE, STOPPING, UNFIT, WORKING, Identity, Presence, state_of
from worker.core.testing import MemoryQueue

IDENTITY = Identity("host-a:11", "host-a", "1.2.3", "cuda")


class Sink:
    """A presence sink that keeps what it was told, and fails while ``failing`` is set."""

    def __init__(self) -> None:
        self.writes: list[dict] = []
        self.removed: list[str] = []
        self.failing = False

    def upsert_worker(self, presence) -> None:
        if self.failing:
            raise RetryableError("store unreachable")
        self.writes.append(dict(presence))

    def remove_worker(self, worker_id: str) -> None:
        self.removed.append(worker_id)


class Ticks:
    """A wall clock that moves a minute each time it is read."""

    def __init__(self) -> None:
        self.at = datetime(2024, 5, 1, 12, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.at += timedelta(minutes=1)
        return self.at


@pytest.mark.parametrize(("busy", "stopping", "unfit", "state"), [
    (False, False, False, IDLE), (True, False, False, WORKING), (True, True, False, STOPPING),
    (False, True, False, STOPPING), (True, True, True, UNFIT), (False, False, True, UNFIT)])
def test_the_reported_state_puts_unfit_before_stopping_before_work(busy, stopping, unfit, state):
    """state_of: an unfit host wins, then a requested stop, then whether a job runs."""
    assert state_of(busy, stopping, unfit) == state


def test_a_record_says_the_job_and_since_when_its_state_began():
    """busy() with a job id makes the record working on it; since moves only when the state changes."""
    sink, ticks = Sink(), Ticks()
    presence = Presence(IDENTITY, sink, interval_s=60, now=ticks)
    started = presence.snapshot()["since"]
    assert presence.snapshot()["since"] == started  # same state: same since
    presence.busy("job-1")
    assert presence.write()
    record = sink.writes[-1]
    assert (record["state"], record["jobId"], record["workerId"], record["device"]) == \
        (WORKING, "job-1", "host-a:11", "cuda")
    assert record["since"] > started and record["intervalS"] == 60
    presence.idle()
    assert presence.snapshot()["jobId"] is None and presence.snapshot()["state"] == IDLE


def test_a_failed_write_is_a_warning_and_the_next_one_goes_through(capsys):
    """A sink raising a project error makes write() return False and log presence.write_failed; no raise."""
    sink, written = Sink(), []
    presence = Presence(IDENTITY, sink, interval_s=60, on_written=lambda: written.append(1))
    sink.failing = True
    assert presence.write() is False and written == []
    assert "presence.write_failed" in capsys.readouterr().out
    sink.failing = False
    assert presence.write() is True and written == [1]


def test_the_thread_writes_when_idle_and_at_once_on_a_change():
    """Started, the presence writes at once, again each interval while idle, and promptly on busy()."""
    sink = Sink()
    presence = Presence(IDENTITY, sink, interval_s=0.01)
    presence.start()
    try:
        wait_for(lambda: len(sink.writes) >= 3)
        presence.busy("job-2")
        wait_for(lambda: sink.writes[-1]["jobId"] == "job-2")
    finally:
        presence.close(remove=True)
    assert sink.removed == ["host-a:11"]


def test_an_unfit_worker_leaves_its_record_saying_so():
    """close(remove=True) on an unfit host writes the record once more as unfit instead of deleting it."""
    sink = Sink()
    presence = Presence(IDENTITY, sink, interval_s=60, unfit=lambda: True)
    presence.close(remove=True)
    assert sink.removed == [] and sink.writes[-1]["state"] == UNFIT


def test_a_requested_stop_shows_as_stopping_with_the_job_still_named():
    """While a stop is asked for and the job winds down, the record says stopping and keeps the job id."""
    stopping = threading.Event()
    presence = Presence(IDENTITY, Sink(), interval_s=60, stopping=stopping.is_set)
    presence.busy("job-3")
    stopping.set()
    assert (presence.snapshot()["state"], presence.snapshot()["jobId"]) == (STOPPING, "job-3")


def test_the_loop_tells_presence_the_job_of_the_message_it_works_on(make_memory_worker, memory_queue):
    """Through the loop's activity, the record names the job (the message's log field) while its handler runs."""
    presence = Presence(IDENTITY, Sink(), interval_s=60)
    seen = []

    def handler(message, lease):
        seen.append(presence.snapshot())

    worker = make_memory_worker(handler, activity=presence.activity(NoActivity()),
                                log_fields=lambda message: {"job_id": json.loads(message.body)["jobId"]})
    memory_queue.send(json.dumps({"jobId": "665f1c2e9b1e8a0012ab34cd"}))
    worker.run_once()
    assert (seen[0]["state"], seen[0]["jobId"]) == (WORKING, "665f1c2e9b1e8a0012ab34cd")
    assert presence.snapshot()["state"] == IDLE


class DownQueue(MemoryQueue):
    def receive(self, *, wait_s: int, visibility_timeout_s: int):
        raise QueueError("endpoint unreachable")


def test_the_loop_says_the_queue_answered_only_after_a_receive_that_worked(make_memory_worker, memory_queue):
    """reached("queue") follows a receive SQS answered (empty or not), never a failed one."""
    reached: list[str] = []
    worker = make_memory_worker(lambda message, lease: None, reached=reached.append)
    worker.run_once()
    assert reached == ["queue"]
    down = make_memory_worker(lambda message, lease: None, queue=DownQueue(memory_queue.clock, url="memory://down"),
                              reached=reached.append, SQS_WAIT_TIME_SECONDS=0)
    down.shutdown.requested.set()  # the pause after a failed receive ends at once
    down.run_once()
    assert reached == ["queue"]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)
