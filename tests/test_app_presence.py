"""The daemon's wiring of presence: a started worker is listed, a clean exit removes it, a crash leaves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker.app import build_app, clean_exit, device_of
from worker.core.healthcheck import reached_at_s
from worker.settings import load_settings
from worker.voice.records.sqlite import SqliteStore


@pytest.fixture
def settings(queues, tmp_path):
    return load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "WORKER_ID": "host-a:42", "LIVENESS_FILE": str(tmp_path / "alive")})


def listed(settings) -> list[dict]:
    with SqliteStore(settings.store_config().sqlite_path) as store:
        return store.list_workers()


def test_a_started_worker_is_listed_idle_and_a_stopped_one_is_removed(settings, tmp_path):
    """app.start() writes the worker's idle presence; a requested stop, then close(), deletes it."""
    app = build_app(settings)
    app.start()
    try:
        [record] = listed(settings)
        assert (record["workerId"], record["state"], record["jobId"]) == ("host-a:42", "idle", None)
        app.pulse.ready()
        assert set(reached_at_s((tmp_path / "alive").read_text())) == {"queue", "store"}
        app.worker.stop()
        assert app.presence is not None and app.presence.snapshot()["state"] == "stopping"
    finally:
        app.close()
    assert listed(settings) == []


def test_a_worker_whose_loop_crashed_leaves_its_record_to_go_stale(settings):
    """close() without a requested stop or drain (the loop crashed) keeps the record for operators to see."""
    app = build_app(settings)
    app.start()
    app.close()
    assert [record["workerId"] for record in listed(settings)] == ["host-a:42"]


class Loop:
    def __init__(self, *, stop: bool = False, drain: bool = False, unfit: str | None = None):
        import threading

        from worker.core.lease import Shutdown

        self.shutdown, self.draining, self.unfit = Shutdown(), threading.Event(), unfit
        if stop:
            self.shutdown.requested.set()
        if drain:
            self.draining.set()


@pytest.mark.parametrize(("loop", "clean"), [
    (Loop(stop=True), True), (Loop(drain=True), True), (Loop(), False), (Loop(stop=True, unfit="GPU lost"), False)])
def test_only_a_requested_end_on_a_fit_host_is_a_clean_exit(loop, clean):
    """clean_exit: a stop or a drain asked for, and no host fault; a crash or an unfit host is not."""
    assert clean_exit(loop) is clean


@pytest.mark.parametrize(("devices", "device"), [
    (["cuda", "cpu"], "cuda"), (["cpu", None], "cpu"), ([None, None], None)])
def test_the_device_is_what_the_pipelines_stages_declare(devices, device):
    """device_of: cuda when any stage declares it, cpu when all that declare one say cpu, else unknown."""
    config = SimpleNamespace(stages=[SimpleNamespace(device=d) for d in devices])
    assert device_of(config) == device
