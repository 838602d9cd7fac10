"""The Store contract, part three: profile writes are fenced per job, against both stores.

Two jobs of one profile (a user re-trains while an earlier job still runs) must each be able to
write their paths and complete the profile, while an attempt whose job was claimed again by a new
token must not be able to write at all.
"""

from __future__ import annotations

import threading

import pytest

from tests.voice.records.conftest import (
    ASSETS,
    JOB_ID,
    LEASE_S,
    MODEL_PATHS,
    PROFILE_ID,
    S3_PATHS,
    claim,
    commit,
    submit,
)
from worker.voice.records.errors import StaleWrite
from worker.voice.records.rules import CLAIMS_KEPT, is_complete

OTHER_JOB = "665f1c2e9b1e8a0012ab34cf"


def paths_of(job_id: str) -> tuple[dict, dict]:
    """Distinct local and S3 paths per job, so the test can tell whose paths the profile holds."""
    return ({key: f"/work/production/voice-1/{job_id}/output/{key}" for key in ASSETS},
            {key: f"s3://voices/production/{job_id}/{key}" for key in ASSETS})


def write_paths(store, job_id: str, token: str, profile_id: str = PROFILE_ID) -> None:
    model_paths, s3_paths = paths_of(job_id)
    store.write_paths(profile_id, token, model_paths, s3_paths, job_id=job_id)


def two_jobs_claimed(store) -> None:
    """JOB_ID under t1 and OTHER_JOB under t2, both leases live, one profile."""
    submit(store)
    submit(store, OTHER_JOB)
    assert claim(store, "t1").outcome == "claimed"
    assert claim(store, "t2", owner="w2", job_id=OTHER_JOB).outcome == "claimed"


def assert_refused(store, job_id: str, token: str, profile_id: str = PROFILE_ID) -> None:
    """Both fenced profile writes raise StaleWrite and leave the profile exactly as it was."""
    before = store.get_profile(profile_id)
    with pytest.raises(StaleWrite):
        write_paths(store, job_id, token, profile_id)
    with pytest.raises(StaleWrite):
        store.mark_profile_completed(profile_id, token, job_id=job_id)
    assert store.get_profile(profile_id) == before


def test_earlier_job_still_writes_after_a_later_job_claims_its_profile(store):
    """A second job claiming the profile does not fence out the first job, whose lease is still live."""
    two_jobs_claimed(store)
    write_paths(store, JOB_ID, "t1")
    store.mark_profile_completed(PROFILE_ID, "t1", job_id=JOB_ID)
    store.mark_job_completed(JOB_ID, "t1")
    assert is_complete(store.get_job(JOB_ID), store.get_profile(PROFILE_ID))
    assert store.get_profile(PROFILE_ID)["modelPaths"] == paths_of(JOB_ID)[0]


@pytest.mark.parametrize("last", [JOB_ID, OTHER_JOB])
def test_two_jobs_of_one_profile_both_commit_and_the_last_commit_wins(store, last):
    """Both jobs commit in either order; the profile ends completed holding the last committer's paths."""
    two_jobs_claimed(store)
    tokens = {JOB_ID: "t1", OTHER_JOB: "t2"}
    first = OTHER_JOB if last == JOB_ID else JOB_ID
    for job_id in (first, last):
        model_paths, s3_paths = paths_of(job_id)
        commit(store, tokens[job_id], job_id=job_id, model_paths=model_paths, s3_paths=s3_paths)
    profile = store.get_profile(PROFILE_ID)
    assert (profile["modelPaths"], profile["s3Paths"]) == paths_of(last)
    assert is_complete(store.get_job(JOB_ID), profile) and is_complete(store.get_job(OTHER_JOB), profile)


def test_interleaved_commits_of_two_jobs_both_succeed(store):
    """Writes of two jobs interleaved step by step all succeed; the paths written last are kept."""
    two_jobs_claimed(store)
    write_paths(store, JOB_ID, "t1")
    write_paths(store, OTHER_JOB, "t2")
    store.mark_profile_completed(PROFILE_ID, "t2", job_id=OTHER_JOB)
    store.mark_profile_completed(PROFILE_ID, "t1", job_id=JOB_ID)
    store.mark_job_completed(JOB_ID, "t1")
    store.mark_job_completed(OTHER_JOB, "t2")
    profile = store.get_profile(PROFILE_ID)
    assert profile["status"] == "completed" and profile["modelPaths"] == paths_of(OTHER_JOB)[0]


def test_taken_over_claim_cannot_write_the_profile(store, clock):
    """Once a job is claimed again, its old token is fenced out; the other job and the new token still write."""
    submit(store)
    submit(store, OTHER_JOB)
    claim(store, "t1")
    clock.advance(LEASE_S / 2)
    claim(store, "t2", owner="w2", job_id=OTHER_JOB)
    clock.advance(LEASE_S / 2)
    assert claim(store, "t3", owner="w3").outcome == "claimed"
    assert_refused(store, JOB_ID, "t1")
    write_paths(store, OTHER_JOB, "t2")
    write_paths(store, JOB_ID, "t3")
    store.mark_profile_completed(PROFILE_ID, "t3", job_id=JOB_ID)
    assert store.get_profile(PROFILE_ID)["modelPaths"] == paths_of(JOB_ID)[0]


def test_a_token_unlocks_only_its_own_jobs_claim(store):
    """A live token named with another job's id, or a job that never claimed the profile, is refused."""
    two_jobs_claimed(store)
    assert_refused(store, OTHER_JOB, "t1")
    assert_refused(store, JOB_ID, "t2")
    assert_refused(store, "f" * 24, "t1")


def test_claims_hold_one_entry_per_job_newest_claim_last(store, clock):
    """The profile keeps each job's current token once, newest claim last, jobId naming the last claimer."""
    two_jobs_claimed(store)
    clock.advance(LEASE_S)
    claim(store, "t3", owner="w3")
    profile = store.get_profile(PROFILE_ID)
    assert profile["claims"] == [{"jobId": OTHER_JOB, "token": "t2", "epoch": 1},
                                 {"jobId": JOB_ID, "token": "t3", "epoch": 2}]
    assert profile["jobId"] == JOB_ID and profile["status"] == "processing" and profile["updatedAt"] == clock.now
    assert "claimToken" not in profile


def test_a_new_job_of_a_completed_profile_keeps_it_completed_and_may_write(store):
    """A re-train claimed after the profile completed leaves it completed and can still commit its own paths."""
    submit(store)
    claim(store, "t1")
    commit(store, "t1")
    submit(store, OTHER_JOB)
    claim(store, "t2", owner="w2", job_id=OTHER_JOB)
    assert store.get_profile(PROFILE_ID)["status"] == "completed"
    write_paths(store, OTHER_JOB, "t2")
    store.mark_profile_completed(PROFILE_ID, "t2", job_id=OTHER_JOB)
    assert store.get_profile(PROFILE_ID)["modelPaths"] == paths_of(OTHER_JOB)[0]


def test_job_ids_with_dots_are_fenced_apart(store, clock):
    """Ids that are prefixes of each other with dots ("voice", "voice.1") each get their own claim."""
    ids = ["voice", "voice.1", "voice.1.retrain"]
    for job_id in ids:
        submit(store, job_id, "profile.1")
        claim(store, f"t-{job_id}", job_id=job_id)
    for job_id in ids:
        write_paths(store, job_id, f"t-{job_id}", "profile.1")
    clock.advance(LEASE_S)
    claim(store, "t-new", job_id="voice.1")
    assert_refused(store, "voice.1", "t-voice.1", "profile.1")
    assert_refused(store, "voice", "t-voice.1.retrain", "profile.1")
    write_paths(store, "voice.1.retrain", "t-voice.1.retrain", "profile.1")
    write_paths(store, "voice.1", "t-new", "profile.1")


def test_claims_are_bounded_and_the_oldest_job_drops_out(store):
    """Past CLAIMS_KEPT jobs the least recently claimed one loses its fence; the rest keep theirs."""
    ids = [f"{n:024x}" for n in range(1, CLAIMS_KEPT + 2)]
    for job_id in ids:
        submit(store, job_id)
        claim(store, f"t{job_id}", job_id=job_id)
    assert len(store.get_profile(PROFILE_ID)["claims"]) == CLAIMS_KEPT
    assert_refused(store, ids[0], f"t{ids[0]}")
    for job_id in ids[1:]:
        write_paths(store, job_id, f"t{job_id}")


def test_concurrent_claims_of_one_profile_all_keep_their_entries(store):
    """Jobs of one profile claimed from several threads at once each end up holding the profile's fence."""
    ids = [f"{n:024x}" for n in range(1, 7)]
    for job_id in ids:
        submit(store, job_id)
    barrier, errors = threading.Barrier(len(ids)), []

    def claim_one(job_id: str) -> None:
        try:
            barrier.wait()
            assert claim(store, f"t{job_id}", job_id=job_id).outcome == "claimed"
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=claim_one, args=(job_id,)) for job_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    claims = store.get_profile(PROFILE_ID)["claims"]
    assert sorted((entry["jobId"], entry["token"]) for entry in claims) == [(j, f"t{j}") for j in ids]
    for job_id in ids:
        write_paths(store, job_id, f"t{job_id}")


def test_profile_writes_require_the_job_id(store):
    """The job id is a required keyword: a call written for the old per-profile fence fails loudly."""
    submit(store)
    claim(store, "t1")
    with pytest.raises(TypeError):
        store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS)
    with pytest.raises(TypeError):
        store.mark_profile_completed(PROFILE_ID, "t1")
    with pytest.raises(TypeError):
        store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, JOB_ID)


def pause_first_stamp(store, meanwhile) -> None:
    """Run ``meanwhile()`` (a newer claim) between the next claim's job swap and its profile stamp, once."""
    real_swap, paused = store._swap_profile, []

    def swap_after_a_pause(op, profile_id, allowed, change):
        if op == "claim" and not paused:
            paused.append(True)
            meanwhile()
        return real_swap(op, profile_id, allowed, change)

    store._swap_profile = swap_after_a_pause


def test_a_paused_claimers_late_stamp_is_refused_and_the_newer_holder_commits(store, clock):
    """A claimer paused past its lease between job swap and profile stamp cannot overwrite the newer claim."""
    submit(store)

    def newer_claim() -> None:
        clock.advance(LEASE_S + 1)
        assert claim(store, "t2", owner="w2").outcome == "claimed"

    pause_first_stamp(store, newer_claim)
    with pytest.raises(StaleWrite):
        claim(store, "t1")
    profile, job = store.get_profile(PROFILE_ID), store.get_job(JOB_ID)
    assert [entry for entry in profile["claims"] if entry["jobId"] == JOB_ID] == [
        {"jobId": JOB_ID, "token": "t2", "epoch": 2}]
    assert job["lease"]["token"] == "t2" and job["attempts"] == 2
    assert_refused(store, JOB_ID, "t1")
    commit(store, "t2")
    assert is_complete(store.get_job(JOB_ID), store.get_profile(PROFILE_ID))


def test_a_refused_stamp_releases_the_claimers_own_lease(store):
    """A stamp refused by a newer entry lets go of the job lease the same claim just took."""
    submit(store)
    claim(store, "t1")
    store.release_lease(JOB_ID, "t1")

    real_swap = store._swap_profile

    def newer_stamp() -> None:
        # Another claim's stamp that landed with a higher epoch (its job swap is not needed here).
        real_swap("claim", PROFILE_ID, lambda _p, _now: True,
                  lambda p, now: {**p, "claims": [{"jobId": JOB_ID, "token": "t9", "epoch": 9}]})

    pause_first_stamp(store, newer_stamp)
    with pytest.raises(StaleWrite):
        claim(store, "t2", owner="w2")
    job = store.get_job(JOB_ID)
    assert job["lease"] is None and job["history"][-1]["outcome"] == "released"
    assert store.get_profile(PROFILE_ID)["claims"] == [{"jobId": JOB_ID, "token": "t9", "epoch": 9}]


def test_a_stamp_over_a_legacy_entry_without_epoch_is_taken(store):
    """An entry written before epochs existed does not block a claim's stamp."""
    submit(store)
    claim(store, "t1")
    store.release_lease(JOB_ID, "t1")
    store._swap_profile("claim", PROFILE_ID, lambda _p, _now: True,
                        lambda p, now: {**p, "claims": [{"jobId": JOB_ID, "token": "legacy"}]})
    assert claim(store, "t2", owner="w2").outcome == "claimed"
    assert store.get_profile(PROFILE_ID)["claims"] == [{"jobId": JOB_ID, "token": "t2", "epoch": 2}]
