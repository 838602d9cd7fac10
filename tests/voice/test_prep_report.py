"""The trainers' data-preparation report (prep/report.json) on the job record and in `status`: what was
kept and left out, and why; a malformed report is a permanent stage-contract error; none, nothing."""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path

import pytest

from pipeline.errors import StageFailedPermanently
from tests.voice.conftest import BUCKET, JOB_ID, deliver
from worker.core.errors import PermanentError
from worker.ops.commands import EXIT_OK, cmd_status
from worker.voice.artifacts import ArtifactUploader
from worker.voice.errors import BadPrepReport, TooLittleSpeech
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.prep_report import MAX_REPORT_BYTES, RECORD_LEFT_OUT, REPORT_PATH, dataset_record, summary_line
from worker.voice.records.rules import COMPLETED, DATASET


def left_out(number: int, reason: str = "noisy") -> dict:
    return {"id": f"utt{number:05d}", "source": number, "reason": reason,
            "detail": "speech 7.1 dB over the pauses' noise (at least 15 dB)", "seconds": 4.67}


REPORT = {
    "version": 1, "profile": "ci", "minimum": {"speechS": 5.0, "clips": 4},
    "totals": {"recordings": 6, "recordingsS": 30.5, "keptClips": 4, "keptS": 15.3, "leftOutClips": 2,
               "leftOutByReason": {"another_speaker": 1, "noisy": 1}},
    "kept": [{"id": f"utt{i:05d}", "source": i, "seconds": 3.8} for i in range(4)],
    "leftOut": [left_out(4, "another_speaker"), left_out(5)],
    "refused": None,
}


def writes(train, content: dict | bytes) -> None:
    """The fake pipeline's embed stage: writes ``content`` as {output_dir}/prep/report.json."""
    def during(job, work_dir, stop, progress):
        path = Path(work_dir) / "output" / REPORT_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    train.during = during


@pytest.fixture
def handler(store, s3, train, tmp_path):
    return VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w",
                                         lease_s=60),
                           store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)


def test_the_report_goes_onto_the_job_record_and_into_status(handler, store, raw_store, train):
    """A completed job's record lists the kept and left-out clips with reasons; status sums them in one line."""
    writes(train, REPORT)
    assert deliver(handler, 1) == COMPLETED
    job = raw_store.get_job(JOB_ID)
    assert job[DATASET]["totals"] == REPORT["totals"]
    assert job[DATASET]["leftOut"] == REPORT["leftOut"] and job[DATASET]["kept"] == REPORT["kept"]
    out = io.StringIO()
    assert cmd_status(store, JOB_ID, as_json=False, out=out, err=io.StringIO()) == EXIT_OK
    assert ("kept 4 clips (15.3 s of 30.5 s recorded), left out 2: another_speaker 1, noisy 1"
            in out.getvalue())


def test_stages_that_write_no_report_record_no_dataset(handler, raw_store):
    """The reference stand-in writes no preparation report: the job completes with no ``dataset``."""
    assert deliver(handler, 1) == COMPLETED
    assert DATASET not in raw_store.get_job(JOB_ID)


def bad(change) -> dict:
    report = copy.deepcopy(REPORT)
    change(report)
    return report


@pytest.mark.parametrize(("content", "says"), [
    (b"{not json", "not JSON"),
    (bad(lambda r: r["leftOut"][0].update(reason="ugly")), "leftOut.0.reason"),
    (bad(lambda r: r["kept"][0].update(id="../../etc")), "kept.0.id"),
    (bad(lambda r: r.update(extra=1)), "extra"),
    (bad(lambda r: r["totals"].update(keptS=float("nan"))), "totals.keptS"),
    (b" " * (MAX_REPORT_BYTES + 1), "larger than"),
])
def test_a_malformed_report_is_a_permanent_error_in_one_line(handler, raw_store, train, content, says):
    """Not JSON, an unknown reason, an unsafe id, an extra field, NaN or an oversized file: BadPrepReport."""
    writes(train, content if isinstance(content, bytes) else json.dumps(content).encode())
    with pytest.raises(BadPrepReport) as caught:
        deliver(handler, 1)
    assert isinstance(caught.value, PermanentError) and "\n" not in str(caught.value) and says in str(caught.value)
    assert raw_store.get_job(JOB_ID)["error"]["type"] == "BadPrepReport"


def test_a_symlinked_report_is_refused(handler, train, tmp_path):
    """The report is read without following a link."""
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(REPORT))

    def links(job, work_dir, stop, progress):
        path = Path(work_dir) / "output" / REPORT_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)
    train.during = links
    with pytest.raises(BadPrepReport, match="symlink"):
        deliver(handler, 1)


def test_the_record_lists_at_most_the_first_clips_and_counts_the_rest():
    """A report of many left-out clips keeps the first RECORD_LEFT_OUT on the record and the count of the rest."""
    from worker.voice.prep_report import PrepReport

    many = bad(lambda r: r.update(leftOut=[left_out(n) for n in range(RECORD_LEFT_OUT + 7)]))
    record = dataset_record(PrepReport.model_validate(many))
    assert len(record["leftOut"]) == RECORD_LEFT_OUT and record["leftOutNotListed"] == 7
    assert record["keptNotListed"] == 0


def test_the_summary_of_a_damaged_record_is_a_question_mark():
    """A record whose dataset has no totals shows ``?`` rather than failing the command."""
    assert summary_line({"kept": []}) == "?" and summary_line("junk") == "?"  # type: ignore[arg-type]


def test_a_stage_that_refused_too_little_speech_fails_typed_with_the_report_on_the_record(handler, raw_store, train):
    """A permanent stage failure after a report that refused the data is TooLittleSpeech, with ``dataset`` kept."""
    refused = bad(lambda r: r.update(refused="3.0 s of speech, at least 5 s needed"))

    def refuses(job, work_dir, stop, progress):
        writes(train, refused)
        train.during(job, work_dir, stop, progress)
        raise StageFailedPermanently("stage embed exited with code 65: unusable data: too little usable speech")
    train.during = refuses
    with pytest.raises(TooLittleSpeech) as caught:
        deliver(handler, 1)
    assert isinstance(caught.value.__cause__, StageFailedPermanently)
    assert "3.0 s of speech, at least 5 s needed" in str(caught.value)
    job = raw_store.get_job(JOB_ID)
    assert job["error"]["type"] == "TooLittleSpeech" and job[DATASET]["refused"] == refused["refused"]


def test_a_permanent_stage_failure_without_a_refusal_stays_the_stages_own(handler, raw_store, train):
    """A report that refused nothing leaves a permanent stage failure as it was."""
    def fails(job, work_dir, stop, progress):
        writes(train, REPORT)
        train.during(job, work_dir, stop, progress)
        raise StageFailedPermanently("stage train_full exited with code 65: unusable base model")
    train.during = fails
    with pytest.raises(StageFailedPermanently):
        deliver(handler, 1)
    assert raw_store.get_job(JOB_ID)["error"]["type"] == "StageFailedPermanently"
