"""A job's recordings fetched several at a time (DOWNLOAD_CONCURRENCY), as if one after another.

What the step promises is what the one-at-a-time loop promised, whatever the timing:
- files start in the order of the recordings, and the step's result is in that order;
- the job's byte budget (MAX_JOB_DOWNLOAD_BYTES) holds exactly: each file reserves its share before
  its body is read and gives back what it did not use when it ends. The share is the file's declared
  length (Content-Length, S3's ContentLength) when the fetcher takes a ``Reservation`` once it knows
  it (``DownloadPlan.sized_reservations``: the ``Downloader`` does), else its maximum
  (DOWNLOAD_MAX_BYTES) before it starts. Shares are taken in the order of the recordings (or ahead
  of it when what is left holds the maximum of every earlier file still to take one, which changes
  no one's share), and a file whose share no longer fits waits until the files in flight have given
  back theirs, then gets all that is left: exactly what it would have been given after the files
  before it, one at a time.
  So the recording refused for the budget is the same one, and nothing is ever granted twice.
- of several failures, the one of the first recording is reported; once one fails, no further file
  starts, and after a permanent failure (no retry will want the other files) the files after it
  that are in flight are cut, while those before it finish, since one of them may fail first;
- the job's stop cuts every file in flight at once: each runs under its own guard watching it;
- at most DOWNLOAD_CONCURRENCY files are on the wire at once. A file whose body is written hands its
  slot on (``Reservation.off_the_wire``) before its data sync and rename, which take it off the
  network for a few milliseconds (far more on a busy disk): the next file starts meanwhile, on one of
  the step's spare threads. The file itself still waits for its sync before its rename, and the step
  for every file's, so a renamed file is whole after a crash as before, and the step ends only once
  all its files are in.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.download_guard import POLL_S
from pipeline.errors import BadRecording, DownloadError
from pipeline.recording_url import RecordingUrl
from worker.core.errors import Stopped, StopReason
from worker.core.stop import StopSignal

CUT_DETAIL = "an earlier recording failed"


class FileStop(StopSignal):
    """One file's stop: set when the job's is, or when the step gives up on the file."""

    def __init__(self, job_stop: StopSignal):
        super().__init__()
        self._job_stop = job_stop

    def is_set(self) -> bool:
        return self._job_stop.is_set() or super().is_set()

    @property
    def reason(self) -> StopReason | None:
        return self._job_stop.reason or super().reason

    def raise_if_set(self) -> None:
        self._job_stop.raise_if_set()  # the job's own stop, with its reason, comes first
        super().raise_if_set()

    def cut_by_the_step(self) -> bool:
        return super().is_set() and not self._job_stop.is_set()


@dataclass(frozen=True)
class Item:
    index: int  # the recording's position in the job
    url: RecordingUrl
    dest: Path


_WAIT = object()


class _Reservation:
    """The ``Reservation`` one file's fetch takes its share of the budget from (``pipeline.downloads``)."""

    def __init__(self, pool: DownloadPool, position: int):
        self._pool, self._position = pool, position

    def take(self, declared: int | None, check: Callable[[], None]) -> int | None:
        return self._pool._reserve(self._position, declared, check)

    def off_the_wire(self) -> None:
        self._pool._hand_on_slot(self._position)


class DownloadPool:
    """One run of the download step over ``items`` (the recordings not already on disk)."""

    def __init__(self, items: Sequence[Item], fetch: Callable[..., Any], stop: StopSignal, *,
                 budget_bytes: int | None, file_max_bytes: int | None, concurrency: int, over_budget: str,
                 sized_reservations: bool = False):
        self._sized = sized_reservations and budget_bytes is not None
        self._granted: dict[int, int] = {}  # position -> its share, while in flight
        self._items = list(items)
        self._fetch = fetch
        self._stop = stop
        self._file_max = file_max_bytes
        self._concurrency = max(1, min(concurrency, len(self._items)))  # files on the wire at once
        # One spare thread per slot takes the next file while a file that is off the wire is synced;
        # only a fetcher told of its reservation hands its slot on (``_Reservation.off_the_wire``).
        self._threads = min(2 * self._concurrency, len(self._items)) if self._sized else self._concurrency
        self._on_wire = 0
        self._off_the_wire: set[int] = set()  # positions in flight that handed their slot on
        self._over_budget = over_budget
        self._cond = threading.Condition()
        self._next = 0
        self._unreserved = budget_bytes  # None: no job-wide budget
        self._holders = 0  # files in flight holding a reservation
        self._in_flight: dict[int, FileStop] = {}
        self._running = 0
        self.sizes: dict[int, int] = {}  # by recording index
        self._errors: dict[int, BaseException] = {}
        self._abandoned = False  # the step itself failed: nothing more starts

    def run(self, on_progress: Callable[[int], None]) -> dict[int, int]:
        """Fetch every item; ``on_progress(done)`` is called from this thread as files complete.

        Returns the sizes by recording index, or raises the error of the first recording that failed.
        """
        if not self._items:
            self._stop.raise_if_set()
            return self.sizes
        # Each thread in a copy of this one's context: the job's log fields (job_id, message_id) stay
        # on every download line.
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(self._work,),
                                    name=f"download-{n}", daemon=True)
                   for n in range(self._threads)]
        with self._cond:
            self._running = len(threads)
        for thread in threads:
            thread.start()
        reported = 0
        try:
            with self._cond:
                while self._running:
                    self._cond.wait(POLL_S)
                    if len(self.sizes) != reported:
                        reported = len(self.sizes)
                        self._cond.release()
                        try:
                            on_progress(reported)
                        finally:
                            self._cond.acquire()
        except BaseException:
            # The progress report failed: no download may outlive the step, so all are cut.
            with self._cond:
                self._abandoned = True
                for other in self._in_flight.values():
                    other.set(Stopped.CANCELLED, CUT_DETAIL)
            for thread in threads:
                thread.join()
            raise
        for thread in threads:
            thread.join()
        if len(self.sizes) != reported:
            on_progress(len(self.sizes))
        if self._errors:
            raise self._errors[min(self._errors)]
        self._stop.raise_if_set()
        return self.sizes

    def _work(self) -> None:
        try:
            while (taken := self._take()) is not None:
                position, grant, file_stop = taken
                item = self._items[position]
                size, error = None, None
                try:
                    size = self._fetch_one(position, item, grant, file_stop)
                except BaseException as exc:  # handed to run(), which raises the first by index
                    error = exc
                self._settle(position, item.index, grant, size, error, file_stop)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _fetch_one(self, position: int, item: Item, grant: int | None, file_stop: FileStop) -> int:
        kwargs: dict[str, Any] = {}
        if self._sized:
            kwargs["reservation"] = _Reservation(self, position)
        elif grant is not None:
            kwargs["remaining_job_bytes"] = grant
        if self._threads > 1:
            kwargs["stop"] = file_stop  # one fetcher at a time needs no stop of its own
        self._fetch(item.url, item.dest, **kwargs)
        if not item.dest.is_file():
            raise DownloadError(f"recording {item.index}: the download left no file")
        size = item.dest.stat().st_size
        if self._sized:
            with self._cond:
                grant = self._granted.get(position, 0)  # a file that took no share had none
        if grant is not None and size > grant:
            raise BadRecording(f"recording {item.index}: {self._over_budget}")  # a fetch that ignored its budget
        return size

    def _take(self) -> tuple[int, int | None, FileStop] | None:
        """The next item and its reservation, waiting while its maximum does not fit yet."""
        with self._cond:
            while True:
                if self._stop.is_set() or self._errors or self._abandoned or self._next >= len(self._items):
                    return None
                if self._on_wire >= self._concurrency:
                    self._cond.wait(POLL_S)
                    continue
                grant = None if self._sized else self._grant()
                if grant is not _WAIT:
                    break
                self._cond.wait(POLL_S)
            position, self._next = self._next, self._next + 1
            self._on_wire += 1
            if isinstance(grant, int):  # (not _WAIT any more: an int, or None without a budget)
                assert self._unreserved is not None
                self._unreserved -= grant
                self._holders += 1
            file_stop = self._in_flight[position] = FileStop(self._stop)
            return position, grant, file_stop  # type: ignore[return-value]

    def _hand_on_slot(self, position: int) -> None:
        with self._cond:
            if position in self._in_flight and position not in self._off_the_wire:
                self._off_the_wire.add(position)
                self._on_wire -= 1
                self._cond.notify_all()

    def _reserve(self, position: int, declared: int | None, check: Callable[[], None]) -> int | None:
        """A file's share once its length is known, taken in the order of the recordings."""
        while True:
            with self._cond:
                if self._unreserved is None:
                    return None
                earlier_open = sum(1 for p in self._in_flight if p < position and p not in self._granted)
                share = self._grant(declared) if not earlier_open else self._grant_ahead(declared, earlier_open)
                if share is not _WAIT:
                    assert isinstance(share, int)
                    self._unreserved -= share
                    self._granted[position] = share
                    self._holders += 1
                    self._cond.notify_all()
                    return share
                self._cond.wait(POLL_S)
            check()  # outside the lock: a cut ends the wait

    def _grant_ahead(self, declared: int | None, earlier_open: int) -> int | object:
        """A share taken before ``earlier_open`` earlier files have taken theirs, or _WAIT.

        Only when what is left after it still holds the most each of those may ask for (a declared
        length over DOWNLOAD_MAX_BYTES is refused before asking, an unknown one asks for that
        maximum): then each still gets its whole request, and this file its declared length,
        exactly as one at a time; the files that take shares after it are later ones, which it
        precedes anyway. It spares a file whose headers came first the wait for the others'.
        """
        assert self._unreserved is not None
        if declared is None or self._file_max is None:
            return _WAIT
        if self._unreserved - declared >= earlier_open * self._file_max:
            return declared
        return _WAIT

    def _grant(self, declared: int | None = None) -> int | None | object:
        if self._unreserved is None:
            return None
        if self._sized and declared is not None:
            if declared <= self._unreserved:
                return declared
            return _WAIT if self._holders else self._unreserved
        if self._file_max is not None and self._file_max <= self._unreserved:
            return self._file_max
        if self._holders:
            return _WAIT  # what the files in flight give back decides how much this one may have
        return self._unreserved  # nothing else holds any: all that is left, as one at a time

    def _settle(self, position: int, index: int, grant: int | None, size: int | None,
                error: BaseException | None, file_stop: FileStop) -> None:
        with self._cond:
            del self._in_flight[position]
            if position in self._off_the_wire:
                self._off_the_wire.discard(position)
            else:
                self._on_wire -= 1
            if self._sized:
                grant = self._granted.pop(position, None)
            if grant is not None:
                assert self._unreserved is not None
                self._unreserved += grant - min(size or 0, grant)
                self._holders -= 1
            if error is None:
                assert size is not None
                self.sizes[index] = size
            elif not (isinstance(error, Stopped) and file_stop.cut_by_the_step()):
                self._errors[index] = error
                if not getattr(error, "retryable", False):
                    for later, other in self._in_flight.items():
                        if later > position:
                            other.set(Stopped.CANCELLED, CUT_DETAIL)
            self._cond.notify_all()
