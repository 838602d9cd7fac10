"""The Store contract for a stage's notes: kept on the attempt's own entry, fenced, bounded, redacted."""

from __future__ import annotations

import pytest

from tests.voice.records.conftest import JOB_ID, LEASE_S, claim, submit
from worker.voice.records.errors import StaleWrite
from worker.voice.records.rules import NOTE_MAX_CHARS, NOTES, NOTES_KEPT

A = "a" * 32
B = "b" * 32


def test_a_note_lands_on_the_attempts_own_entry(store):
    """The stage and its text, in order, on the claiming attempt's history entry."""
    submit(store)
    claim(store, A)
    store.record_note(JOB_ID, A, "train_full", "left out 1 clip(s) after phonemising: clip 0 (utt00000)")
    store.record_note(JOB_ID, A, "embed", "left out utt00003: nothing but silence")
    [entry] = store.get_job(JOB_ID)["history"]
    assert entry[NOTES] == [
        {"stage": "train_full", "text": "left out 1 clip(s) after phonemising: clip 0 (utt00000)"},
        {"stage": "embed", "text": "left out utt00003: nothing but silence"}]


def test_notes_are_bounded_and_redacted(store):
    """Only the last notes are kept, each cut to its bound, a signed query string never stored."""
    submit(store)
    claim(store, A)
    for n in range(NOTES_KEPT + 3):
        store.record_note(JOB_ID, A, "s", f"note {n} " + "x" * 2 * NOTE_MAX_CHARS)
    store.record_note(JOB_ID, A, "s", "from https://b.s3.amazonaws.com/k?X-Amz-Signature=abcdef0123 done")
    notes = store.get_job(JOB_ID)["history"][-1][NOTES]
    assert len(notes) == NOTES_KEPT and notes[0]["text"].startswith("note 4 ")
    assert all(len(n["text"]) <= NOTE_MAX_CHARS for n in notes)
    assert "abcdef0123" not in notes[-1]["text"]


def test_an_attempt_that_lost_the_job_notes_nothing(store, clock):
    """Once another claim took the job, the old token's note is refused."""
    submit(store)
    claim(store, A)
    clock.advance(LEASE_S + 1)
    claim(store, B)
    with pytest.raises(StaleWrite):
        store.record_note(JOB_ID, A, "s", "late")
    assert all(NOTES not in entry for entry in store.get_job(JOB_ID)["history"])
