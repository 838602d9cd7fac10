"""A retry on another host restores from the S3 mirror only what the job record vouches for."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.config import load_pipeline_config
from pipeline.downloads import DownloadSettings
from pipeline.errors import StageFailed
from pipeline.manifest import manifest_path, write_manifest
from pipeline.recording_url import parse_recording_url
from pipeline.remote_work import RemoteWorkConfig
from pipeline.run import PipelineTrainer, run_pipeline
from tests.pipeline.test_dataset import write_inputs
from tests.pipeline.test_run import FakeFetch
from tests.voice.conftest import BUCKET, JOB_ID, deliver
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.rules import MIRROR

CONFIG = load_pipeline_config(Path(__file__).resolve().parents[2] / "config" / "pipeline.toml")
MIRROR_AT = RemoteWorkConfig(bucket=BUCKET, prefix="models", sync_interval_s=3600)
JOB_PREFIX = f"models/.work/production/user-123-voice-1/{JOB_ID}/attempts"


class Host:
    """One worker host: its own work root, the pipeline with the mirror on, and a failure to inject."""

    def __init__(self, root: Path, store, s3, fetch: FakeFetch):
        self.root, self.store, self.s3, self.fetch = root, store, s3, fetch
        self.pipeline = PipelineTrainer(CONFIG, DownloadSettings(), s3_client=s3, remote=MIRROR_AT)
        self.fail_after_training = False
        self.handler = VoiceJobHandler(HandlerConfig(work_root=root, s3_prefix="models", worker_id=root.name,
                                                     lease_s=60),
                                       store=store, uploader=ArtifactUploader(s3, BUCKET), train=self.train)

    def train(self, job, work_dir, stop, progress, ledger):
        paths = run_pipeline(job, work_dir, stop, config=CONFIG, fetch=self.fetch, progress=progress,
                             remote=self.pipeline.remote_work(work_dir, ledger))
        if self.fail_after_training:
            # Once the record vouches for the mirrored outputs of both stages before the last.
            for _ in range(200):
                if len(vouched_items(self.store)) >= 2:
                    break
                time.sleep(0.05)
            raise StageFailed("injected: the host went away after training")
        return paths

    def stages_run(self) -> set[str]:
        return {p.name.split("-", 1)[1].removesuffix(".log")
                for p in self.root.rglob("logs/*.log") if not p.name.endswith(("download.log", "dataset.log"))}


def vouched_items(store) -> dict[str, str]:
    entries = store.get_job(JOB_ID).get("history") or []
    return {item: digest for entry in entries for item, digest in (entry.get(MIRROR) or {}).items()}


def plant(s3, attempt: str, stage, tmp: Path, data: bytes = b"ATTACKER MODEL") -> None:
    """Outputs of ``stage`` and a manifest that verifies against the stage's definition."""
    outputs = {rel: data + b" " + rel.encode() for rel in stage.outputs}
    for rel, body in outputs.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(body)
        s3.put_object(Bucket=BUCKET, Key=f"{JOB_PREFIX}/{attempt}/output/{rel}", Body=body)
    write_manifest(manifest_path(tmp, stage.name), tmp, stage.name, stage.fingerprint, stage.outputs)
    s3.put_object(Bucket=BUCKET, Key=f"{JOB_PREFIX}/{attempt}/output/.manifests/{stage.name}.json",
                  Body=manifest_path(tmp, stage.name).read_bytes())


@pytest.fixture
def fetch(tmp_path):
    [(path, _text, _seconds), *_] = write_inputs(tmp_path / "media")
    return FakeFetch({parse_recording_url("https://media.example.com/rec/1.wav"): path})


def test_objects_planted_under_the_mirror_never_reach_the_committed_artifacts(store, s3, fetch, tmp_path):
    """After attempt 1 on host A mirrored its stages and failed, someone plants a ``99999-evil``
    attempt and rewrites attempt 1's embed outputs; attempt 2 on an empty host B skips train_full
    (vouched), runs embed again (its mirror no longer matches) and the last stage, and commits only
    its own bytes."""
    host_a, host_b = (Host(tmp_path / name, store, s3, fetch) for name in ("host-a", "host-b"))
    host_a.fail_after_training = True
    with pytest.raises(StageFailed):
        deliver(host_a.handler, 1)
    assert set(vouched_items(store)) == {"output/embed", "output/train_full"}
    [first] = [p.name for p in (tmp_path / "host-a").rglob("attempts/*") if p.parent.name == "attempts"]
    for stage in CONFIG.stages:
        plant(s3, "99999-evil", stage, tmp_path / "planted-evil" / stage.name)
    plant(s3, first, CONFIG.stages[0], tmp_path / "planted-first")
    assert deliver(host_b.handler, 2) == "completed"
    assert host_b.stages_run() == {"embed", "train_light"}
    profile = store.get_profile(store.get_job(JOB_ID)["profileId"])
    for uri in profile["s3Paths"].values():
        body = s3.get_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))["Body"].read()
        assert b"ATTACKER" not in body
    for path in profile["modelPaths"].values():
        assert b"ATTACKER" not in Path(path).read_bytes()
