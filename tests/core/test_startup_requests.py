"""Signals before the worker exists: kept, ending the start-up at its next wait, then handed to the worker."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from worker.core.daemon import EXIT_OK, Requests, StartUpStopped, run_worker


class RecordingWorker:
    """A worker stand-in that notes each stop and drain call, and what the pulse had said by then."""

    def __init__(self, said: list[str]):
        self.calls: list[tuple[str, list[str]]] = []
        self._said = said

    def stop(self):
        self.calls.append(("stop", list(self._said)))

    def drain(self):
        self.calls.append(("drain", list(self._said)))


class RecordingPulse:
    def __init__(self):
        self.said: list[str] = []

    def ready(self):
        self.said.append("ready")

    def stopping(self):
        self.said.append("stopping")

    def draining(self):
        self.said.append("draining")


def test_with_nothing_requested_the_start_up_wait_just_sleeps():
    """``wait`` returns after its time when no signal came, so the store's retries go on as before."""
    requests = Requests()
    requests.wait(0)
    requests.wait(0.01)
    assert requests.reason is None


@pytest.mark.parametrize(("calls", "reason"), [
    (["drain"], "drain"), (["stop"], "shutdown"), (["drain", "stop"], "shutdown"), (["stop", "drain"], "shutdown"),
])
def test_a_request_before_the_worker_exists_ends_the_start_up_at_its_next_wait(calls, reason):
    """A stop or drain with no worker yet is logged as made during the start-up, and the next wait raises with its reason (a shutdown winning)."""
    requests = Requests()
    with capture_logs() as logs:
        for call in calls:
            getattr(requests, call)()
    with pytest.raises(StartUpStopped) as stopped:
        requests.wait(3600)  # raises at once: the request is already there
    assert stopped.value.reason == reason
    names = {"drain": "worker.drain_requested", "stop": "worker.shutdown_requested"}
    assert [(e["event"], e["during"]) for e in logs] == [(names[call], "start-up") for call in calls]


def test_kept_requests_reach_the_worker_in_order_at_attach_and_later_ones_at_once():
    """``attach`` hands the kept drain and stop to the worker in the order they came, each after the pulse; later ones go straight through."""
    requests, pulse = Requests(), RecordingPulse()
    requests.drain()
    requests.stop()
    worker = RecordingWorker(pulse.said)
    requests.attach(worker, pulse)
    assert worker.calls == [("drain", ["draining"]), ("stop", ["draining", "stopping"])]
    requests.stop()
    assert worker.calls[-1] == ("stop", ["draining", "stopping", "stopping"])
    assert len(worker.calls) == 3


def test_a_drain_kept_from_the_start_up_ends_run_worker_with_zero_before_any_receive(make_memory_worker, memory_queue):
    """A drain that came after the start-up's last wait reaches the worker before its first receive: exit 0, the queued message untouched."""
    worker = make_memory_worker(lambda message, lease: "trained")
    message_id = memory_queue.send()
    # A loop that missed the drain is stopped at its first receive, and fails the test, instead of polling for ever.
    memory_queue.faults["receive"] = lambda _message: (worker.stop(), worker.stop())
    requests = Requests()
    requests.drain()
    with capture_logs() as logs:
        assert run_worker(worker, requests=requests) == EXIT_OK
    assert "receive" not in memory_queue.ops()
    assert [m.message_id for m in memory_queue.messages] == [message_id]
    assert [e["reason"] for e in logs if e["event"] == "worker.stopped"] == ["drain"]
