"""The download step's pool with fetchers that take a reservation: shares granted ahead of earlier files only
when that changes nothing, the job's budget exactly as one at a time, and a file's network slot handed on
before its sync."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from pipeline.download_pool import DownloadPool, Item
from pipeline.errors import BadRecording
from pipeline.recording_url import parse_recording_url
from worker.core.stop import StopSignal

GIVE_UP_S = 10.0  # a broken pool fails a test instead of hanging it
URL = parse_recording_url("https://one.test/r")


def items_in(tmp_path: Path, count: int) -> list[Item]:
    return [Item(i, URL, tmp_path / f"{i}.audio") for i in range(count)]


def pool_of(items: list[Item], fetch, *, budget: int, file_max: int, concurrency: int) -> DownloadPool:
    return DownloadPool(items, fetch, StopSignal(), budget_bytes=budget, file_max_bytes=file_max,
                        concurrency=concurrency, over_budget="over the budget", sized_reservations=True)


def run(pool: DownloadPool) -> dict[int, int]:
    """``pool.run``, failing the test instead of hanging it should the pool never end."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["sizes"] = pool.run(lambda _done: None)
        except BaseException as exc:  # handed back to the test, which re-raises it
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(GIVE_UP_S)
    assert not thread.is_alive(), "the pool never ended"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["sizes"]  # type: ignore[return-value]


def index_of(dest: Path) -> int:
    return int(dest.stem)


def test_a_file_takes_its_share_ahead_of_earlier_ones_when_the_budget_holds_their_maximum(tmp_path):
    """Recording 0 asks for its share only once recording 1 has its own: with room for 0's maximum besides,
    1 does not wait for 0."""
    granted = threading.Event()
    seen: list[bool] = []

    def fetch(url, dest: Path, *, reservation, stop) -> None:
        if index_of(dest) == 1:
            reservation.take(100, lambda: None)
            granted.set()
        else:
            seen.append(granted.wait(GIVE_UP_S))
            reservation.take(100, lambda: None)
        reservation.off_the_wire()
        dest.write_bytes(b"x" * 100)

    run(pool_of(items_in(tmp_path, 2), fetch, budget=10_000, file_max=1000, concurrency=2))
    assert seen == [True]


def test_a_file_waits_for_earlier_shares_when_the_budget_might_not_hold_them(tmp_path):
    """With less left than recording 0 might ask for, recording 1's share waits for recording 0's."""
    asking = threading.Event()
    order: list[int] = []

    def fetch(url, dest: Path, *, reservation, stop) -> None:
        index = index_of(dest)
        if index == 1:
            asking.set()
        else:
            assert asking.wait(GIVE_UP_S)
            time.sleep(0.1)  # lets recording 1 reach its wait: a pool that grants it now would
        reservation.take(100, lambda: None)
        order.append(index)
        reservation.off_the_wire()
        dest.write_bytes(b"x" * 100)

    run(pool_of(items_in(tmp_path, 2), fetch, budget=1000, file_max=1000, concurrency=2))
    assert order == [0, 1]


@pytest.mark.parametrize("seed", range(12))
def test_the_budget_gives_each_file_what_one_at_a_time_would(tmp_path, seed):
    """Random lengths, budgets and timing: every file's share and the recording refused are those of a
    sequential run, and the shares held never exceed the budget."""
    rng = random.Random(seed)
    file_max = 1000
    declared = [rng.randint(100, file_max) for _ in range(12)]
    budget = rng.randint(2 * file_max, 9 * file_max)
    delays = [(rng.random() / 200, rng.random() / 200) for _ in declared]
    lock, shares, held = threading.Lock(), {}, [0]
    peaks: list[int] = []

    def fetch(url, dest: Path, *, reservation, stop) -> None:
        index = index_of(dest)
        time.sleep(delays[index][0])
        share = reservation.take(declared[index], lambda: None)
        with lock:
            shares[index] = share
            held[0] += share
            peaks.append(held[0])
        written = 0
        try:
            if declared[index] > share:  # what the Downloader does: refused, over what was left
                raise BadRecording(f"recording {index} refused")
            time.sleep(delays[index][1])
            reservation.off_the_wire()
            dest.write_bytes(b"x" * declared[index])
            written = declared[index]
        finally:
            with lock:  # (a little before the pool takes it back: never more than the pool's view)
                held[0] -= share - written

    # One at a time: each file gets its declared length while it fits, the first that does not gets
    # what is left and is refused.
    expected, left, refused = {}, budget, None
    for index, length in enumerate(declared):
        expected[index] = min(length, left)
        if length > left:
            refused = index
            break
        left -= length

    pool = pool_of(items_in(tmp_path, len(declared)), fetch, budget=budget, file_max=file_max, concurrency=4)
    if refused is None:
        run(pool)
    else:
        with pytest.raises(BadRecording, match=f"recording {refused} refused"):
            run(pool)
    assert {i: s for i, s in shares.items() if i in expected} == expected
    assert max(peaks) <= budget


def test_a_file_being_synced_hands_its_network_slot_to_the_next(tmp_path):
    """One file on the wire at a time: the second starts while the first, its body written, is still being
    synced."""
    second_started = threading.Event()
    seen: list[bool] = []

    def fetch(url, dest: Path, *, reservation, stop) -> None:
        index = index_of(dest)
        if index == 1:
            second_started.set()
        reservation.take(100, lambda: None)
        reservation.off_the_wire()
        if index == 0:  # the sync and rename that follow the body
            seen.append(second_started.wait(GIVE_UP_S))
        dest.write_bytes(b"x" * 100)

    run(pool_of(items_in(tmp_path, 2), fetch, budget=10_000, file_max=1000, concurrency=1))
    assert seen == [True]


def test_no_more_files_than_the_concurrency_are_on_the_wire(tmp_path):
    """Slow syncs let files pile up past their bodies, yet at most three are ever between start and body end."""
    lock, on_wire, peaks = threading.Lock(), [0], []
    rng = random.Random(7)
    delays = [(rng.random() / 100, rng.random() / 50) for _ in range(16)]

    def fetch(url, dest: Path, *, reservation, stop) -> None:
        index = index_of(dest)
        with lock:
            on_wire[0] += 1
            peaks.append(on_wire[0])
        time.sleep(delays[index][0])
        reservation.take(100, lambda: None)
        with lock:
            on_wire[0] -= 1
        reservation.off_the_wire()
        time.sleep(delays[index][1])
        dest.write_bytes(b"x" * 100)

    sizes = run(pool_of(items_in(tmp_path, 16), fetch, budget=10**6, file_max=1000, concurrency=3))
    assert sizes == {i: 100 for i in range(16)}
    assert max(peaks) <= 3
