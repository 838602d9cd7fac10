"""The records' read boundary: any document becomes a view with its problems, never an exception."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.voice.records.view import RECORD, job_view, profile_view, unworkable

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
PLUS_5 = timezone(timedelta(hours=5))
YEAR_1_PLUS_5 = datetime(1, 1, 1, tzinfo=PLUS_5)  # year 0 in UTC: no UTC form


def good_job(**fields) -> dict:
    return {"_id": "j1", "profileId": "p1", "status": "processing", "attempts": 2, "failedAttempts": 1,
            "lease": {"owner": "w1", "token": "t", "expiresAt": NOW, "messageId": "m"},
            "progress": {"stage": "train_full", "percent": 40.0, "updatedAt": NOW},
            "error": None, "history": [{"worker": "w1", "token": "t", "start": NOW, "end": None,
                                        "outcome": "running", "gpuSeconds": 12.5}],
            "cancelRequested": False, "createdAt": NOW, **fields}


ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**70) | st.floats() | st.text(max_size=8)
    | st.datetimes(timezones=st.none() | st.timezones() | st.just(PLUS_5)) | st.just(YEAR_1_PLUS_5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12)
FIELDS = st.sampled_from(["_id", "status", "attempts", "failedAttempts", "lease", "progress", "error", "history",
                          "cancelRequested", "createdAt", "startedAt", "completedAt", "profileId", "modelPaths",
                          "s3Paths", "jobId", "updatedAt", "earlierGpuSeconds", "claims"])


@given(st.dictionaries(FIELDS, ANY_VALUE) | ANY_VALUE)
def test_any_document_becomes_a_view_without_raising(doc):
    """Whatever a document holds (any types, odd times, NaN, huge numbers, nesting), both views are built."""
    job, profile = job_view(doc), profile_view(doc)
    assert all(problem.field and problem.what for problem in job.problems + profile.problems)
    job.cost()
    unworkable(doc, doc)


@pytest.mark.parametrize("fields, field, value", [
    ({"progress": {"stage": "s", "percent": "42", "updatedAt": NOW}}, "progress.percent", ("progress", "percent")),
    ({"progress": {"stage": "s", "percent": None, "updatedAt": NOW}}, "progress.percent", ("progress", "percent")),
    ({"progress": {"stage": "s", "percent": float("nan"), "updatedAt": NOW}}, "progress.percent",
     ("progress", "percent")),
    ({"progress": {"stage": "s", "percent": 10**400, "updatedAt": NOW}}, "progress.percent", ("progress", "percent")),
    ({"progress": {"stage": "s", "percent": 5, "updatedAt": YEAR_1_PLUS_5}}, "progress.updatedAt",
     ("progress", "updated_at")),
    ({"history": "oops"}, "history", ("history",)),
    ({"error": "boom", "status": "error"}, "error", ("error",)),
    ({"lease": "w1"}, "lease", ("lease",)),
    ({"attempts": "three"}, "attempts", ("attempts",)),
    ({"cancelRequested": "false"}, "cancelRequested", ("cancel_requested",)),
])
def test_an_invalid_field_is_none_with_a_problem_naming_it(fields, field, value):
    """Each malformed field the issue names reads as None, and one problem names that field."""
    view = job_view(good_job(**fields))
    read = view
    for name in value:
        read = getattr(read, name)
    assert read is None or read == ()
    assert [problem.field for problem in view.problems] == [field]
    assert view.invalid(field.split(".")[0])


def test_a_valid_record_has_no_problems_and_keeps_its_values():
    """A record as the worker writes it reads whole, times in UTC, GPU time in the cost."""
    view = job_view(good_job(createdAt=datetime(2026, 12, 1, 14, 0, tzinfo=PLUS_5)))
    assert view.problems == ()
    assert (view.id, view.status, view.attempts, view.lease.owner, view.progress.percent) == (
        "j1", "processing", 2, "w1", 40.0)
    assert view.created_at == NOW
    assert view.cost() == {"attempts": 2, "gpuSeconds": 12.5, "wastedGpuSeconds": 0.0, "failedAttempts": 1}


def test_a_document_that_is_no_document_is_one_problem():
    """A list, a string or null where a record should be is the record's problem, with nothing else read."""
    for doc in ([1, 2], "job", None):
        view = job_view(doc)
        assert [problem.field for problem in view.problems] == [RECORD]
        assert view.status is None and view.attempts is None


def test_a_time_without_a_utc_form_anywhere_is_unwritable():
    """A year-1 time at +05:00 in any field, known or not, is a problem no store could write back."""
    view = job_view(good_job(metadata={"uploads": [{"at": YEAR_1_PLUS_5}]}))
    [problem] = view.problems
    assert problem.field == "metadata.uploads[0].at" and problem.unwritable


@pytest.mark.parametrize("fields", [{"history": "oops"}, {"lease": "w1"}, {"attempts": "three"},
                                    {"error": "boom"}, {"failedAttempts": "1"}, {"cancelRequested": "false"},
                                    {"metadata": {"at": YEAR_1_PLUS_5}}])
def test_the_worker_cannot_work_past_a_field_it_decides_on(fields):
    """Malformed fields the handler reads or its claim computes from, or an unwritable time, are named for the worker."""
    [line] = unworkable(good_job(**fields), {"_id": "p1"})
    assert line.startswith(f"job {next(iter(fields))}")


def test_the_worker_works_past_fields_it_does_not_read():
    """A bad percent or an unknown status is the commands' warning, not the worker's refusal: it writes over them."""
    assert unworkable(good_job(progress="stuck", status="queued"), {"_id": "p1", "status": "odd"}) == []


def test_a_final_job_counts_only_what_is_read_before_the_claim():
    """A completed job is only acknowledged: its history does not matter to the worker, its error and profile paths do."""
    assert unworkable(good_job(status="completed", history="oops", attempts="x"), {"_id": "p1"}) == []
    assert unworkable(good_job(status="completed", error="boom"), {"_id": "p1"}) == [
        "job error: text ('boom'), not a document"]
    assert unworkable(good_job(status="completed"), {"_id": "p1", "modelPaths": "here"}) == [
        "profile modelPaths: text ('here'), not a document"]


def test_profile_paths_keep_the_valid_entries():
    """A profile's paths that are text are kept; any other value is a problem under its key."""
    view = profile_view({"_id": "p1", "status": "completed", "jobId": "j1",
                         "modelPaths": {"fullModel": "/m/a", "lightModel": 3}, "s3Paths": None})
    assert dict(view.model_paths) == {"fullModel": "/m/a"} and dict(view.s3_paths) == {}
    assert [problem.field for problem in view.problems] == ["modelPaths.lightModel"]
