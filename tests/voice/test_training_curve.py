"""The stand-in trainer's METRIC lines, through the real pipeline and the job's progress reporter, become
a loss curve and "stage k of n" on the job record, and `status` shows them."""

from __future__ import annotations

import pytest

from pipeline.run import DATASET_STEP, DOWNLOAD_STEP, OWN_STEPS, run_pipeline
from tests.pipeline.test_run import default_config, job_and_fetch  # noqa: F401 - fixtures
from tests.voice.records.conftest import JOB_ID, PROFILE_ID, WallClock, claim, make_store, submit
from worker.core.stop import StopSignal
from worker.ops.commands import render_status, status_document
from worker.voice.records.attempt import Attempt, ProgressReporter
from worker.voice.records.training import SERIES_MAX_POINTS, plan_of


@pytest.mark.parametrize("kind", ["sqlite", "mongomock"])
def test_the_stand_in_run_leaves_a_loss_curve_on_the_record(tmp_path, job_and_fetch, default_config, kind):  # noqa: F811
    """Each training stage of the default pipeline has a bounded loss series on the record from step 1
    to its last step, the progress names the last stage as stage 5 of 5 at 100 % overall, and `status`
    shows its step and latest loss, its cost in CPU-seconds."""
    job, fetch = job_and_fetch
    clock = WallClock()
    store = make_store(kind, tmp_path, clock)
    try:
        submit(store)
        claim(store, "t")
        reporter = ProgressReporter(Attempt(store, JOB_ID, PROFILE_ID, "t", 60.0), StopSignal(), own_steps=OWN_STEPS,
                                    plan=plan_of(default_config.stages, (DOWNLOAD_STEP, DATASET_STEP)))
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch, progress=reporter)
        record = store.get_job(JOB_ID)
        for stage in ("train_full", "train_light"):
            loss = record["metrics"][stage]["loss"]
            assert 2 <= len(loss) <= SERIES_MAX_POINTS
            assert loss[0][0] == 1 and all(a[0] < b[0] for a, b in zip(loss, loss[1:], strict=False))
            assert set(record["metrics"][stage]) == {"loss", "lr", "step_time_s"}
        progress = record["progress"]
        assert (progress["stage"], progress["stageIndex"], progress["stageCount"]) == ("train_light", 5, 5)
        assert progress["percent"] == 100.0 and progress["overallPercent"] == 100.0
        assert progress["step"] == record["metrics"]["train_light"]["loss"][-1][0]
        assert progress["latest"]["loss"] == record["metrics"]["train_light"]["loss"][-1][1]
        assert record["history"][-1]["device"] == "cpu"
        text = render_status(status_document(store, JOB_ID), now=clock.now)
        assert "stage 5 of 5: train_light 100 %  overall 100 %" in text
        assert f"step {progress['step']}  loss {progress['latest']['loss']:.4g}" in text
        assert "CPU-s" in text and "GPU-s" not in text
    finally:
        store.close()


def test_the_handler_continues_an_earlier_attempts_curve(store, s3, train, tmp_path):
    """The job handler seeds each attempt's reporter with the record's series and gives it the plan: a
    retry that resumes at step 4 keeps steps 1 to 3 of the failed attempt and rewrites the rest."""
    from pipeline.errors import StageFailed
    from tests.voice.conftest import deliver
    from worker.voice.artifacts import ArtifactUploader
    from worker.voice.job import HandlerConfig, VoiceJobHandler
    from worker.voice.records.training import PlannedStage

    plan = (PlannedStage("download", 0.0, trainer=False), PlannedStage("train_full", device="cuda"))
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w",
                                            lease_s=60, stage_plan=plan),
                              store=store, uploader=ArtifactUploader(s3, "voice-models"), train=train)

    def fails_at_step_5(job, work_dir, stop, progress):
        progress("train_full", 0)
        for step in range(1, 6):
            progress.metric("train_full", step, {"loss": float(step)})
        progress("train_full", 50)
        progress.flush()  # what the stage runner does once the stage exited
        raise StageFailed("stage train_full exited with code 1")

    def resumes_at_step_4(job, work_dir, stop, progress):
        progress("train_full", 0)
        progress.metric("train_full", 4, {"loss": -4.0})
        progress("train_full", 100)

    train.during = fails_at_step_5
    with pytest.raises(StageFailed):
        deliver(handler, 1)
    train.during = resumes_at_step_4
    assert deliver(handler, 2, message_id="m-2") == "completed"
    record = store.get_job(JOB_ID)
    assert record["metrics"]["train_full"]["loss"] == [[1, 1.0], [2, 2.0], [3, 3.0], [4, -4.0]]
    assert record["history"][-1]["device"] == "cuda"
