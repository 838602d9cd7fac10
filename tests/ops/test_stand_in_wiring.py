"""The app wires the pipeline config's [quality] and [pipeline] stand_in, and ALLOW_STAND_IN_TRAINER, into the
job handler; the local stack (demo, dev stack) allows the stand-in explicitly, a deployment does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import QualityConfig, QualityGate
from worker.app import STAND_IN_REFUSED_ENVIRONMENTS, stand_in_refusals
from worker.ops.demo import local_stack_env
from worker.settings import load_settings

REPO = Path(__file__).resolve().parents[2]


def test_the_setting_defaults_to_refusing():
    assert load_settings({}).allow_stand_in_trainer is False
    assert load_settings({"ALLOW_STAND_IN_TRAINER": "true"}).allow_stand_in_trainer is True


@pytest.mark.parametrize(("stand_in", "allowed", "refused"), [
    (True, False, {"staging", "production"}), (True, True, set()), (False, False, set()), (False, True, set())])
def test_only_a_stand_in_without_the_setting_refuses(stand_in, allowed, refused):
    assert stand_in_refusals(stand_in, allowed) == refused
    assert "development" not in STAND_IN_REFUSED_ENVIRONMENTS


def test_the_local_stack_allows_the_stand_in(tmp_path):
    env = local_stack_env("http://127.0.0.1:4566", "http://q", tmp_path)
    assert env["ALLOW_STAND_IN_TRAINER"] == "true"


def stand_in_config(tmp_path: Path) -> Path:
    shipped = (REPO / "config" / "pipeline.toml").read_text()
    if "stand_in" not in shipped:
        shipped += "\n[pipeline]\nstand_in = true\n"
    shipped += ('\n[[stages]]\nname = "evaluate"\nargv = ["{python}", "-c", "pass"]\noutputs = ["eval/quality.json"]\n'
                '\n[quality]\nreport = "eval/quality.json"\n[quality.gate]\nmin_speaker_similarity = 0.7\n')
    path = tmp_path / "pipeline.toml"
    path.write_text(shipped)
    return path


@pytest.mark.parametrize(("allow", "refused"), [("false", STAND_IN_REFUSED_ENVIRONMENTS), ("true", frozenset())])
def test_the_apps_handler_gets_the_gate_and_the_refusals(queues, tmp_path, allow, refused):
    from worker.app import build_app

    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "PIPELINE_CONFIG": str(stand_in_config(tmp_path)), "ALLOW_STAND_IN_TRAINER": allow})
    app = build_app(settings)
    try:
        config = app.worker._handler.config
        assert config.quality == QualityConfig("eval/quality.json", QualityGate(min_speaker_similarity=0.7))
        assert config.refused_environments == refused
    finally:
        app.close()
