"""The guards' one watchdog thread: shared by every open guard, firing each at its own stop or deadline,
never firing a guard once its fetch is over, and there again for the next guard after it ended."""

from __future__ import annotations

import multiprocessing
import threading
import time
from contextlib import ExitStack

import pytest

from pipeline import download_guard
from pipeline.download_guard import CutReason, Guard
from worker.core.stop import StopSignal

GIVE_UP_S = 10.0  # a watchdog that never fires fails a test instead of hanging it


def watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "download-guard" and t.is_alive()]


def wait_until(condition) -> bool:
    given_up = time.monotonic() + GIVE_UP_S
    while not condition():
        if time.monotonic() > given_up:
            return False
        time.sleep(0.01)
    return True


def never() -> float:
    return 3600.0


def test_open_guards_share_one_watchdog_and_one_stop_fires_them_all():
    """Eight guards open at once are watched by a single thread, and the stop they answer to fires all eight."""
    stop = StopSignal()
    with ExitStack() as stack:
        guards = [stack.enter_context(Guard(never, stop)) for _ in range(8)]
        # (One that was ending its linger as the first opened may take a moment to be gone.)
        assert wait_until(lambda: len(watchdogs()) == 1)
        stop.set("shutdown")
        assert wait_until(lambda: all(g.fired == CutReason.STOP for g in guards))


def test_each_guard_fires_at_its_own_deadline():
    """Of two guards on the same watchdog, the one past its deadline fires and the other is left alone."""
    with Guard(never, None) as later, Guard(lambda: -1.0, None) as due:
        assert wait_until(lambda: due.fired == CutReason.DEADLINE)
        assert later.fired is None


def test_a_guard_whose_fetch_is_over_is_never_fired():
    """Once a guard's block has ended its deadline may pass: the watchdog, still watching another, leaves it."""
    past = [False]
    sweeps_since = [0]

    def remaining_s() -> float:
        return -1.0 if past[0] else 3600.0

    def other_remaining_s() -> float:
        if past[0]:
            sweeps_since[0] += 1
        return 3600.0

    with Guard(other_remaining_s, None):
        with Guard(remaining_s, None) as over:
            pass
        past[0] = True
        assert wait_until(lambda: sweeps_since[0] >= 2)
        assert over.fired is None


def test_a_sweep_that_took_a_guard_before_its_fetch_ended_leaves_it_alone():
    """The watchdog's look at a guard it listed just before the guard closed does not fire it any more."""
    past = [False]
    with Guard(lambda: -1.0 if past[0] else 3600.0, None) as over:
        pass
    past[0] = True
    over._look()  # what a sweep running across the guard's __exit__ does next
    assert over.fired is None


def test_the_watchdog_ends_after_the_last_guard_and_a_later_guard_gets_a_new_one(monkeypatch):
    """With no guard open the thread ends after its linger; the next guard starts one that fires it."""
    monkeypatch.setattr(download_guard, "WATCHDOG_LINGER_S", 0.05)
    with Guard(never, None):
        pass
    assert wait_until(lambda: not watchdogs())
    with Guard(lambda: -1.0, None) as due:
        assert wait_until(lambda: due.fired == CutReason.DEADLINE)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_watchdog_that_died_is_replaced_by_the_next_guard():
    """Should a sweep ever raise, the thread ends, and the next guard to open is watched by a new one."""
    class Broken(Exception):
        pass

    def broken() -> float:
        raise Broken

    with Guard(broken, None):
        assert wait_until(lambda: not watchdogs())
    with Guard(lambda: -1.0, None) as due:
        assert wait_until(lambda: due.fired == CutReason.DEADLINE)


def _fire_in_child(result) -> None:
    with Guard(lambda: -1.0, None) as due:
        result.put(wait_until(lambda: due.fired == CutReason.DEADLINE))


def test_a_forked_child_gets_a_watchdog_of_its_own():
    """A process forked while the parent's watchdog runs fires its own guards (the thread did not come along)."""
    with Guard(never, None):
        assert watchdogs()
        context = multiprocessing.get_context("fork")
        result = context.Queue()
        child = context.Process(target=_fire_in_child, args=(result,))
        child.start()
        try:
            assert result.get(timeout=GIVE_UP_S) is True
        finally:
            child.join(GIVE_UP_S)
