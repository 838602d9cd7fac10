"""A downloaded file is renamed onto its name only once its data is on disk, while the step's network slot
goes to the next file during that sync (real HTTPS server, the Downloader the pipeline builds)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from pipeline.config import load_pipeline_config
from pipeline.downloads import DownloadSettings
from pipeline.recording_url import parse_recording_url
from pipeline.run import PipelineTrainer, download_all
from tests.pipeline.tls_server import (  # noqa: F401  (ca, ca_path, server, base, ds are fixtures)
    PAYLOAD,
    base,
    ca,
    ca_path,
    ds,
    resolver,
    server,
)
from tests.support import FakeJob as Job
from tests.support import FakeRecording as Rec
from worker.core.stop import StopSignal

REPO = Path(__file__).resolve().parents[2]
GIVE_UP_S = 10.0



def wait_until(condition) -> bool:
    given_up = time.monotonic() + GIVE_UP_S
    while not condition():
        if time.monotonic() > given_up:
            return False
        time.sleep(0.01)
    return True


def run_step(tmp_path: Path, urls: list[str], settings: DownloadSettings) -> list[Path]:
    """The download step as a job runs it, with the job budget that makes each file reserve its length."""
    stop = StopSignal()
    trainer = PipelineTrainer(load_pipeline_config(REPO / "config" / "pipeline.toml"), settings)
    fetch = replace(trainer.downloader(stop), resolver=resolver, connections=None)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return download_all(Job(tuple(Rec(parse_recording_url(u)) for u in urls)), tmp_path / "downloads", tmp_path / "logs", stop, fetch, lambda _s, _p: None,
                        10**9, trainer.download_plan)


def test_every_file_is_synced_before_it_is_renamed(base, ds, tmp_path, monkeypatch):
    """Six files four at a time: each .part's data is fsynced before the rename that gives it its name."""
    lock, synced, events = threading.Lock(), set(), []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        with lock:
            synced.add(os.readlink(f"/proc/self/fd/{fd}"))

    def replace_(src, dst) -> None:
        with lock:
            events.append((str(src), str(src) in synced))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace_)
    paths = run_step(tmp_path, [f"{base}/ok?{i}" for i in range(6)], replace(ds, concurrency=4))
    assert [p.read_bytes() for p in paths] == [PAYLOAD] * 6
    parts = [e for e in events if e[0].endswith(".part")]
    assert len(parts) == 6 and all(was_synced for _part, was_synced in parts)


def test_the_next_file_is_requested_while_the_last_body_is_being_synced(base, server, ds, tmp_path, monkeypatch):
    """One file at a time on the wire: the second request reaches the server before the first file's sync ends."""
    real_fsync = os.fsync
    seen: list[bool] = []

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("00000.audio.part"):
            seen.append(wait_until(lambda: len(server.seen) >= 2))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    paths = run_step(tmp_path, [f"{base}/ok?{i}" for i in range(2)], replace(ds, concurrency=1))
    assert [p.read_bytes() for p in paths] == [PAYLOAD] * 2
    assert seen == [True]
