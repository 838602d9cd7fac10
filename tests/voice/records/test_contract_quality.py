"""The Store contract for the quality writes: the figures on the job (fenced on the claim's token), the
refusal (a final status, fenced, that no claim, cancel or error moves) and the figures on the profile
(fenced on the job's claim of the profile)."""

from __future__ import annotations

import pytest

from tests.voice.records.conftest import JOB_ID, LEASE_S, PROFILE_ID, claim, submit
from worker.voice.records.errors import StaleWrite
from worker.voice.records.rules import BASE_MODEL, QUALITY, REFUSED, ClaimOutcome, failed_attempts, usage

A = "a" * 32
B = "b" * 32
FIGURES = {"models": {"full": {"speakerSimilarity": 0.41, "cer": None}}, "gate": {"passed": False}}
FAILED = ["full.speaker_similarity 0.41 < 0.70"]


def refuse(store, token: str = A, quality: dict | None = FIGURES) -> None:
    store.mark_refused(JOB_ID, token, error_type="QualityBelowBar", message="below the quality bar: " + FAILED[0],
                       failed=FAILED, quality=quality, gpu_seconds=12.5)


def test_the_figures_land_on_the_job_under_the_claim(store):
    submit(store)
    claim(store, A)
    store.record_quality(JOB_ID, A, FIGURES)
    job = store.get_job(JOB_ID)
    assert job[QUALITY] == FIGURES and job["status"] == "processing"


def test_a_stale_attempt_records_no_figures(store, clock):
    """Once another claim took the job, the old token's figures are refused."""
    submit(store)
    claim(store, A)
    clock.advance(LEASE_S + 1)
    claim(store, B)
    with pytest.raises(StaleWrite):
        store.record_quality(JOB_ID, A, FIGURES)
    assert QUALITY not in store.get_job(JOB_ID)


def test_a_refusal_is_final_with_its_reason_and_figures(store):
    """refused: lease cleared, the attempt closed as refused, error not retryable naming each failed bar,
    the figures kept; no retry spent."""
    submit(store)
    claim(store, A)
    refuse(store)
    job = store.get_job(JOB_ID)
    assert job["status"] == REFUSED and job["lease"] is None and job[QUALITY] == FIGURES
    assert job["error"]["type"] == "QualityBelowBar" and job["error"]["retryable"] is False
    assert job["error"]["failed"] == FAILED and FAILED[0] in job["error"]["message"]
    assert [entry["outcome"] for entry in job["history"]] == [REFUSED]
    assert failed_attempts(job) == 0 and usage(job)["gpuSeconds"] == 12.5


def test_a_refused_job_is_never_claimed_cancelled_or_errored_again(store, clock):
    submit(store)
    claim(store, A)
    refuse(store)
    clock.advance(LEASE_S + 1)
    assert claim(store, B).outcome == ClaimOutcome.REFUSED
    assert store.request_cancel(JOB_ID) is False
    assert store.record_error(JOB_ID, token=None, error_type="X", message="x", retryable=True) is False
    assert store.get_job(JOB_ID)["status"] == REFUSED


def test_a_stale_attempt_cannot_refuse(store, clock):
    """The refusal is fenced: an attempt whose job was taken over refuses nothing."""
    submit(store)
    claim(store, A)
    clock.advance(LEASE_S + 1)
    claim(store, B)
    with pytest.raises(StaleWrite):
        refuse(store, A)
    assert store.get_job(JOB_ID)["status"] == "processing"


def test_the_profile_takes_the_figures_only_under_the_jobs_claim(store, clock):
    submit(store)
    claim(store, A)
    store.write_profile_quality(PROFILE_ID, A, FIGURES, job_id=JOB_ID)
    assert store.get_profile(PROFILE_ID)[QUALITY] == FIGURES
    clock.advance(LEASE_S + 1)
    claim(store, B)
    with pytest.raises(StaleWrite):
        store.write_profile_quality(PROFILE_ID, A, {"models": {}}, job_id=JOB_ID)
    assert store.get_profile(PROFILE_ID)[QUALITY] == FIGURES


BASE = {"name": "espeak-base", "digest": "sha256:" + "c" * 64, "licence": "Apache-2.0"}


def test_the_base_model_is_named_on_the_job_and_the_profile_only_under_the_claim(store, clock):
    """The job and the profile name the base model (name, digest, licence); an attempt that lost the job names none."""
    submit(store)
    claim(store, A)
    store.record_base_model(JOB_ID, A, BASE)
    store.write_profile_base_model(PROFILE_ID, A, BASE, job_id=JOB_ID)
    assert store.get_job(JOB_ID)[BASE_MODEL] == BASE and store.get_profile(PROFILE_ID)[BASE_MODEL] == BASE
    clock.advance(LEASE_S + 1)
    claim(store, B)
    other = {**BASE, "name": "planted"}
    with pytest.raises(StaleWrite):
        store.record_base_model(JOB_ID, A, other)
    with pytest.raises(StaleWrite):
        store.write_profile_base_model(PROFILE_ID, A, other, job_id=JOB_ID)
    assert store.get_job(JOB_ID)[BASE_MODEL] == BASE and store.get_profile(PROFILE_ID)[BASE_MODEL] == BASE
