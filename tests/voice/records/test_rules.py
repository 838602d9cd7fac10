"""The pure rules both stores decide with."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.voice.records.conftest import MODEL_PATHS, S3_PATHS
from worker.voice.records.models import JobRecord, ProfileRecord, read_job, read_profile
from worker.voice.records.rules import (
    ARTIFACTS,
    CLAIMS_KEPT,
    HISTORY_LIMIT,
    REQUIRED_ARTIFACTS,
    ClaimOutcome,
    claim_refusal,
    claimed,
    clock_skew_problem,
    close_attempt,
    committed_artifacts,
    completed,
    holds_profile_claim,
    is_complete,
    lease_live,
    may_stamp_claim,
    stamped_profile,
    to_ms,
    with_claim,
)

NOW = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def done_job(**changes):
    return {"status": "completed", **changes}


def done_profile(**changes):
    return {"status": "completed", "modelPaths": dict(MODEL_PATHS), "s3Paths": dict(S3_PATHS), **changes}


def records(job: dict | None, profile: dict | None) -> tuple[JobRecord | None, ProfileRecord | None]:
    """The documents as the stores' reads hand them to the rules: typed records."""
    return (None if job is None else read_job(job)), (None if profile is None else read_profile(profile))


@pytest.mark.parametrize("job,profile,expected", [
    (done_job(), done_profile(), True),
    (None, done_profile(), False),
    (done_job(), None, False),
    (done_job(status="processing"), done_profile(), False),
    (done_job(status="error"), done_profile(), False),
    (done_job(), done_profile(status="processing"), False),
    (done_job(), done_profile(modelPaths={k: v for k, v in MODEL_PATHS.items() if k != "lightConfig"}), False),
    (done_job(), done_profile(s3Paths={**S3_PATHS, "speakerEmbeddings": ""}), False),
    (done_job(), done_profile(s3Paths=None), False),
    (done_job(), done_profile(modelPaths={**MODEL_PATHS, "fullModel": None}), False),
])
def test_is_complete_truth_table(job, profile, expected):
    """Complete only when both records are completed and every artifact's local and S3 path is non-empty."""
    assert is_complete(*records(job, profile)) is expected


SIX = {**MODEL_PATHS, "vocoder": "/work/vocoder.pth"}, {**S3_PATHS, "vocoder": "s3://voices/vocoder.pth"}


@pytest.mark.parametrize("job,profile,expected", [
    # Committed before records kept the set: judged against the required keys, however the config grew.
    (done_job(), done_profile(), True),
    # Committed under the five-key config: complete, whatever a later config adds.
    (done_job(artifacts=list(MODEL_PATHS)), done_profile(), True),
    (done_job(artifacts=list(MODEL_PATHS)), done_profile(modelPaths=SIX[0], s3Paths=SIX[1]), True),
    # Committed under a six-key config: needs all six.
    (done_job(artifacts=[*MODEL_PATHS, "vocoder"]), done_profile(), False),
    (done_job(artifacts=[*MODEL_PATHS, "vocoder"]), done_profile(modelPaths=SIX[0]), False),
    (done_job(artifacts=[*MODEL_PATHS, "vocoder"]), done_profile(modelPaths=SIX[0], s3Paths=SIX[1]), True),
    # A value no commit wrote is no set: the required keys decide.
    (done_job(artifacts=[]), done_profile(modelPaths={"fullModel": "/m"}, s3Paths={"fullModel": "s3://b/m"}), False),
    (done_job(artifacts="fullModel"), done_profile(modelPaths={"fullModel": "/m"}, s3Paths={"fullModel": "s3://b/m"}),
     False),
    (done_job(artifacts=["fullModel", 7]), done_profile(), True),
])
def test_is_complete_judges_the_set_the_job_committed(job, profile, expected):
    """Completion is judged against the artifact keys the job's commit recorded, not the current config's."""
    assert is_complete(*records(job, profile)) is expected


def test_the_commit_marker_records_the_committed_artifacts():
    """``completed`` keeps the keys it is given, in order, and leaves the field alone when given none."""
    job = {"status": "processing", "history": [], "lease": {"token": "t"}}
    assert completed(job, "t", NOW, artifacts=("b", "a"))[ARTIFACTS] == ["b", "a"]
    assert ARTIFACTS not in completed(job, "t", NOW)
    assert committed_artifacts(None) == REQUIRED_ARTIFACTS


def test_lease_expiry_boundary():
    """A lease is live strictly before expiresAt and free from that instant on."""
    job = {"status": "processing", "lease": {"token": "t", "expiresAt": NOW}}
    assert lease_live(job, NOW - timedelta(milliseconds=1))
    assert not lease_live(job, NOW)
    assert claim_refusal(job, NOW) is None
    assert claim_refusal(job, NOW - timedelta(milliseconds=1)) == "held"


@pytest.mark.parametrize("job,refusal", [
    (None, ClaimOutcome.MISSING),
    ({"status": "completed"}, ClaimOutcome.COMPLETED),
    ({"status": "cancelled"}, ClaimOutcome.CANCELLED),
    ({"status": "processing", "lease": {"token": "t", "expiresAt": NOW + timedelta(seconds=1)}}, ClaimOutcome.HELD),
])
def test_a_refused_claim_names_why_as_a_claim_outcome(job, refusal):
    """A refusal is the ClaimOutcome of its cause, equal to the plain string it always was."""
    assert claim_refusal(job, NOW) is refusal and refusal == refusal.value


def test_close_attempt_only_closes_the_running_entry_of_the_token():
    """Closing touches only a still-running newest entry, and only the given token's."""
    running = [{"token": "a", "outcome": "running", "end": None}]
    assert close_attempt(running, "error", NOW, token="b") == running
    assert close_attempt(running, "error", NOW, token="a")[-1] == {"token": "a", "outcome": "error", "end": NOW}
    assert running[0]["outcome"] == "running"  # the input is not mutated
    finished = [{"token": "a", "outcome": "released", "end": NOW}]
    assert close_attempt(finished, "abandoned", NOW + timedelta(seconds=1)) == finished


def test_to_ms_truncates_and_normalises():
    """Datetimes become aware UTC with millisecond precision, naive ones read as UTC."""
    assert to_ms(datetime(2024, 1, 1, 0, 0, 0, 123_999)) == datetime(2024, 1, 1, 0, 0, 0, 123_000, tzinfo=UTC)
    eastern = timezone(timedelta(hours=-5))
    assert to_ms(datetime(2024, 1, 1, 7, tzinfo=eastern)) == datetime(2024, 1, 1, 12, tzinfo=UTC)


@given(st.lists(st.sampled_from(["expire", "release"]), max_size=3 * HISTORY_LIMIT))
def test_history_stays_bounded_with_one_running_entry(endings):
    """Whatever sequence of claims, a job's history holds at most twenty entries and only the newest runs."""
    job, now = {"status": "pending", "attempts": 0, "history": []}, NOW
    for n, ending in enumerate(endings):
        job = claimed(job, owner="w", token=f"t{n}", lease_s=10, now=now)
        if ending == "release":
            job = {**job, "lease": None, "history": close_attempt(job["history"], "released", now, f"t{n}")}
        now += timedelta(seconds=10)
    history = job["history"]
    assert len(history) == min(len(endings), HISTORY_LIMIT) and job["attempts"] == len(endings)
    assert all(entry["outcome"] != "running" for entry in history[:-1])


@pytest.mark.parametrize("profile", [None, {}, {"claims": None}, {"claims": "t1"}, {"claims": ["t1"]},
                                     {"claimToken": "t1"}])
def test_a_profile_without_claims_fences_everyone_out(profile):
    """A missing, legacy or malformed claims field holds no claim for anyone."""
    assert not holds_profile_claim(profile, "j1", "t1")


def test_stamp_replaces_only_the_claiming_jobs_entry():
    """A claim sets its own job's entry (moved last) and leaves other jobs' entries and tokens alone."""
    profile = {"_id": "p", "status": "pending", "claimToken": "legacy", "claims": []}
    profile = stamped_profile(profile, "p", "j1", "t1", NOW, 1)
    profile = stamped_profile(profile, "p", "j2", "t2", NOW, 1)
    profile = stamped_profile(profile, "p", "j1", "t3", NOW, 2)
    assert profile["claims"] == [{"jobId": "j2", "token": "t2", "epoch": 1},
                                 {"jobId": "j1", "token": "t3", "epoch": 2}]
    assert holds_profile_claim(profile, "j1", "t3") and holds_profile_claim(profile, "j2", "t2")
    assert not holds_profile_claim(profile, "j1", "t1") and not holds_profile_claim(profile, "j1", "t2")
    assert "claimToken" not in profile and profile["jobId"] == "j1" and profile["status"] == "processing"


@given(st.lists(st.tuples(st.integers(0, 30), st.text(min_size=1, max_size=3)), max_size=80))
def test_claims_stay_bounded_with_each_jobs_latest_token(stamps):
    """Whatever claims happen, at most CLAIMS_KEPT entries, one per job, each job's newest token."""
    claims: list[dict] = []
    latest: dict[str, str] = {}
    for job_no, token in stamps:
        claims = with_claim(claims, f"j{job_no}", token, 1)
        latest[f"j{job_no}"] = token
    assert len(claims) == min(len(latest), CLAIMS_KEPT)
    assert len({entry["jobId"] for entry in claims}) == len(claims)
    assert all(latest[entry["jobId"]] == entry["token"] for entry in claims)


@pytest.mark.parametrize("claims, allowed", [
    ([], True),
    ([{"jobId": "j2", "token": "t9", "epoch": 9}], True),
    ([{"jobId": "j1", "token": "legacy"}], True),
    ([{"jobId": "j1", "token": "t1", "epoch": 2}], True),
    ([{"jobId": "j1", "token": "t3", "epoch": 3}], True),
    ([{"jobId": "j1", "token": "t4", "epoch": 3}], False),
    ([{"jobId": "j1", "token": "t4", "epoch": 4}], False),
])
def test_a_claims_stamp_is_refused_only_by_a_newer_claim_of_the_same_job(claims, allowed):
    """Stamping epoch 3 of j1 (token t3): a lower, equal-and-own, missing or epoch-less entry lets it land."""
    assert may_stamp_claim({"claims": claims}, "j1", "t3", 3) is allowed


@pytest.mark.parametrize("offset_s, words", [(0.0, None), (10.0, None), (-9.9, None),
                                             (10.5, "10.5 s behind"), (-300.0, "300.0 s ahead of")])
def test_a_clock_off_by_more_than_the_margin_is_a_problem(offset_s, words):
    """An offset within the margin passes; beyond it, one line says how far and which way."""
    problem = clock_skew_problem(offset_s, 10)
    assert (problem is None) if words is None else (words in problem and "MAX_CLOCK_SKEW_SECONDS=10" in problem)
