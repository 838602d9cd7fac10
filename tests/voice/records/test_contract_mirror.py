"""The Store contract for the S3 mirror's ledger: an attempt vouches, fenced, for what it mirrored."""

from __future__ import annotations

import pytest

from tests.voice.records.conftest import JOB_ID, LEASE_S, claim, submit
from worker.voice.mirror_ledger import RecordLedger
from worker.voice.records.errors import StaleWrite
from worker.voice.records.models import read_job
from worker.voice.records.rules import MIRROR, usage, vouched_mirrors

A = "a" * 32
B = "b" * 32
LISTING = "1" * 64
MANIFEST = "2" * 64


def test_an_attempt_vouches_on_its_own_history_entry(store):
    """The digest lands on the claiming attempt's entry, beside its number and token."""
    submit(store)
    claim(store, A)
    store.record_mirror(JOB_ID, A, "checkpoints/train_full", LISTING)
    store.record_mirror(JOB_ID, A, "output/embed", MANIFEST)
    [entry] = store.get_job(JOB_ID)["history"]
    assert (entry["attempt"], entry["token"]) == (1, A)
    assert entry[MIRROR] == {"checkpoints/train_full": LISTING, "output/embed": MANIFEST}


def test_an_attempt_that_lost_the_job_can_vouch_for_nothing(store, clock):
    """Once another claim took the job over, the old token's vouch is refused and changes no entry."""
    submit(store)
    claim(store, A)
    clock.advance(LEASE_S + 1)
    claim(store, B)
    with pytest.raises(StaleWrite):
        store.record_mirror(JOB_ID, A, "checkpoints/train_full", LISTING)
    assert all(MIRROR not in entry for entry in store.get_job(JOB_ID)["history"])


def test_the_next_attempt_sees_what_earlier_ones_vouched_for_under_their_names(store, clock):
    """The ledger names each earlier attempt as its directory is named, and leaves out its own."""
    submit(store)
    claim(store, A)
    store.record_mirror(JOB_ID, A, "checkpoints/train_full", LISTING)
    clock.advance(LEASE_S + 1)
    second = claim(store, B)
    store.record_mirror(JOB_ID, B, "checkpoints/train_full", MANIFEST)
    expected = {"0001-aaaaaaaa": {"checkpoints/train_full": LISTING}}
    assert RecordLedger(second.attempt, second.job).vouched() == expected
    assert RecordLedger(second.attempt, store.get_job(JOB_ID)).vouched() == expected


@pytest.mark.parametrize("entry", [
    {"attempt": "1", "token": A, MIRROR: {"x": LISTING}},
    {"attempt": True, "token": A, MIRROR: {"x": LISTING}},
    {"token": A, MIRROR: {"x": LISTING}},
    {"attempt": 1, "token": "../../x", MIRROR: {"x": LISTING}},
    {"attempt": 1, "token": A, MIRROR: "x"},
    {"attempt": 1, "token": A, MIRROR: {"x": "not a digest"}},
    "a string",
])
def test_entries_of_any_other_shape_vouch_for_nothing(entry):
    """A history entry edited by hand, or written before attempt numbers, gives a restore nothing."""
    assert vouched_mirrors(read_job({"history": [entry]}), B) == []


def test_the_reconciler_keeps_the_gpu_seconds_of_the_entries_it_trims(store, clock):
    """With a full history of 100-second attempts, the reconciler's entry pushes the oldest out and the
    job's GPU-seconds stay 2,000, write after write."""
    from worker.voice.records.rules import HISTORY_LIMIT

    submit(store)
    for n in range(HISTORY_LIMIT):
        claim(store, f"{n:032x}")
        store.renew_lease(JOB_ID, f"{n:032x}", LEASE_S, gpu_seconds=100.0)
        clock.advance(LEASE_S + 1)
    assert usage(store.get_job(JOB_ID))["gpuSeconds"] == 100.0 * HISTORY_LIMIT
    clock.advance(7200)
    assert store.mark_worker_lost(JOB_ID, stale_after_s=60, worker="reconciler")
    assert store.record_dead_letter(JOB_ID, dead_letter={"messageId": "m-1", "receiveCount": 5}, worker="reconciler")
    job = store.get_job(JOB_ID)
    assert len(job["history"]) == HISTORY_LIMIT
    assert usage(job)["gpuSeconds"] == 100.0 * HISTORY_LIMIT
