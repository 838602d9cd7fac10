"""The shipped test doubles: a fake clock that moves only when told, and an in-memory queue timed by it."""

from __future__ import annotations

import threading
import time

import pytest

from worker.core.errors import InvalidMessage, LeaseLost, QueueError
from worker.core.testing import FakeClock, MemoryQueue


def parked_thread(clock: FakeClock, body) -> threading.Thread:
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    clock.block_until_waiting()
    return thread


# ---------------------------------------------------------------- FakeClock

def test_the_clock_stands_still_until_advanced():
    """Reading the clock never moves it; advance and setting now move it forward, never back."""
    clock = FakeClock(start_s=10.0)
    assert clock() == clock() == clock.now == 10.0
    clock.advance(2.5)
    clock.now = 20.0
    assert clock() == 20.0
    with pytest.raises(ValueError):
        clock.now = 19.0
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_a_wait_times_out_on_the_clock_not_in_real_time():
    """A parked wait returns False once the clock passes its timeout, and not before."""
    clock, event, results = FakeClock(), threading.Event(), []
    thread = parked_thread(clock, lambda: results.append(clock.wait(event, 5)))
    clock.advance(4.5)
    assert results == [] and clock.waiting == 1
    clock.advance(0.5)
    thread.join(1)
    assert results == [False]


def test_a_wait_returns_true_when_its_event_is_set():
    """Setting the event ends the wait whatever the clock says, like Event.wait."""
    clock, event, results = FakeClock(), threading.Event(), []
    thread = parked_thread(clock, lambda: results.append(clock.wait(event, None)))
    event.set()
    thread.join(1)
    assert results == [True] and clock.wait(event, 0) is True
    assert clock.wait(threading.Event(), 0) is False


def test_advance_wakes_each_deadline_in_turn_at_its_own_time():
    """A periodic waiter woken by one long advance sees every tick at its exact time, in order."""
    clock, stop, ticks = FakeClock(start_s=0.0), threading.Event(), []

    def every_quarter_second():
        while not clock.wait(stop, 0.25):
            ticks.append(clock())

    thread = parked_thread(clock, every_quarter_second)
    clock.advance(1.0)
    assert ticks == [0.25, 0.5, 0.75, 1.0]
    stop.set()
    thread.join(1)


def test_advance_returns_only_once_the_woken_thread_is_parked_again():
    """Work a waiter does after waking (here a slow step) is finished when advance returns."""
    clock, stop, done = FakeClock(start_s=0.0), threading.Event(), []

    def tick_then_work():
        while not clock.wait(stop, 1.0):
            time.sleep(0.02)  # real time between two waits, which the fake must wait out: what is tested
            done.append(clock())

    thread = parked_thread(clock, tick_then_work)
    clock.advance(1.0)
    assert done == [1.0]
    stop.set()
    thread.join(1)


def test_advance_until_stops_at_the_step_that_makes_it_true():
    """With until, the clock stops at the first wake-up after which the condition holds."""
    clock, stop = FakeClock(start_s=0.0), threading.Event()
    flagged = threading.Event()

    def flag_at_the_third_tick():
        for _ in range(3):
            clock.wait(stop, 0.5)
        flagged.set()

    parked_thread(clock, flag_at_the_third_tick).join(0)
    assert clock.advance(10, until=flagged.is_set)
    assert clock() == 1.5
    assert clock.advance(1, until=lambda: False) is False and clock() == 2.5


def test_a_sleeping_fake_takes_clock_time_in_its_own_thread():
    """sleep parks the caller until the clock has moved that far."""
    clock, woke = FakeClock(start_s=0.0), []
    thread = parked_thread(clock, lambda: (clock.sleep(3), woke.append(clock())))
    clock.advance(2)
    assert woke == []
    clock.advance(5)
    thread.join(1)
    assert woke == [3.0] and clock() == 7.0


def test_a_thread_that_never_parks_again_fails_the_advance_instead_of_hanging():
    """A woken thread stuck elsewhere is reported after the real-time bound, with its name."""
    clock, stuck = FakeClock(settle_timeout_s=0.2), threading.Event()

    def wake_then_block():
        clock.wait(threading.Event(), 1)
        stuck.wait(5)

    thread = threading.Thread(target=wake_then_block, name="stuck-one", daemon=True)
    thread.start()
    clock.block_until_waiting()
    with pytest.raises(TimeoutError, match="stuck-one"):
        clock.advance(1)
    stuck.set()
    thread.join(1)


def test_waiting_for_a_thread_that_never_parks_times_out():
    """block_until_waiting gives up after the real-time bound rather than hang the test run."""
    with pytest.raises(TimeoutError, match="0 of 1"):
        FakeClock(settle_timeout_s=0.05).block_until_waiting()


# ---------------------------------------------------------------- MemoryQueue

def test_a_received_message_is_invisible_until_its_visibility_runs_out():
    """A receive hides the message for its visibility timeout on the clock, then it comes back, counted."""
    queue = MemoryQueue()
    message_id = queue.send('{"job": 1}', message_attributes={"trace": {"DataType": "String", "StringValue": "t"}})
    first = queue.receive(wait_s=0, visibility_timeout_s=30)
    assert (first.message_id, first.body, first.receive_count) == (message_id, '{"job": 1}', 1)
    assert first.received_at_s == queue.clock() and first.message_attributes["trace"]["StringValue"] == "t"
    assert queue.counts() == (0, 1) and queue.receive(wait_s=0, visibility_timeout_s=30) is None
    queue.clock.advance(30)
    again = queue.receive(wait_s=0, visibility_timeout_s=30)
    assert again.receive_count == 2 and again.receipt_handle != first.receipt_handle


def test_extend_and_set_visibility_reset_the_visibility_from_now():
    """A renewal makes the message visible timeout_s from the moment of the call, not added to what was left."""
    queue = MemoryQueue()
    queue.send()
    message = queue.receive(wait_s=0, visibility_timeout_s=10)
    queue.clock.advance(8)
    queue.extend(message, 10)
    queue.clock.advance(9.5)
    assert queue.counts() == (0, 1)
    queue.set_visibility(message, 2)
    queue.clock.advance(2)
    assert queue.counts() == (1, 0)


def test_release_makes_the_message_visible_at_once():
    """release is a visibility of zero: the next receive takes the message again."""
    queue = MemoryQueue()
    queue.send()
    queue.release(queue.receive(wait_s=0, visibility_timeout_s=30))
    assert queue.receive(wait_s=0, visibility_timeout_s=30).receive_count == 2


def test_a_lapsed_or_replaced_receipt_handle_is_a_lost_lease():
    """Renewing after the visibility ran out, or with the handle of an earlier receive, raises LeaseLost."""
    queue = MemoryQueue()
    queue.send()
    first = queue.receive(wait_s=0, visibility_timeout_s=5)
    queue.clock.advance(5)
    with pytest.raises(LeaseLost, match="MessageNotInflight"):
        queue.extend(first, 5)
    second = queue.receive(wait_s=0, visibility_timeout_s=5)
    for call in (lambda: queue.extend(first, 5), lambda: queue.delete(first), lambda: queue.release(first)):
        with pytest.raises(LeaseLost, match="ReceiptHandleIsInvalid"):
            call()
    queue.delete(second)
    assert queue.counts() == (0, 0) and queue.messages == []


def test_visibility_past_twelve_hours_from_the_receive_is_a_lost_lease():
    """SQS's 12-hour ceiling: a renewal reaching past it is refused as a lost lease; a bad timeout is a QueueError."""
    queue = MemoryQueue()
    queue.send()
    message = queue.receive(wait_s=0, visibility_timeout_s=43_100)
    queue.clock.advance(43_000)
    with pytest.raises(LeaseLost, match="43200"):
        queue.extend(message, 300)
    with pytest.raises(QueueError):
        queue.set_visibility(message, -1)


def test_an_empty_long_poll_takes_its_wait_on_the_clock():
    """With nothing visible the receive waits wait_s, or less when a message becomes visible meanwhile."""
    queue = MemoryQueue(FakeClock(start_s=0.0))
    assert queue.receive(wait_s=20, visibility_timeout_s=30) is None and queue.clock() == 20.0
    queue.send(delay_s=5)
    assert queue.receive(wait_s=20, visibility_timeout_s=30).receive_count == 1 and queue.clock() == 25.0


def test_dead_letter_copies_the_body_with_why_and_needs_a_queue():
    """dead_letter sends the body with the same attributes as the SQS adapter; without a DLQ it returns False."""
    dlq = MemoryQueue(url="memory://jobs-dlq")
    queue = MemoryQueue(dlq.clock, dead_letter_queue=dlq)
    queue.send('{"bad": 1}')
    message = queue.receive(wait_s=0, visibility_timeout_s=30)
    assert queue.dead_letter(message, InvalidMessage(["jobId: field required"]))
    [dead] = dlq.messages
    attrs = {k: v["StringValue"] for k, v in dead.message_attributes.items()}
    assert dead.body == '{"bad": 1}' and attrs["ErrorType"] == "InvalidMessage"
    assert attrs["SourceQueue"] == "memory://jobs" and attrs["ReceiveCount"] == "1"
    assert queue.dead_letter_url() == "memory://jobs-dlq"
    assert MemoryQueue().dead_letter(message, InvalidMessage(["x"])) is False


def test_the_redrive_policy_moves_a_message_after_its_last_receive():
    """With max_receive_count, a message received that often goes to the DLQ instead of a further receive."""
    dlq = MemoryQueue(url="memory://jobs-dlq")
    queue = MemoryQueue(dlq.clock, dead_letter_queue=dlq, max_receive_count=2)
    queue.send("b")
    for count in (1, 2):
        assert queue.receive(wait_s=0, visibility_timeout_s=1).receive_count == count
        queue.clock.advance(1)
    assert queue.receive(wait_s=0, visibility_timeout_s=1) is None
    assert [held.body for held in dlq.messages] == ["b"] and queue.messages == []


def test_faults_are_raised_instead_of_the_call_and_every_call_is_recorded():
    """faults[op] may return an error to raise; calls log each op with the clock's time."""
    queue = MemoryQueue(FakeClock(start_s=0.0))
    queue.send()
    message = queue.receive(wait_s=0, visibility_timeout_s=30)
    queue.faults["extend"] = lambda m: QueueError("throttled") if m is message else None
    with pytest.raises(QueueError, match="throttled"):
        queue.extend(message, 30)
    queue.clock.advance(1)
    queue.delete(message)
    assert queue.ops() == ["receive", "extend", "delete"]
    assert [(c.op, c.timeout_s, c.at_s) for c in queue.calls] == [("receive", 30, 0.0), ("extend", 30, 0.0),
                                                                    ("delete", None, 1.0)]
