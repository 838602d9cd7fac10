"""What the logs say about a worker's life: who wrote each line, shutdown requests and their grace,
stopped and killed stages, step durations, and SIGUSR1 stack dumps that keep a JSON log JSON."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import threading
import tomllib
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

import worker
from pipeline.config import StageSpec
from pipeline.stages import StageContext, run_stage
from worker.core.daemon import SignalRelay, log_stacks
from worker.core.errors import Stopped
from worker.core.logs import configure_logging
from worker.core.stop import StopSignal

REPO = Path(__file__).resolve().parents[2]


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]


def test_every_line_says_which_worker_and_release_wrote_it():
    """The fixed fields go on every line; a line that sets one itself keeps its own."""
    stream = io.StringIO()
    configure_logging("INFO", "json", stream=stream, fields={"worker_id": "gpu-7", "version": worker.__version__})
    try:
        structlog.get_logger("t").info("one")
        structlog.get_logger("t").info("two", worker_id="other")
    finally:
        structlog.reset_defaults()
    first, second = lines(stream)
    assert (first["worker_id"], first["version"]) == ("gpu-7", worker.__version__)
    assert second["worker_id"] == "other" and second["version"] == worker.__version__


def test_the_version_is_the_projects():
    """worker.__version__ is pyproject.toml's version."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert worker.__version__ == project["version"]


def test_a_shutdown_request_says_which_job_and_how_long_its_grace(memory_queue, make_memory_worker, fake_clock):
    """The first request logs the job in flight and the grace; a second says the grace is over;
    the grace running out is a warning of its own."""
    def handler(message, lease):
        worker_.stop()
        assert fake_clock.advance(5, until=lease.stop.is_set)
        lease.stop.raise_if_set()

    worker_ = make_memory_worker(handler, SHUTDOWN_GRACE_SECONDS=2)
    memory_queue.send()
    with capture_logs() as logs:
        assert worker_.run_once() == "release"
        worker_.stop()
    [first, second] = [e for e in logs if e["event"] == "worker.shutdown_requested"]
    assert first["in_flight"] and first["grace_s"] == 2 and first["hurried"] is False
    assert second["in_flight"] is None and second["hurried"] is True and second["grace_s"] == 0
    [over] = [e for e in logs if e["event"] == "worker.grace_over"]
    assert over["log_level"] == "warning" and over["grace_s"] == 2


def test_a_signal_is_logged_by_name_when_it_arrives():
    """The relay names each signal it passes on."""
    calls = threading.Event()
    relay = SignalRelay(calls.set)
    relay.install()
    try:
        with capture_logs() as logs:
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls.wait(5)
    finally:
        relay.uninstall()
    assert {"event": "worker.signal", "signal": "SIGTERM", "log_level": "info"} in logs


def test_sigusr1_through_the_relay_logs_every_threads_stack_as_one_line():
    """In JSON mode SIGUSR1 is one worker.stacks line naming each thread and its frames."""
    started, release = threading.Event(), threading.Event()

    def parked_here():
        started.set()
        release.wait(10)

    parked = threading.Thread(target=parked_here, name="parked-thread", daemon=True)
    parked.start()
    assert started.wait(5)
    dumped = threading.Event()
    with capture_logs() as logs:
        relay = SignalRelay(lambda: None, stacks=lambda: (log_stacks(), dumped.set()))
        relay.install()
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert dumped.wait(5)
        finally:
            relay.uninstall()
            release.set()
    [dump] = [e for e in logs if e["event"] == "worker.stacks"]
    by_name = {t["thread"]: t["stack"] for t in dump["threads"]}
    assert any("in parked_here" in frame for frame in by_name["parked-thread"])
    assert "MainThread" in by_name


@pytest.fixture
def ctx(tmp_path) -> StageContext:
    return StageContext(dataset_dir=tmp_path / "dataset", output_dir=tmp_path / "output",
                        checkpoints_root=tmp_path / "checkpoints", log_dir=tmp_path / "logs",
                        job_id="job-1", language="en")


STUBBORN = """
import signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("PROGRESS 1", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("behaviour,killed", [("ignore", True), ("honour", False)])
def test_a_stopped_stage_is_logged_and_a_killed_one_warned_about(tmp_path, ctx, behaviour, killed):
    """Stopping a stage logs stage.stopping with why; one that outlives its grace gets stage.killed."""
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(STUBBORN))
    stage = StageSpec(name="train", argv=("{python}", str(script), behaviour), outputs=("x",))
    stop = StopSignal()
    with capture_logs() as logs, pytest.raises(Stopped):
        run_stage(stage, ctx, stop, lambda *_: stop.set("shutdown", "test"), grace_s=0.5)
    events = [e["event"] for e in logs]
    assert {"event": "stage.stopping", "stage": "train", "why": "shutdown", "grace_s": 0.5,
            "log_level": "info"} in logs
    assert ("stage.killed" in events) is killed


def test_a_completed_stage_says_how_long_it_took(tmp_path, ctx):
    """stage.completed carries duration_s."""
    stage = StageSpec(name="quick", argv=(sys.executable, "-c", "open(__import__('sys').argv[1], 'w').write('x')",
                                          "{output_dir}/o"), outputs=("o",))
    with capture_logs() as logs:
        run_stage(stage, ctx, StopSignal(), lambda *_: None)
    [done] = [e for e in logs if e["event"] == "stage.completed"]
    assert done["duration_s"] >= 0


def test_the_daemon_dumps_stacks_as_a_log_line_only_in_json_mode():
    """install_signal_handlers(json_stacks=True) routes SIGUSR1 to the log; otherwise faulthandler has it."""
    import faulthandler

    from worker.core.daemon import install_signal_handlers
    from worker.core.loop import Worker
    from worker.settings import load_settings

    idle = Worker(load_settings({}).loop_config(), queue=None, handler=lambda message, lease: None)
    with capture_logs() as logs:
        relay = install_signal_handlers(idle, json_stacks=True)
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):
                if any(e["event"] == "worker.stacks" for e in logs):
                    break
                threading.Event().wait(0.05)
        finally:
            relay.uninstall()
    assert any(e["event"] == "worker.stacks" for e in logs)
    relay = install_signal_handlers(idle, json_stacks=False)
    try:
        assert signal.getsignal(signal.SIGUSR1) != relay.on_signal  # faulthandler's, at the C level
    finally:
        relay.uninstall()
        faulthandler.unregister(signal.SIGUSR1)
