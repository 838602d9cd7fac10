"""The quality report and the gate: the figures on the job record, the profile, the events and the
metrics; a model below a bar ends the job refused (nothing uploaded, published or written to the profile,
the message acknowledged, never dead-lettered); a malformed report is a permanent stage-contract error;
and the reference stand-in refuses staging and production jobs before any download."""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path

import pytest

from pipeline.config import QualityConfig, QualityGate
from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, deliver, message_body
from tests.voice.test_events import Collected
from worker.core.errors import PermanentError
from worker.core.metrics import Metrics
from worker.voice.artifacts import ArtifactUploader
from worker.voice.errors import BadQualityReport, StandInRefused
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.quality import MAX_REPORT_BYTES
from worker.voice.records.rules import QUALITY, REFUSED, failed_attempts

REPORT = "eval/quality.json"
GATE = QualityGate(min_speaker_similarity=0.70, max_cer=0.30, min_dnsmos_ovrl=3.0, require_sanity=True)


def scores(similarity: float = 0.81, cer: float | None = 0.12, ovrl: float = 3.1, ok: bool = True) -> dict:
    return {"speaker_similarity": similarity, "cer": cer, "wer": None if cer is None else 0.30,
            "asr": None if cer is None else "pocketsphinx en-us",
            "asr_unavailable": "no speech recogniser for xx" if cer is None else None,
            "dnsmos": {"ovrl": ovrl, "sig": 3.4, "bak": 3.9},
            "sanity": {"ok": ok, "problems": [] if ok else ["silent output"], "rms_dbfs": -22.0,
                       "peak_dbfs": -3.0, "clipped_fraction": 0.0, "seconds_per_char": 0.07}}


def report(full: dict | None = None, light: dict | None = None) -> dict:
    return {"version": 1, "language": "en", "sentences": ["Hello there."],
            "models": {"full": full or scores(), "light": light or scores(0.78)},
            "reference": scores(0.95), "cost": {"cpu_s": 12.3, "wall_s": 10.1, "peak_rss_mib": 900}}


def writes_report(train, content: dict | str | bytes) -> None:
    """The fake pipeline's evaluate stage: writes ``content`` as {output_dir}/eval/quality.json."""
    def during(job, work_dir, stop, progress):
        path = Path(work_dir) / "output" / REPORT
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict):
            path.write_text(json.dumps(content))
        else:
            path.write_bytes(content.encode() if isinstance(content, str) else content)
    train.during = during


class Gated:
    def __init__(self, handler, events, metrics_out):
        self.handler, self.events, self.metrics_out = handler, events, metrics_out

    def metric_docs(self) -> list[dict]:
        return [json.loads(line) for line in self.metrics_out.getvalue().splitlines()]


def make_gated(store, s3, train, tmp_path, gate: QualityGate | None = GATE, **config) -> Gated:
    events, out = Collected(), io.StringIO()
    handler = VoiceJobHandler(
        HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w", lease_s=60,
                      quality=QualityConfig(REPORT, gate), **config),
        store=store, uploader=ArtifactUploader(s3, BUCKET), train=train, events=events,
        metrics=Metrics(stream=out))
    return Gated(handler, events, out)


@pytest.fixture
def gated(store, s3, train, tmp_path):
    return make_gated(store, s3, train, tmp_path)


def objects(s3) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]


def published(tmp_path) -> list[Path]:
    models = tmp_path / "work" / ".models"
    return [p for p in models.rglob("*") if p.is_file()] if models.exists() else []


# ---------------------------------------------------------------- below a bar: refused


def test_a_model_below_a_bar_is_refused_acknowledged_and_nothing_is_committed(
        store, raw_store, s3, train, tmp_path, recorder, make_memory_worker, memory_queue):
    """Through the loop: acked (deleted), the DLQ empty; no object in S3, nothing published, no profile path;
    the record refused with the scores and the failed bar; JobFailed says why; no retry spent."""
    gated = make_gated(store, s3, train, tmp_path)
    writes_report(train, report(full=scores(similarity=0.41)))
    worker = make_memory_worker(gated.handler, queue=memory_queue)
    memory_queue.send(message_body())
    assert worker.run_once() == "ack"
    assert memory_queue.counts() == (0, 0) and memory_queue.dead_letter_queue.messages == []
    assert objects(s3) == [] and published(tmp_path) == []
    assert not [c for c in recorder.calls if c.startswith("s3.")]
    profile = raw_store.get_profile(PROFILE_ID)
    assert profile["modelPaths"] == {} and profile["s3Paths"] == {} and QUALITY not in profile
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == REFUSED and job["lease"] is None and failed_attempts(job) == 0
    assert job["error"]["type"] == "QualityBelowBar" and job["error"]["retryable"] is False
    assert job["error"]["failed"] == ["full.speaker_similarity 0.41 < 0.70"]
    assert job[QUALITY]["models"]["full"]["speakerSimilarity"] == 0.41
    assert job[QUALITY]["gate"] == {"applied": True, "passed": False, "failed": job["error"]["failed"],
                                    "bars": {"minSpeakerSimilarity": 0.7, "maxCer": 0.3, "minDnsmosOvrl": 3.0,
                                             "requireSanity": True}}
    # The job ended: its scratch goes, the report with it; the record keeps the report's figures.
    assert job[QUALITY]["models"]["full"]["speakerSimilarity"] == 0.41
    assert not Path(job[QUALITY]["report"]).exists()
    [(kind, detail)] = gated.events.events
    assert kind == "JobFailed" and detail["outcome"] == "refused"
    assert detail["error"]["type"] == "QualityBelowBar" and detail["error"]["retryable"] is False
    assert detail["failedBars"] == ["full.speaker_similarity 0.41 < 0.70"]
    assert detail["quality"]["models"]["full"]["speakerSimilarity"] == 0.41


@pytest.mark.parametrize(("full", "light", "failed"), [
    (scores(), scores(cer=0.45), ["light.cer 0.45 > 0.30"]),
    (scores(ovrl=2.5), scores(), ["full.dnsmos.ovrl 2.50 < 3.00"]),
    (scores(), scores(ok=False), ["light.sanity not ok (silent output)"]),
    (scores(0.699999), scores(0.5, cer=0.31), ["full.speaker_similarity 0.7000 < 0.70",
                                               "light.speaker_similarity 0.50 < 0.70", "light.cer 0.31 > 0.30"]),
])
def test_every_bar_applies_to_both_models(gated, raw_store, train, full, light, failed):
    writes_report(train, report(full=full, light=light))
    assert deliver(gated.handler, 1) == REFUSED
    assert raw_store.get_job(JOB_ID)["error"]["failed"] == failed


def test_a_redelivered_message_of_a_refused_job_is_acknowledged_without_work(gated, raw_store, train, s3):
    writes_report(train, report(light=scores(0.2)))
    assert deliver(gated.handler, 1) == REFUSED
    before = raw_store.get_job(JOB_ID)
    for receive, message_id in ((2, "m-1"), (1, "m-2")):  # its own redelivery, and another message
        assert deliver(gated.handler, receive, message_id=message_id) == REFUSED
    assert train.runs == 1 and raw_store.get_job(JOB_ID) == before and objects(s3) == []
    assert len(gated.events.events) == 1


# ---------------------------------------------------------------- at or above every bar: committed


def test_a_passing_report_commits_with_its_figures_on_the_record_and_the_profile(gated, raw_store, train, recorder):
    writes_report(train, report())
    assert deliver(gated.handler, 1) == "completed"
    job, profile = raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID)
    assert job["status"] == "completed" and profile["status"] == "completed"
    assert job[QUALITY] == profile[QUALITY]
    figures = job[QUALITY]
    assert figures["models"]["full"] == {
        "speakerSimilarity": 0.81, "cer": 0.12, "wer": 0.30, "asr": "pocketsphinx en-us", "asrUnavailable": None,
        "dnsmos": {"ovrl": 3.1, "sig": 3.4, "bak": 3.9}, "sanity": {"ok": True, "problems": []}}
    assert figures["reference"]["speakerSimilarity"] == 0.95 and figures["gate"]["passed"] is True
    assert figures["cost"] == {"cpuS": 12.3, "wallS": 10.1, "peakRssMib": 900.0}
    # The gate before the first upload; the profile's figures between its paths and its completion.
    calls = recorder.calls
    assert calls.index("store.record_quality") < min(i for i, c in enumerate(calls) if c.startswith("s3."))
    assert (calls.index("store.write_paths") < calls.index("store.write_profile_quality")
            < calls.index("store.mark_profile_completed"))
    [(kind, detail)] = gated.events.events
    assert kind == "JobCompleted" and detail["quality"] == figures


def test_a_null_cer_fails_no_cer_bar_and_is_shown_with_its_reason(gated, raw_store, train):
    writes_report(train, report(full=scores(cer=None), light=scores(cer=None)))
    assert deliver(gated.handler, 1) == "completed"
    full = raw_store.get_job(JOB_ID)[QUALITY]["models"]["full"]
    assert full["cer"] is None and full["asrUnavailable"] == "no speech recogniser for xx"


def test_report_only_commits_whatever_the_scores(store, raw_store, s3, train, tmp_path):
    gated = make_gated(store, s3, train, tmp_path, gate=None)
    writes_report(train, report(full=scores(0.1, cer=0.9, ovrl=1.2, ok=False), light=scores(0.1)))
    assert deliver(gated.handler, 1) == "completed"
    figures = raw_store.get_profile(PROFILE_ID)[QUALITY]
    assert figures["gate"] == {"applied": False, "passed": True, "failed": [], "bars": None}
    assert figures["models"]["full"]["speakerSimilarity"] == 0.1


def test_the_scores_are_emitted_per_model(gated, train):
    writes_report(train, report(light=scores(0.78, cer=None)))
    deliver(gated.handler, 1)
    docs = {d["Model"]: d for d in gated.metric_docs() if "Model" in d}
    assert set(docs) == {"full", "light"}
    assert (docs["full"]["ModelSpeakerSimilarity"], docs["full"]["ModelCer"], docs["full"]["ModelDnsmos"]) == (
        0.81, 0.12, 3.1)
    assert "ModelCer" not in docs["light"] and docs["light"]["ModelSpeakerSimilarity"] == 0.78
    [directive] = docs["full"]["_aws"]["CloudWatchMetrics"]
    assert directive["Dimensions"] == [["Model"]]
    assert {m["Name"] for m in directive["Metrics"]} == {"ModelSpeakerSimilarity", "ModelCer", "ModelDnsmos"}


def test_no_quality_table_reads_no_report(store, raw_store, s3, train, tmp_path):
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w",
                                            lease_s=60),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)
    writes_report(train, "not json")
    assert deliver(handler, 1) == "completed"
    assert QUALITY not in raw_store.get_job(JOB_ID) and QUALITY not in raw_store.get_profile(PROFILE_ID)


# ---------------------------------------------------------------- a malformed report


def broken(key: str, value) -> dict:
    content = copy.deepcopy(report())
    target = content
    *parents, last = key.split(".")
    for part in parents:
        target = target[part]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return content


@pytest.mark.parametrize(("content", "says"), [
    (b"", "not JSON"),
    ('{"version": 1, "models": {"full": {"cer": NaN}}}', "language: Field required"),
    (broken("models.full.cer", float("nan")), "models.full.cer"),
    (broken("models.full.speaker_similarity", "0.8"), "models.full.speaker_similarity"),
    (broken("models.light", KeyError), "no scores for light"),
    (broken("version", 2), "version"),
    (broken("models.full.cer", None), "asr_unavailable gives no reason"),
    (broken("models.full.surprise", 1), "models.full.surprise"),
    (b"{" + b" " * MAX_REPORT_BYTES + b"}", "larger than"),
])
def test_a_malformed_report_is_a_permanent_error_in_one_line(gated, raw_store, train, s3, content, says):
    writes_report(train, content)
    with pytest.raises(BadQualityReport) as caught:
        deliver(gated.handler, 1)
    assert isinstance(caught.value, PermanentError) and "\n" not in str(caught.value) and says in str(caught.value)
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "error" and job["error"]["type"] == "BadQualityReport"
    assert job["error"]["retryable"] is False and objects(s3) == []


def test_no_report_and_a_symlinked_one_are_malformed(gated, raw_store, train, tmp_path):
    assert isinstance(pytest.raises(BadQualityReport, deliver, gated.handler, 1).value, BadQualityReport)
    assert "wrote no report" in raw_store.get_job(JOB_ID)["error"]["message"]

    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(report()))

    def links(job, work_dir, stop, progress):
        path = Path(work_dir) / "output" / REPORT
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)
    train.during = links
    with pytest.raises(BadQualityReport, match="symlink"):
        deliver(gated.handler, 1, message_id="m-2")


# ---------------------------------------------------------------- the reference stand-in


def test_the_stand_in_refuses_a_production_job_before_any_work(store, raw_store, s3, train, tmp_path):
    """A permanent, typed error on the record; no download or training ran (the fake train never ran)."""
    gated = make_gated(store, s3, train, tmp_path, refused_environments=frozenset({"staging", "production"}))
    with pytest.raises(StandInRefused) as caught:
        deliver(gated.handler, 1)
    assert isinstance(caught.value, PermanentError) and "ALLOW_STAND_IN_TRAINER" in str(caught.value)
    assert train.runs == 0
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "error" and job["error"]["type"] == "StandInRefused" and job["error"]["retryable"] is False
    assert [kind for kind, _ in gated.events.events] == ["JobDeadLettered"]


def test_the_stand_in_trains_a_development_job(store, raw_store, s3, train, tmp_path):
    gated = make_gated(store, s3, train, tmp_path, refused_environments=frozenset({"staging", "production"}))
    writes_report(train, report())
    body = json.loads(message_body())
    body["environment"] = "development"
    assert deliver(gated.handler, 1, body=json.dumps(body)) == "completed" and train.runs == 1
