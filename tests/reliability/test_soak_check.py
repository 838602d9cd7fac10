"""The soak's checker and schedule on hand-made states: each invariant it claims to check can fail."""

from __future__ import annotations

import copy
from collections import Counter

from tests.reliability.soak import FAULT_KINDS, SoakConfig, fault_schedule
from tests.reliability.soak_check import COMPLETION, DLQ, LOST, OVERLAP, S3, SoakState, check, trainings
from tests.support import ARTIFACT_KEYS, SHIPPED_ARTIFACTS

JOB, PROFILE, MESSAGE = "job-1", "profile-1", "message-1"


def digests(tag: str) -> dict[str, str]:
    """What one training wrote: a distinct digest per artifact path."""
    return {rel: f"{tag}-{rel}" for rel in SHIPPED_ARTIFACTS.values()}


def run_lines(pid: int, start: float, end: float, tag: str, closing: str = "end") -> list[dict]:
    lines = [{"event": "start", "job": JOB, "pid": pid, "t": start},
             {"event": "tick", "job": JOB, "pid": pid, "t": (start + end) / 2}]
    if closing:
        lines.append({"event": closing, "job": JOB, "pid": pid, "t": end,
                      **({"digests": digests(tag)} if closing == "end" else {})})
    return lines


def key(name: str) -> str:
    return f"models/production/{PROFILE}/{JOB}/{SHIPPED_ARTIFACTS[name]}"


def good_state() -> SoakState:
    """One job trained twice one after the other (the first attempt stopped), committed once with the second's bytes."""
    written = digests("second")
    versions = {key(name): [{"version_id": f"v-{name}", "sha256": written[SHIPPED_ARTIFACTS[name]],
                             "body_sha256": written[SHIPPED_ARTIFACTS[name]]}] for name in ARTIFACT_KEYS}
    return SoakState(
        jobs={JOB: PROFILE},
        records={JOB: {"status": "completed", "history": [{"outcome": "lease_lost"}, {"outcome": "completed"}]}},
        profiles={PROFILE: {"status": "completed", "modelPaths": {n: f"/work/{n}" for n in ARTIFACT_KEYS},
                            "s3Paths": {n: f"s3://models/{key(n)}" for n in ARTIFACT_KEYS}}},
        commits_logged=Counter({JOB: 1}),
        snapshots={JOB: {key(name): [f"v-{name}"] for name in ARTIFACT_KEYS}},
        versions=versions,
        trainer_log=run_lines(100, 10.0, 12.0, "first", closing="stop") + run_lines(200, 15.0, 17.0, "second"),
    )


def kinds(state: SoakState) -> list[str]:
    return sorted({v.kind for v in check(state)})


def test_a_clean_run_has_no_violations():
    """One commit of one training's bytes, trainings one after the other, empty queues: nothing found."""
    assert check(good_state()) == []


def test_a_second_completion_is_found():
    """Two completed attempts in the history, or two commit lines in the logs, are a double commit."""
    state = good_state()
    state.records[JOB]["history"].append({"outcome": "completed"})
    assert kinds(state) == [COMPLETION]
    state = good_state()
    state.commits_logged[JOB] = 2
    assert kinds(state) == [COMPLETION]


def test_a_profile_missing_paths_is_found():
    """A completed job whose profile lacks a model path is not complete."""
    state = good_state()
    del state.profiles[PROFILE]["modelPaths"]["lightConfig"]
    assert kinds(state) == [COMPLETION]


def test_a_job_left_processing_is_lost():
    """A job that never reached a final state, or a message left on the queue, is lost."""
    state = good_state()
    state.records[JOB]["status"] = "processing"
    assert kinds(state) == [LOST]
    state = good_state()
    state.queue_left = 1
    assert kinds(state) == [LOST]


def test_an_object_written_after_the_commit_is_found():
    """A second version of a committed key (a stale attempt's late PUT) is a changed object."""
    state = good_state()
    late = {"version_id": "v-late", "sha256": "x", "body_sha256": "x"}
    state.versions[key("fullModel")].insert(0, late)
    found = check(state)
    assert {v.kind for v in found} == {S3}
    assert any("changed after the commit" in v.detail for v in found)
    assert any("2 versions" in v.detail for v in found)


def test_objects_mixing_two_trainings_are_found():
    """Five objects of which one holds the other training's bytes are not one training's output."""
    state = good_state()
    first = digests("first")[SHIPPED_ARTIFACTS["lightModel"]]
    state.versions[key("lightModel")] = [{"version_id": "v-lightModel", "sha256": first, "body_sha256": first}]
    state.trainer_log = run_lines(100, 10.0, 12.0, "first") + run_lines(200, 15.0, 17.0, "second")
    found = check(state)
    assert [v.kind for v in found] == [S3] and "not one training's bytes" in found[0].detail


def test_bytes_that_disagree_with_their_metadata_are_found():
    """An object whose sha256 metadata is not the hash of its bytes is found."""
    state = good_state()
    state.versions[key("fullConfig")][0]["sha256"] = "something else"
    found = check(state)
    assert [v.kind for v in found] == [S3] and "sha256 metadata" in found[0].detail


def test_overlapping_trainings_of_one_job_are_found():
    """A second training that starts before the first one ended is an overlap."""
    state = good_state()
    state.trainer_log = run_lines(100, 10.0, 16.0, "first", closing="stop") + run_lines(200, 15.0, 17.0, "second")
    assert kinds(state) == [OVERLAP]


def test_a_killed_training_ends_shortly_after_its_last_tick():
    """A run with no closing line (SIGKILLed) ends just after its last tick; a later one does not overlap it."""
    state = good_state()
    state.trainer_log = run_lines(100, 10.0, 12.0, "first", closing="") + run_lines(200, 15.0, 17.0, "second")
    [killed] = [r for r in trainings(state.trainer_log)[JOB] if r.pid == 100]
    assert 11.0 < killed.end < 12.0 and not killed.finished
    assert check(state) == []
    state.trainer_log = run_lines(100, 10.0, 30.0, "first", closing="") + run_lines(200, 15.0, 17.0, "second")
    assert kinds(state) == [OVERLAP]


def test_dead_letters_need_a_recorded_permanent_error_of_their_own():
    """A DLQ message is explained only by a permanent error recorded for that very message."""
    state = good_state()
    state.dead_letters = [{"message_id": MESSAGE, "body": {"jobId": JOB}}]
    assert kinds(state) == [DLQ]
    failed = copy.deepcopy(state)
    failed.records[JOB] = {"status": "failed", "history": [],
                           "error": {"type": "BadRecording", "retryable": False, "messageId": MESSAGE}}
    failed.profiles[PROFILE] = {"status": "failed"}
    assert kinds(failed) == [COMPLETION]  # explained, but the job did not complete
    failed.records[JOB]["error"]["messageId"] = "another-message"
    assert kinds(failed) == [COMPLETION, DLQ]


def test_the_schedule_is_a_function_of_the_seed_and_names_every_kind():
    """One seed gives one schedule; any ten or more faults include every kind, inside the window."""
    config = SoakConfig(seed=3, faults=10, window_s=30.0)
    schedule = fault_schedule(config)
    assert schedule == fault_schedule(SoakConfig(seed=3, faults=10, window_s=30.0))
    assert schedule != fault_schedule(SoakConfig(seed=4, faults=10, window_s=30.0))
    assert {f.kind for f in schedule} == set(FAULT_KINDS)
    assert all(0 < f.at_s < config.window_s and 0 <= f.slot < config.workers for f in schedule)
