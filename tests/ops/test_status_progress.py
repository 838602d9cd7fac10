"""`status` answers how far (stage k of n, percent, overall percent), how long (elapsed, ETA), how well
(step, latest metrics, quality) and who (the worker holding it), with the cost in the unit of the
device the trainer ran on; --json carries the same fields and --watch follows them."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest

from tests.voice.records.conftest import JOB_ID, WallClock, claim, make_store, submit
from worker.ops.commands import WIDTH, cmd_status, render_status, status_document

DETAIL = {"step": 780, "stageIndex": 4, "stageCount": 5, "overallPercent": 37.5, "etaS": 600.0,
          "stageElapsedS": 125.0, "device": "cuda", "latest": {"loss": 0.13898, "lr": 0.0002}}


@pytest.fixture(params=["sqlite", "mongomock"])
def running(request, tmp_path):
    """A job claimed by worker "ip-10-0-1-24", 60 s into its attempt, with a detailed progress write."""
    clock = WallClock()
    store = make_store(request.param, tmp_path, clock)
    submit(store)
    claim(store, "t", owner="ip-10-0-1-24")
    clock.advance(60)
    store.set_progress(JOB_ID, "t", "train_full", 16.0, gpu_seconds=42.0, detail=DETAIL,
                       series={"loss": [[1, 2.0], [780, 0.13898]]})
    yield store, clock
    store.close()


def test_status_says_how_far_how_long_how_well_and_who(running):
    """Stage 4 of 5 with the overall percent, step and latest loss, the elapsed times and the ETA to the
    wall clock, the holder, and GPU-seconds for a cuda attempt; every line within 80 columns."""
    store, clock = running
    clock.advance(30)  # the status is read 30 s after the report
    text = render_status(status_document(store, JOB_ID), now=clock.now)
    assert "  progress   stage 4 of 5: train_full 16 %  overall 38 %  at 12:01:00Z" in text
    assert "  latest     step 780  loss 0.139  lr 0.0002" in text
    assert "  elapsed    2m35s in this stage  1m30s in this attempt" in text
    eta = (clock.now - timedelta(seconds=30) + timedelta(seconds=600)).strftime("%H:%M:%SZ")
    assert f"ETA {eta} (in 9m30s)" in text
    assert "held by ip-10-0-1-24" in text
    assert "42 GPU-s, of which 0 wasted" in text and "CPU-s" not in text
    assert max(len(line) for line in text.splitlines()) <= WIDTH, text


def test_status_json_carries_the_same_fields(running):
    """--json has a progress object with what the text shows, the cost's unit, and the series on the job."""
    store, clock = running
    out = io.StringIO()
    assert cmd_status(store, JOB_ID, as_json=True, out=out, wall_clock=lambda: clock.now) == 0
    doc = json.loads(out.getvalue())
    progress = doc["progress"]
    assert {k: progress[k] for k in ("stage", "stageIndex", "stageCount", "percent", "overallPercent", "step",
                                     "latest", "stageElapsedS", "attemptElapsedS", "etaS", "worker", "device")} == {
        "stage": "train_full", "stageIndex": 4, "stageCount": 5, "percent": 16.0, "overallPercent": 37.5,
        "step": 780, "latest": {"loss": 0.13898, "lr": 0.0002}, "stageElapsedS": 125.0, "attemptElapsedS": 60.0,
        "etaS": 600.0, "worker": "ip-10-0-1-24", "device": "cuda"}
    assert progress["etaAt"] == (clock.now + timedelta(seconds=600)).isoformat()
    assert doc["costUnit"] == "GPU-s"
    assert doc["job"]["metrics"] == {"train_full": {"loss": [[1, 2.0], [780, 0.13898]]}}


def test_a_finished_job_shows_where_it_stopped_without_a_clock(running):
    """A final job keeps its last progress but shows no elapsed time, ETA or holder."""
    store, clock = running
    store.mark_cancelled(JOB_ID, "t", gpu_seconds=50.0)
    clock.advance(3600)
    text = render_status(status_document(store, JOB_ID), now=clock.now)
    assert "stage 4 of 5: train_full 16 %" in text and "step 780" in text
    assert "elapsed" not in text and "ETA" not in text and "held by" not in text
    assert status_document(store, JOB_ID).as_json(clock.now)["progress"]["etaAt"] is None


def test_an_older_record_reads_as_before_and_its_time_as_cpu_seconds(tmp_path):
    """A progress of stage, percent and time alone (an older worker's) shows as before, its cost in CPU-s."""
    clock = WallClock()
    store = make_store("sqlite", tmp_path, clock)
    try:
        submit(store)
        claim(store, "t", owner="w1")
        store.set_progress(JOB_ID, "t", "train_full", 16.0, gpu_seconds=61.0)
        text = render_status(status_document(store, JOB_ID), now=clock.now)
        assert "  progress   train_full 16 %  at 12:00:00Z" in text
        assert "latest" not in text and "overall" not in text and "ETA" not in text
        assert "61 CPU-s" in text and "GPU-s" not in text
    finally:
        store.close()


def test_what_another_writer_stored_in_progress_is_shown_inert(tmp_path):
    """Odd values in the detail (a name with control characters, a number as text, a negative ETA) are
    one line each or left out, never a traceback."""
    clock = WallClock()
    store = make_store("mongomock", tmp_path, clock)
    try:
        submit(store)
        claim(store, "t", owner="w1")
        store.set_progress(JOB_ID, "t", "train_full", 16.0, detail={
            "step": "many", "stageIndex": -1, "etaS": -5, "latest": {"lo\x1b[2Jss\nx": 1.0, "lr": "fast", "n": True}})
        status = status_document(store, JOB_ID)
        text = render_status(status, now=clock.now)
        assert "\x1b" not in text and "  latest     loss x 1\n" in text and "lr" not in text
        assert "ETA" not in text and "stage -1" not in text and "step many" not in text
        assert any("progress" in line for line in status.warnings())
        json.dumps(status.as_json(clock.now))
    finally:
        store.close()


def test_watch_follows_the_step_and_loss_as_they_move(running):
    """status --watch redraws as the worker writes progress: each poll shows the newest step and loss."""
    store, clock = running
    out = io.StringIO()
    polls = [lambda: store.set_progress(JOB_ID, "t", "train_full", 20.0, detail={**DETAIL, "step": 900,
                                                                                "latest": {"loss": 0.1}}),
             lambda: store.mark_cancelled(JOB_ID, "t")]

    def sleep(_seconds):
        clock.advance(2)
        polls.pop(0)()

    assert cmd_status(store, JOB_ID, as_json=False, watch_s=2.0, out=out, sleep=sleep, tty=False,
                      wall_clock=lambda: clock.now) == 0
    text = out.getvalue()
    assert "step 780  loss 0.139" in text and "step 900  loss 0.1" in text
    assert text.index("step 780") < text.index("step 900")


def test_a_completed_job_is_all_done_overall(running):
    """A completed job's overall percent is 100, whatever its last progress write said."""
    store, clock = running
    store.mark_job_completed(JOB_ID, "t", gpu_seconds=50.0)
    assert status_document(store, JOB_ID).as_json(clock.now)["progress"]["overallPercent"] == 100.0
    assert "overall 100 %" in render_status(status_document(store, JOB_ID), now=clock.now)
