"""Store contract: list_jobs, the operator's query behind `python -m worker jobs`, on every backend."""

from __future__ import annotations

from datetime import timedelta

from tests.voice.records.conftest import claim, submit


def job_id(n: int) -> str:
    return f"{n:024x}"


def submit_spaced(store, clock, count: int, step_s: float = 60.0) -> list[str]:
    """Submits ``count`` jobs ``step_s`` apart on the store's clock; returns their ids, oldest first."""
    ids = []
    for n in range(count):
        ids.append(job_id(n + 1))
        submit(store, job_id=ids[-1])
        clock.advance(step_s)
    return ids


def ids(jobs: list[dict]) -> list[str]:
    return [job["_id"] for job in jobs]


def test_list_jobs_returns_the_newest_first_up_to_the_limit(store, clock):
    """Without filters, list_jobs gives the most recently created jobs, newest first, at most ``limit``."""
    created = submit_spaced(store, clock, 4)
    assert ids(store.list_jobs(limit=3)) == created[::-1][:3]
    assert ids(store.list_jobs()) == created[::-1]


def test_list_jobs_filters_on_status(store, clock):
    """``status`` keeps only the jobs in that status."""
    first, second, third = submit_spaced(store, clock, 3)
    claim(store, "t1", job_id=first)
    claim(store, "t3", job_id=third)
    assert ids(store.list_jobs(status="processing")) == [third, first]
    assert ids(store.list_jobs(status="pending")) == [second]
    assert store.list_jobs(status="completed") == []


def test_list_jobs_since_keeps_the_jobs_created_at_or_after_it(store, clock):
    """``since`` is inclusive, and combines with ``status``."""
    created = submit_spaced(store, clock, 4)
    second_at = store.get_job(created[1])["createdAt"]
    assert ids(store.list_jobs(since=second_at)) == created[:0:-1]
    assert ids(store.list_jobs(since=second_at + timedelta(milliseconds=1))) == created[:1:-1]
    claim(store, "t", job_id=created[0])
    claim(store, "t", job_id=created[3])
    assert ids(store.list_jobs(status="processing", since=second_at)) == [created[3]]


def test_list_jobs_returns_whole_records_as_get_job_does(store, clock):
    """Each listed job is the same record get_job returns."""
    [only] = submit_spaced(store, clock, 1)
    assert store.list_jobs() == [store.get_job(only)]
