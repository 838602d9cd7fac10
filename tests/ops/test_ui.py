"""`python -m worker ui`: the read-only page's routes, headers and views, over HTTP against a real store."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from tests.ops.ui_support import JOB, LOSS, OTHER, running_job, write_fields
from tests.ops.ui_support import bench as bench  # noqa: F401 - the fixture
from worker.ops.ui import views
from worker.ops.ui.server import CSP, allowed_hosts, jobs_filters
from worker.ops.ui.sources import Sources


def test_the_jobs_list_links_each_job_and_shows_its_progress(bench):
    """GET / lists the jobs newest first, each linked to its page, with stage and percent."""
    running_job(bench.store, JOB)
    running_job(bench.store, OTHER, percent=75)
    status, headers, body = bench.call("/")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert f'href="/jobs/{JOB}"' in body and f'href="/jobs/{OTHER}"' in body
    assert body.index(OTHER) < body.index(JOB)  # the newer first
    assert "train_full 75 %" in body


def test_the_filters_narrow_the_list_by_status_time_and_id_text(bench):
    """status, since and q (id contains) each narrow the list; an unknown status is a 400."""
    running_job(bench.store, JOB)
    bench.store.submit({"_id": OTHER, "profileId": "p2"}, {"_id": "p2"})
    assert OTHER in bench.call("/?status=pending")[2] and JOB not in bench.call("/?status=pending")[2]
    assert JOB in bench.call("/?q=AAAA")[2] and OTHER not in bench.call("/?q=aaaa")[2]
    assert JOB in bench.call("/?since=1h")[2]
    assert "no jobs match" in bench.call("/?since=2030-01-01T00:00Z")[2]
    assert bench.call("/?status=running")[0] == 400
    assert bench.call("/?since=yesterday")[0] == 400
    assert bench.call("/?q=" + "x" * 129)[0] == 400


def test_a_jobs_page_shows_stages_progress_eta_quality_base_model_and_log_tail(bench):
    """The job's page has stage k of n, both percents, step, ETA, latest metrics, scores, base and log."""
    running_job(bench.store)
    write_fields(bench.store, JOB, {
        "quality": {"models": {"full": {"speakerSimilarity": 0.81, "cer": 0.05, "dnsmos": {"ovrl": 3.2},
                                        "sanity": {"ok": True}}}, "gate": {"passed": True}},
        "baseModel": {"name": "xtts-v2", "licence": "CPML", "digest": "sha256:feed"}})
    bench.tails[JOB] = "step 240/500 loss 0.08"
    status, _, body = bench.call(f"/jobs/{JOB}")
    assert status == 200
    for shown in ("stage 2 of 3", "40 %", "52 %", ">240<", "1h10m30s", "loss 0.08", "0.81", "3.20", "gate: passed",
                  "xtts-v2", "CPML", "sha256:feed", "step 240/500 loss 0.08", f'data-job-id="{JOB}"'):
        assert shown in body, shown


def test_the_loss_curve_is_a_polyline_with_one_point_per_recorded_step(bench):
    """Each loss series of a stage is drawn as an SVG polyline with as many points as were recorded."""
    running_job(bench.store)
    body = bench.call(f"/jobs/{JOB}")[2]
    lines = re.findall(r'<polyline class=curve points="([^"]*)">', body)
    assert sorted(len(points.split()) for points in lines) == [3, len(LOSS)]
    assert "lr" in body and "val_cer" in body  # not charted: their latest values in the table


def test_the_json_endpoint_answers_what_the_page_refreshes(bench):
    """/api/jobs/<id> answers the page's fields as JSON, never cached."""
    running_job(bench.store)
    status, headers, body = bench.call(f"/api/jobs/{JOB}")
    data = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json" and headers["cache-control"] == "no-store"
    assert data["progress"]["percent"] == 40.0 and data["progress"]["stageOf"] == "stage 2 of 3"
    assert [chart["count"] for chart in data["charts"]] == [len(LOSS), 3]
    assert data["final"] is False


def test_every_answer_carries_the_security_headers(bench):
    """A strict CSP with no inline script, framing refused, nosniff: on pages, the API, assets and errors."""
    for path in ("/", f"/jobs/{JOB}", "/api/jobs", "/static/ui.js", "/nowhere"):
        _, headers, _ = bench.call(path)
        assert headers["content-security-policy"] == CSP
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in CSP and "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "PURGE"])
def test_every_method_but_get_is_405(bench, method):
    """The page is read-only: any other method, known or made up, is refused with 405 and Allow: GET."""
    running_job(bench.store)
    status, headers, _ = bench.call(f"/jobs/{JOB}", method=method)
    assert status == 405 and headers["allow"] == "GET"
    assert bench.store.get_job(JOB).status == "processing"


@pytest.mark.parametrize("path", ["/jobs/..", "/jobs/%2e%2e%2fetc", "/jobs/a%20b", "/api/jobs/-x", "/jobs/" + "a" * 129,
                                  "/jobs/%3Cscript%3E"])
def test_a_job_id_in_the_path_is_validated(bench, path):
    """What is not a job id (path tricks, markup, too long) is a 400 before any store read."""
    status, _, body = bench.call(path)
    assert status == 400 and "<script>" not in body


def test_an_unknown_job_is_a_404(bench):
    """A valid id with no record: 404, as a page and as JSON."""
    assert bench.call(f"/jobs/{JOB}")[0] == 404
    status, _, body = bench.call(f"/api/jobs/{JOB}")
    assert status == 404 and json.loads(body) == {"error": f"no job {JOB}"}


def test_a_foreign_host_header_is_refused_on_loopback(bench):
    """A page elsewhere whose name was rebound to 127.0.0.1 sends its own Host: it gets no data."""
    running_job(bench.store)
    assert bench.call("/api/jobs", host="evil.example:80")[0] == 421
    assert bench.call("/api/jobs", host=f"localhost:{bench.port}")[0] == 200
    assert allowed_hosts("0.0.0.0", 8765) is None  # exposed on purpose: any name


def test_malicious_fields_are_escaped_and_secrets_redacted(bench):
    """HTML and script in any field come out as text; a presigned query and a password are cut."""
    running_job(bench.store)
    evil = '<script>alert(1)</script><img src=x onerror=alert(2)>"\'&'
    write_fields(bench.store, JOB, {"status": "error", "error": {
        "type": evil, "retryable": False,
        "message": "get https://b.s3.amazonaws.com/k?X-Amz-Signature=deadbeef failed; password=hunter2 " + evil},
        "progress": {"stage": evil, "latest": {evil: 1.0}}, "metrics": {evil: {"loss" + evil: LOSS}}})
    bench.tails[JOB] = evil
    for path in (f"/jobs/{JOB}", "/"):
        body = bench.call(path)[2]
        assert "<script>alert" not in body and "<img" not in body
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
        assert "deadbeef" not in body and "hunter2" not in body
    assert "https://b.s3.amazonaws.com/k failed" in bench.call(f"/jobs/{JOB}")[2]


def test_long_text_is_truncated(bench):
    """A megabyte of error text shows as at most LONG_CHARS characters, ending in an ellipsis."""
    running_job(bench.store)
    write_fields(bench.store, JOB, {"status": "error", "error": {"type": "X" * 5000, "message": "m" * 1_000_000}})
    data = json.loads(bench.call(f"/api/jobs/{JOB}")[2])
    assert len(data["error"]["message"]) == views.LONG_CHARS and data["error"]["message"].endswith("…")
    assert len(data["error"]["type"]) == views.SHORT_CHARS


def test_the_workers_page_lists_presence_records_and_marks_stale_ones(bench):
    """Each worker's presence is listed; one not seen for several ticks is marked stale."""
    bench.store.upsert_worker({"workerId": "w-old", "host": "h1", "version": "0.1", "state": "idle", "intervalS": 10.0})
    bench.store._clock.advance(3600)
    bench.store.upsert_worker({"workerId": "w-new", "host": "h2", "version": "0.1", "state": "working",
                               "jobId": JOB, "intervalS": 10.0, "device": "cuda"})
    body = bench.call("/workers")[2]
    assert "w-old <span class=stale>stale</span>" in body and "w-new <span class=stale>" not in body
    assert f'href="/jobs/{JOB}"' in body and "cuda" in body


def test_without_a_queue_the_queue_page_says_why(bench):
    """No SQS_QUEUE_URL: the queue page names the setting instead of failing."""
    status, _, body = bench.call("/queue")
    assert status == 200 and "SQS_QUEUE_URL is not set" in body


def test_the_queue_page_shows_the_queue_commands_counts(bench, queues):
    """The same counts as `queue`, read through queue_view.look; the DLQ's depth too."""
    from tests.ops.test_queue_view import NOW, FakeCloudWatch
    from worker.ops.queue_view import look

    queues.sqs.send_message(QueueUrl=queues.url, MessageBody="{}")
    cloudwatch = FakeCloudWatch([{"Timestamp": NOW - timedelta(minutes=2), "Maximum": 95.0}])
    bench.sources.queue_look = lambda: look(queues.sqs, queues.url, cloudwatch, NOW)
    data = json.loads(bench.call("/api/queue")[2])["queue"]
    assert data["visible"] == "1" and data["oldest"].startswith("1m35s") and data["dlq"]["visible"] == "0"
    assert "Dead letters" in bench.call("/queue")[2]


def test_a_store_failure_is_a_503_with_one_line(bench):
    """The store gone: a 503 page with its error line, and the server goes on answering."""
    bench.store.close()
    status, _, body = bench.call("/")
    assert status == 503 and "sqlite" in body
    assert bench.call("/static/ui.css")[0] == 200


def test_the_static_script_writes_no_markup():
    """ui.js sets text only: no innerHTML, outerHTML, insertAdjacentHTML, document.write or eval."""
    from worker.ops.ui.assets import UI_JS

    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in UI_JS


# ---------------------------------------------------------------- the views, as pure functions

def test_a_polyline_has_one_point_per_value_scaled_into_the_box():
    """Steps run left to right, the smallest value at the bottom, the largest at the top, inside the pad."""
    points = views.polyline([(0, 2.0), (50, 1.0), (100, 0.0)], width=100, height=50, pad=5)
    assert points == "5.0,5.0 50.0,25.0 95.0,45.0"
    assert views.polyline([(0, 1.0), (10, 1.0)], width=100, height=50, pad=5) == "5.0,25.0 95.0,25.0"
    assert views.polyline([]) == ""


def test_a_series_keeps_only_finite_step_value_pairs_in_step_order():
    """Junk entries another writer left (text, NaN, wrong shapes) are skipped, not drawn."""
    series = [[20, 1.0], [10, 2.0], ["x", 1.0], [30, float("nan")], [40], None, [True, 1.0], [50, 0.5]]
    assert views.series_points(series) == [(10.0, 2.0), (20.0, 1.0), (50.0, 0.5)]
    assert views.series_points("nonsense") == []


def test_progress_without_the_new_fields_shows_question_marks():
    """A record from before the stage contract's fields: stage and percent, the rest ? or -."""
    from worker.voice.records.view import job_view

    job = job_view({"_id": JOB, "status": "processing", "progress": {"stage": "train_full", "percent": 10,
                                                                     "updatedAt": datetime(2026, 1, 1, tzinfo=UTC)}})
    p = views.progress_view(job, datetime(2026, 1, 1, 0, 5, tzinfo=UTC))
    assert (p["stage"], p["percentText"], p["overallText"], p["eta"], p["step"], p["stageOf"]) == (
        "train_full", "10 %", "?", "?", "-", "")


def test_elapsed_counts_from_the_stage_start():
    """stageStartedAt five minutes ago: 5m00s elapsed; a finished job shows none."""
    from worker.voice.records.view import job_view

    now = datetime(2026, 1, 1, 1, 0, tzinfo=UTC)
    doc = {"_id": JOB, "status": "processing", "progress": {"stage": "s", "percent": 1, "updatedAt": now,
                                                            "stageStartedAt": now - timedelta(minutes=5)}}
    assert views.progress_view(job_view(doc), now)["elapsed"] == "5m00s"
    assert views.progress_view(job_view({**doc, "status": "completed"}), now)["elapsed"] == "-"


def test_the_filters_parse_durations_and_times():
    """since takes what `jobs --since` takes."""
    assert jobs_filters({"since": ["2h"]})[3] == timedelta(hours=2)
    assert jobs_filters({"since": ["2026-12-01T09:00"]})[3] == datetime(2026, 12, 1, 9, tzinfo=UTC)
    assert jobs_filters({})[:3] == ("", "", "")


def test_a_missing_log_reader_is_named():
    """Without S3_BUCKET the log section says why there is no tail."""
    assert "S3_BUCKET" in Sources(store=None)._tail(JOB)[1]  # type: ignore[arg-type]


def test_python_m_worker_ui_serves_the_store_and_stops_on_ctrl_c(tmp_path):
    """The command opens STORE_URL read-only, says where it serves, answers GET, and exits 0 on SIGINT."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from worker.voice.records.sqlite import SqliteStore

    with SqliteStore(str(tmp_path / "records.db")) as store:
        running_job(store)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQS_", "STORE_", "MONGO_", "S3_"))}
    env["STORE_URL"] = f"sqlite:///{tmp_path}/records.db"
    ui = subprocess.Popen([sys.executable, "-m", "worker", "ui", "--port", "0"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        line = ui.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert url, line + ui.stderr.read() if ui.poll() is not None else line
        with urllib.request.urlopen(url[0] + f"api/jobs/{JOB}", timeout=10) as answer:
            data = json.loads(answer.read())
        assert data["progress"]["stage"] == "train_full"
        assert "S3_BUCKET" in data["logTail"]["note"]
        with urllib.request.urlopen(url[0] + "queue", timeout=10) as answer:
            assert "SQS_QUEUE_URL is not set" in answer.read().decode()
    finally:
        ui.send_signal(signal.SIGINT)
        code = ui.wait(timeout=30)
        ui.stdout.close()
        ui.stderr.close()
    assert code == 0


def test_a_job_without_progress_has_its_progress_section_hidden(bench):
    """A pending job: no progress in the answer, the section drawn hidden for the script to reveal."""
    bench.store.submit({"_id": JOB, "profileId": "p"}, {"_id": "p"})
    assert json.loads(bench.call(f"/api/jobs/{JOB}")[2])["progress"] is None
    assert '<section data-show="progress" hidden><h2>Progress</h2>' in bench.call(f"/jobs/{JOB}")[2]


@pytest.mark.parametrize("status, error, final", [
    ("processing", None, False), ("completed", None, True), ("error", {"type": "X", "retryable": True}, False),
    ("error", {"type": "X", "retryable": False}, True), ("refused", {"type": "QualityBelowBar"}, True)])
def test_the_page_stops_polling_once_nothing_more_will_happen(bench, status, error, final):
    """Final statuses and an error no retry follows end the polling; a retryable error does not."""
    running_job(bench.store)
    write_fields(bench.store, JOB, {"status": status, **({"error": error} if error else {})})
    assert json.loads(bench.call(f"/api/jobs/{JOB}")[2])["final"] is final
    assert f'data-final="{int(final)}"' in bench.call(f"/jobs/{JOB}")[2]


def test_the_eta_counts_down_from_the_report_that_estimated_it(bench):
    """etaS 4230 s reported; 30 minutes later, with no new report, the page says 40m30s."""
    running_job(bench.store)
    assert json.loads(bench.call(f"/api/jobs/{JOB}")[2])["progress"]["eta"] == "1h10m30s"
    bench.store._clock.advance(1800)
    assert json.loads(bench.call(f"/api/jobs/{JOB}")[2])["progress"]["eta"] == "40m30s"
