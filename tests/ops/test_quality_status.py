"""A refused job and the quality figures where an operator looks: `status` (text and --json), `jobs
--status refused`, `cancel`; and the reconciler, which treats refused as final."""

from __future__ import annotations

import io
import json

import pytest

from tests.ops.test_reconcile import LEASE_S, STALE_S, dead_letter, new_job, snapshot
from tests.ops.test_reconcile import clock as clock  # noqa: F401 - the reconciler's fixtures
from tests.ops.test_reconcile import reconciler as reconciler  # noqa: F401
from tests.ops.test_reconcile import sqs_client as sqs_client  # noqa: F401
from tests.ops.test_reconcile import store as store  # noqa: F401
from worker.ops.commands import EXIT_NOTHING_TO_DO, EXIT_OK, cmd_cancel, cmd_jobs, cmd_status

FIGURES = {
    "version": 1, "language": "en", "report": "/work/jobs/x/attempts/0001-aaaa/output/eval/quality.json",
    "models": {
        "full": {"speakerSimilarity": 0.41, "cer": 0.12, "wer": 0.3, "asr": "pocketsphinx en-us",
                 "asrUnavailable": None, "dnsmos": {"ovrl": 3.1, "sig": 3.4, "bak": 3.9},
                 "sanity": {"ok": True, "problems": []}},
        "light": {"speakerSimilarity": 0.78, "cer": None, "wer": None, "asr": None,
                  "asrUnavailable": "no speech recogniser for cy", "dnsmos": None,
                  "sanity": {"ok": False, "problems": ["silent"]}}},
    "reference": None, "cost": None,
    "gate": {"applied": True, "passed": False, "failed": ["full.speaker_similarity 0.41 < 0.70"], "bars": {}},
}


def refused_job(store, n: int = 1) -> str:
    job_id = new_job(store, n)
    store.claim(job_id, owner="w", token=f"t-{job_id}", lease_s=LEASE_S)
    store.record_quality(job_id, f"t-{job_id}", FIGURES)
    store.mark_refused(job_id, f"t-{job_id}", error_type="QualityBelowBar",
                       message="below the quality bar: full.speaker_similarity 0.41 < 0.70",
                       failed=FIGURES["gate"]["failed"], quality=FIGURES)
    return job_id


def test_status_shows_the_scores_the_failed_bar_and_the_report(store):
    job_id = refused_job(store)
    out, err = io.StringIO(), io.StringIO()
    assert cmd_status(store, job_id, as_json=False, out=out, err=err) == EXIT_OK
    text = out.getvalue()
    assert f"job {job_id}: refused" in text
    assert "QualityBelowBar (permanent)" in text
    assert "full: similarity 0.41  CER 0.12  DNSMOS 3.10  sanity ok" in text
    assert "light: similarity 0.78  CER - (no speech recogniser for cy)  DNSMOS -  sanity NOT ok" in text
    assert "gate: below the bar: full.speaker_similarity 0.41 < 0.70" in text
    assert "report: /work/jobs/x/attempts/0001-aaaa/output/eval/quality.json" in text
    assert err.getvalue() == ""  # refused is a status the view knows: no warning


def test_status_json_carries_the_figures(store):
    job_id = refused_job(store)
    out = io.StringIO()
    cmd_status(store, job_id, as_json=True, out=out, err=io.StringIO())
    document = json.loads(out.getvalue())
    assert document["quality"] == FIGURES and document["job"]["quality"] == FIGURES
    assert document["job"]["status"] == "refused" and document["problems"] == []


def test_status_of_odd_figures_shows_question_marks(store):
    job_id = new_job(store, 7)
    store.claim(job_id, owner="w", token="t", lease_s=LEASE_S)
    store.record_quality(job_id, "t", {"models": {"full": {"speakerSimilarity": "high"}}, "gate": 3})
    out = io.StringIO()
    cmd_status(store, job_id, as_json=False, out=out, err=io.StringIO())
    assert "full: similarity ?  CER -  DNSMOS -  sanity ?" in out.getvalue() and "gate: ?" in out.getvalue()


def test_jobs_lists_refused_jobs_with_their_reason(store):
    refused = refused_job(store, 1)
    new_job(store, 2)
    out = io.StringIO()
    assert cmd_jobs(store, status="refused", out=out, err=io.StringIO()) == EXIT_OK
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("1 refused job(s)")
    assert lines[1].startswith(refused) and "refused" in lines[1]
    assert "QualityBelowBar" in lines[2] and "0.41 < 0.70" in lines[2]


def test_the_cli_takes_refused_as_a_status():
    from worker.ops.cli import build_parser

    args = build_parser().parse_args(["jobs", "--status", "refused"])
    assert args.status == "refused"


def test_a_refused_job_has_nothing_to_cancel(store):
    job_id = refused_job(store)
    out, err = io.StringIO(), io.StringIO()
    assert cmd_cancel(store, job_id, heartbeat_s=60, out=out, err=err) == EXIT_NOTHING_TO_DO
    assert "already refused" in out.getvalue() + err.getvalue()


def test_the_reconciler_never_touches_a_refused_job(store, reconciler, queues, clock):  # noqa: F811
    """Not lost (its lease is gone and it is final), not re-enqueued, not marked dead-lettered even with a
    message for it in the DLQ: a second pass and the first write nothing."""
    job_id = refused_job(store)
    dead_letter(queues, job_id)
    clock.advance(STALE_S * 10)
    before = snapshot(store, job_id)
    store.writes.clear()
    report = reconciler.run()
    assert report.ok and (report.worker_lost, report.reenqueued, report.dead_lettered) == ([], [], [])
    assert store.writes == [] and snapshot(store, job_id) == before


@pytest.mark.parametrize("status", ["refused"])
def test_a_refused_job_is_final_to_the_reconcilers_rules(status):
    from datetime import UTC, datetime

    from worker.voice.records.recovery import awaiting_enqueue, may_record_dead_letter, worker_lost

    now = datetime(2030, 1, 1, tzinfo=UTC)
    job = {"status": status, "lease": None, "createdAt": datetime(2020, 1, 1, tzinfo=UTC), "heartbeatAt": None}
    assert not may_record_dead_letter(job, "m", now)
    assert not worker_lost(job, now, 1) and not awaiting_enqueue(job, now, 1)
