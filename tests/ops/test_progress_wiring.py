"""The app hands the job handler its stage plan (stage k of n, weights, devices) and the progress log interval."""

from __future__ import annotations

from tests.ops.test_stand_in_wiring import stand_in_config
from worker.settings import load_settings
from worker.voice.records.training import PlannedStage


def test_the_apps_handler_gets_the_stage_plan_and_the_log_interval(queues, tmp_path):
    """The plan is the worker's own steps, then the config's stages with their declared weight and device."""
    from worker.app import build_app

    path = stand_in_config(tmp_path)
    path.write_text(path.read_text().replace('name = "train_full"\n', 'name = "train_full"\nweight = 6\n', 1))
    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "PIPELINE_CONFIG": str(path), "PROGRESS_LOG_INTERVAL_SECONDS": "15"})
    app = build_app(settings)
    try:
        config = app.worker._handler.config
        assert config.stage_plan == (
            PlannedStage("download", 0.0, trainer=False), PlannedStage("dataset", 0.0, trainer=False),
            PlannedStage("embed"), PlannedStage("train_full", 6.0), PlannedStage("train_light"),
            PlannedStage("evaluate"))
        assert config.progress_log_interval_s == 15.0
    finally:
        app.close()
