"""Host readiness at start-up: the work file system, the base model and the trainer probe, in the daemon
(exit 7, no message received), in the health check and in doctor."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import structlog

from pipeline.base_model_cache import BaseModelCache
from pipeline.config import load_pipeline_config, parse_pipeline_config
from pipeline.errors import HostUnfit
from pipeline.host import PROBE_CHECK, WORK_CHECK, readiness_checks, run_probe, work_root_check
from worker.core.daemon import EXIT_HOST_UNFIT
from worker.core.healthcheck import mark_unfit, problem
from worker.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = {"fullModel": "m", "fullConfig": "c", "speakerEmbeddings": "s", "lightModel": "l", "lightConfig": "lc"}
FIT = {"cuda_available": True, "torch": "2.4.1", "cuda": "12.1", "device_name": "NVIDIA H200",
       "total_memory_bytes": 150_000_000_000, "driver": "550.90"}


def fake_trainer(tmp_path: Path, body: str) -> str:
    """An executable standing in for TRAINER_PYTHON: whatever ``-m voice_trainers probe`` it is given, it runs ``body``."""
    path = tmp_path / "fake-trainer-python"
    path.write_text(f"#!{sys.executable}\nimport json, sys, time\n{body}\n", encoding="utf-8")
    path.chmod(0o755)
    return str(path)


def printing(found: dict) -> str:
    return f"print('torch warming up'); print(json.dumps({found!r}))"


def cuda_config(trainer_python: str):
    return parse_pipeline_config({"artifacts": ARTIFACTS, "stages": [
        {"name": "prep", "argv": ["{python}", "-c", "pass"], "outputs": ["m", "c"]},
        {"name": "train", "argv": ["{trainer_python}", "--device", "{device}"], "outputs": ["s", "l", "lc"],
         "device": "cuda"}]}, trainer_python=trainer_python)


def probe_check(config, tmp_path: Path, timeout_s: float = 60.0):
    checks = readiness_checks(config, work_root=tmp_path / "work", min_free_bytes=0,
                              cache=BaseModelCache(tmp_path / "cache"), env={"PATH": "/usr/bin:/bin"},
                              probe_timeout_s=timeout_s)
    return {check.name: check for check in checks}[PROBE_CHECK]


# ---------------------------------------------------------------- the trainer probe


def test_a_fit_probe_passes_and_is_logged_as_one_line(tmp_path):
    """A probe that sees CUDA passes, its JSON logged as one host.trainer_probe line."""
    config = cuda_config(fake_trainer(tmp_path, printing(FIT)))
    with structlog.testing.capture_logs() as logs:
        detail = probe_check(config, tmp_path).run()
    assert "cuda_available=True" in detail and "device_name=NVIDIA H200" in detail
    lines = [entry for entry in logs if entry["event"] == "host.trainer_probe"]
    assert len(lines) == 1 and {key: lines[0][key] for key in FIT} == FIT


def test_a_probe_without_cuda_makes_the_host_unfit_for_a_cuda_stage(tmp_path):
    """cuda_available false, with a stage that declares device = "cuda": the host is unfit, naming the stage."""
    config = cuda_config(fake_trainer(tmp_path, printing({**FIT, "cuda_available": False, "device_name": None})))
    with pytest.raises(HostUnfit) as caught:
        probe_check(config, tmp_path).run()
    assert caught.value.check == PROBE_CHECK
    assert "stages train need cuda, but the trainer sees none" in caught.value.problem


@pytest.mark.parametrize("body, why", [
    ("print('{not json')", "printed no JSON line with a true/false cuda_available"),
    ("print(json.dumps({'cuda_available': 'yes'}))", "printed no JSON line with a true/false cuda_available"),
    ("print('ImportError: no module named torch', file=sys.stderr); sys.exit(3)",
     "exited with code 3: ImportError: no module named torch"),
])
def test_a_probe_that_fails_or_garbles_makes_the_host_unfit(tmp_path, body, why):
    """A probe that exits non-zero or prints no usable JSON line is a host problem, said in one line."""
    with pytest.raises(HostUnfit, match=why):
        probe_check(cuda_config(fake_trainer(tmp_path, body)), tmp_path).run()


def test_a_probe_that_hangs_makes_the_host_unfit(tmp_path):
    """A probe past its time limit is killed and the host is unfit."""
    with pytest.raises(HostUnfit, match="did not answer within 0.5 s"):
        probe_check(cuda_config(fake_trainer(tmp_path, "time.sleep(60)")), tmp_path, timeout_s=0.5).run()


def test_the_probe_gets_the_stage_environment_not_the_workers(tmp_path, monkeypatch):
    """The probe sees the environment it is handed (the stages' allow-list), not the worker's secrets."""
    monkeypatch.setenv("MONGO_URI", "mongodb://secret")
    trainer = fake_trainer(tmp_path, "import os; print(json.dumps({'cuda_available': 'MONGO_URI' not in os.environ}))")
    assert run_probe(trainer, env={"PATH": "/usr/bin:/bin"})["cuda_available"] is True


def test_no_probe_runs_without_a_stage_that_needs_a_device(tmp_path):
    """The shipped stand-in pipeline declares no cuda stage: its checks are the work file system only."""
    config = load_pipeline_config(REPO / "config" / "pipeline.toml")
    checks = readiness_checks(config, work_root=tmp_path, min_free_bytes=0, cache=BaseModelCache(tmp_path / "c"))
    assert [check.name for check in checks] == [WORK_CHECK]


# ---------------------------------------------------------------- the work file system


def test_a_work_root_that_cannot_exist_makes_the_host_unfit(tmp_path):
    """WORK_ROOT below a regular file (its disk gone, a mount missing) is refused at start."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(HostUnfit, match="cannot be made"):
        work_root_check(tmp_path / "file" / "work", 0)


def test_a_full_work_root_makes_the_host_unfit(tmp_path):
    """Less free space than WORK_MIN_FREE_BYTES is refused at start, with both numbers."""
    with pytest.raises(HostUnfit, match=r"bytes free, below WORK_MIN_FREE_BYTES=4611686018427387904"):
        work_root_check(tmp_path, 2**62)


def test_a_usable_work_root_passes_and_keeps_no_probe_file(tmp_path):
    """The write probe is removed again, and the detail says how much is free."""
    assert "writable" in work_root_check(tmp_path / "work", 0)
    assert list((tmp_path / "work").iterdir()) == []


def test_the_cache_defaults_below_the_work_root_where_no_job_directory_can_be(tmp_path):
    """BASE_MODEL_CACHE_DIR defaults to <WORK_ROOT>/.base-models, and a name a job's environment could take is refused."""
    assert load_settings({"WORK_ROOT": "/srv/work"}).base_model_cache_path == "/srv/work/.base-models"
    from worker.core.errors import ConfigError

    with pytest.raises(ConfigError, match="BASE_MODEL_CACHE_DIR=/srv/work/production must not be WORK_ROOT"):
        load_settings({"WORK_ROOT": "/srv/work", "BASE_MODEL_CACHE_DIR": "/srv/work/production"})


# ---------------------------------------------------------------- the daemon


def base_model_config(tmp_path: Path, *, good_digest: bool) -> Path:
    source = tmp_path / "base"
    source.mkdir()
    (source / "model.pth").write_bytes(b"weights")
    digest = hashlib.sha256(b"weights" if good_digest else b"other").hexdigest()
    text = (REPO / "config" / "pipeline.toml").read_text(encoding="utf-8")
    path = tmp_path / "pipeline.toml"
    path.write_text(text + f'\n[base_model]\nname = "tiny"\nlocation = "{source}"\nlicence = "MIT"\n'
                           f'files = [{{ path = "model.pth", size = 7, sha256 = "{digest}" }}]\n', encoding="utf-8")
    return path


@pytest.mark.parametrize("case", ["wrong digest", "no cuda", "disk full"])
def test_an_unfit_host_exits_7_before_any_message_is_received(queues, tmp_path, monkeypatch, case):
    """A host check that fails: one worker.host_unfit line, exit 7, the health check failing, and the queue's
    message never received (its next receive is its first)."""
    from worker.ops import cli

    queues.sqs.send_message(QueueUrl=queues.url, MessageBody="{}")
    env = {"SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
           "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
           "LIVENESS_FILE": str(tmp_path / "alive")}
    if case == "wrong digest":
        env["PIPELINE_CONFIG"] = str(base_model_config(tmp_path, good_digest=False))
    elif case == "no cuda":
        trainer = fake_trainer(tmp_path, printing({**FIT, "cuda_available": False}))
        config = tmp_path / "cuda.toml"
        config.write_text((REPO / "config" / "pipeline.toml").read_text(encoding="utf-8").replace(
            'name = "train_full"', 'name = "train_full"\ndevice = "cuda"'), encoding="utf-8")
        env.update(PIPELINE_CONFIG=str(config), TRAINER_PYTHON=trainer)
    else:
        env["WORK_MIN_FREE_BYTES"] = str(2**62)
    monkeypatch.setattr(os, "umask", lambda _mask: 0o022)  # cmd_run's umask must not outlive the test
    with structlog.testing.capture_logs() as logs:
        assert cli.cmd_run(load_settings(env), None) == EXIT_HOST_UNFIT
    unfit = [entry for entry in logs if entry["event"] == "worker.host_unfit"]
    assert len(unfit) == 1 and unfit[0]["log_level"] == "error"
    assert not (tmp_path / "records.db").exists()  # stopped before the store, too
    assert (problem(str(tmp_path / "alive"), None) or "").startswith(f"host unfit: {unfit[0]['check']}: ")
    received = queues.sqs.receive_message(QueueUrl=queues.url, AttributeNames=["ApproximateReceiveCount"])
    assert [m["Attributes"]["ApproximateReceiveCount"] for m in received["Messages"]] == ["1"]


def test_a_verified_base_model_reaches_the_stages(queues, tmp_path):
    """A fit host starts, and its pipeline's {base_model_dir} is the verified cache entry."""
    from worker.app import build_app

    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}", "S3_BUCKET": "voice-models",
        "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "PIPELINE_CONFIG": str(base_model_config(tmp_path, good_digest=True))})
    app = build_app(settings)
    try:
        config = app.worker._handler._train._config
        assert config.base_model_dir == str(tmp_path / "work" / ".base-models" / config.base_model.digest_hex)
        assert (Path(config.base_model_dir) / "model.pth").read_bytes() == b"weights"
    finally:
        app.close()


def test_the_health_check_reports_an_unfit_host_however_fresh_the_file(tmp_path):
    """mark_unfit's line fails the health check at once, with the reason."""
    mark_unfit(str(tmp_path / "alive"), "base model: model.pth: its SHA-256 is not\nthe one declared")
    assert problem(str(tmp_path / "alive"), 3600) == "host unfit: base model: model.pth: its SHA-256 is not the one declared"


# ---------------------------------------------------------------- doctor


def test_doctor_warns_about_the_stand_in_and_reports_each_host_check(tmp_path):
    """The stand-in pipeline is a WARN; each host check is a PASS, or a FAIL that says the worker would exit 7."""
    from worker.ops.doctor import host_checks, stand_in_check

    settings = load_settings({"WORK_ROOT": str(tmp_path / "work")})
    stand_in = stand_in_check(settings, load_pipeline_config(REPO / "config" / "pipeline.toml"))
    assert not stand_in.ok and stand_in.warn_only and "reference stand-in" in stand_in.detail
    real = stand_in_check(settings, load_pipeline_config(REPO / "config" / "pipeline.real.toml",
                                                         trainer_python=sys.executable))
    assert real.ok
    bad = load_pipeline_config(base_model_config(tmp_path, good_digest=False))
    checks = {check.name: check for check in host_checks(settings, bad, s3=None)}
    assert checks["work file system"].ok
    assert not checks["base model"].ok and not checks["base model"].warn_only
    assert "(the worker would exit 7: host unfit)" in checks["base model"].detail


def test_doctor_passes_a_fit_probe(tmp_path):
    """doctor runs the same probe the worker does and passes a trainer that sees CUDA."""
    from worker.ops.doctor import host_checks

    settings = load_settings({"WORK_ROOT": str(tmp_path / "work")})
    checks = {c.name: c for c in host_checks(settings, cuda_config(fake_trainer(tmp_path, printing(FIT))), s3=None)}
    assert checks[PROBE_CHECK].ok and "NVIDIA H200" in checks[PROBE_CHECK].detail


def test_the_probe_json_fields_are_the_documented_ones():
    """The keys logged from the probe are the ones docs/design.md names."""
    from pipeline.host import PROBE_KEYS

    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    assert all(f"`{key}`" in design for key in PROBE_KEYS), json.dumps(PROBE_KEYS)


def test_doctor_reports_the_work_roots_use(tmp_path):
    """`doctor` prints the bytes the job directories hold, how many (and how many ended), and the free space."""
    from worker.ops.doctor import work_root_use_check

    work = tmp_path / "work"
    (work / "production" / "voice-1" / "job-a" / "logs").mkdir(parents=True)
    (work / "production" / "voice-1" / "job-a" / "logs" / "x.log").write_bytes(b"x" * 300)
    (work / "production" / "voice-1" / "job-b" / "attempts" / "0001-aaaaaaaa").mkdir(parents=True)
    (work / ".models" / "production").mkdir(parents=True)
    check = work_root_use_check(load_settings({"WORK_ROOT": str(work)}))
    assert check.ok and check.name == "work root use"
    assert check.detail.startswith(f"{work}: 300 bytes in 2 job directories (1 ended, logs only), ")
    assert "bytes free" in check.detail
