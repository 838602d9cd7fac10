"""Disk faults on a real (small) file system: full, read-only, gone, in every step of a job.

Each case runs one job through the real loop, handler, download, dataset child and stage runner on a
tmpfs the test mounts (``small_fs``), with moto for S3 and SQS and a SQLite store kept off the faulty
disk. A fault is the host's, not the job's: it releases the job (no failure recorded, no retry spent),
the worker takes no other message (it exits 7: a new worker is ``restart``), nothing is left under a
final name that a retry would trust (``half_written``), and once the disk is whole again the retry on a
new worker completes.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import boto3
import numpy as np
import pytest
import soundfile as sf

from pipeline.config import PipelineConfig, load_pipeline_config
from pipeline.dataset import METADATA_NAME, WAVS_DIR_NAME, split_metadata_line
from pipeline.downloads import DownloadSettings
from pipeline.downloads import fetch as download
from pipeline.files import sha256_and_size
from pipeline.manifest import TEMP_MARKER, manifest_path, manifest_problem
from pipeline.run import run_pipeline
from pipeline.workdir import work_root_problem
from tests.reliability.small_fs import SmallFs, small_fs  # noqa: F401  (small_fs is a fixture)
from tests.support import ARTIFACT_KEYS, SHIPPED_ARTIFACTS
from worker.voice.artifacts import ArtifactUploader
from worker.voice.input_policy import InputPolicy
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.sqlite import SqliteStore

RECORDINGS = "recordings"
MODELS = "models"
LEASE_S = 10
MODEL_BYTES = 1024 * 1024  # the stage's big output: a quarter of the disk
# Below this free after a failed step the disk is the host's fault (the worker's WORK_MIN_FREE_BYTES):
# a trainer that met a full disk exits with a code of its own, and the disk says why afterwards.
WORK_MIN_FREE_BYTES = 512 * 1024
TRAIN = "train"

# A stand-in trainer: reads its dataset, says PROGRESS 50 and waits for the test's go (the moment a
# fault goes in), reads its dataset again (training), then writes its outputs in place, as trainers do.
_STAGE_SCRIPT = """
import pathlib, sys, time
dataset, out, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
model_bytes, rels = int(sys.argv[4]), sys.argv[5:]

def read_dataset():
    for row in (dataset / "metadata.csv").read_text().splitlines():
        (dataset / "wavs" / (row.split("|")[0] + ".wav")).read_bytes()

read_dataset()
print("PROGRESS 50", flush=True)
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
read_dataset()
for rel in rels:
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        if rel.endswith("model.pth"):
            for _ in range(model_bytes // 65536):
                handle.write(b"m" * 65536)
        else:
            handle.write(("artifact " + rel).encode())
print("PROGRESS 100", flush=True)
"""


def write_pipeline(directory: Path, go: Path) -> PipelineConfig:
    script = directory / "stage.py"
    script.write_text(_STAGE_SCRIPT)
    rels = list(SHIPPED_ARTIFACTS.values())
    argv = ["{python}", str(script), "{dataset_dir}", "{output_dir}", str(go), str(MODEL_BYTES), *rels]
    toml = "[artifacts]\n" + "".join(f'{k} = "{v}"\n' for k, v in SHIPPED_ARTIFACTS.items())
    toml += (f'[[stages]]\nname = "{TRAIN}"\nargv = [{", ".join(f"{a!r}" for a in argv)}]\n'
             f"outputs = [{', '.join(f'{r!r}' for r in rels)}]\n")
    (directory / "pipeline.toml").write_text(toml.replace("'", '"'))
    return load_pipeline_config(directory / "pipeline.toml")


def recording_bytes(directory: Path) -> bytes:
    """Two seconds of 44.1 kHz stereo (~350 KB): the dataset turns it into ~88 KB of 22.05 kHz mono."""
    t = np.arange(2 * 44_100) / 44_100
    wave = 0.3 * np.sin(2 * np.pi * 220 * t)
    path = directory / "clip.wav"
    sf.write(path, np.stack([wave, wave * 0.5], axis=1), 44_100, subtype="PCM_16")
    return path.read_bytes()


class DiskRig:
    """One job on the small disk through the real worker; ``at(step, percent, fault)`` injects a fault."""

    def __init__(self, fs: SmallFs, tmp_path: Path, queues, make_worker):
        self.fs, self.queues = fs, queues
        self.go = tmp_path / "go"
        self.config = write_pipeline(tmp_path, self.go)
        self.s3 = boto3.client("s3", region_name="us-east-1")
        self.s3.create_bucket(Bucket=RECORDINGS)
        self.s3.create_bucket(Bucket=MODELS)
        self.recording = recording_bytes(tmp_path)
        self.store = SqliteStore(str(tmp_path / "records.db"))
        self.faults: dict[tuple[str, float], Callable[[], None]] = {}
        self.job_id, self.profile_id = "665f1c2e9b1e8a0012ab34cd", "665f1c2e9b1e8a0012ab34ce"
        self._make_worker = make_worker
        self.restart()

    def restart(self) -> None:
        """A new worker process, as an operator's restart gives: nothing remembered from the old one."""
        handler = VoiceJobHandler(HandlerConfig(work_root=self.fs.work_root, s3_prefix="models",
                                                worker_id="disk-worker", lease_s=LEASE_S,
                                                policy=InputPolicy(recordings_bucket=RECORDINGS),
                                                work_min_free_bytes=WORK_MIN_FREE_BYTES),
                                  store=self.store, uploader=ArtifactUploader(self.s3, MODELS), train=self._train)
        # No backoff: the retried message is back at once.
        self.worker, _ = self._make_worker(handler, SQS_VISIBILITY_TIMEOUT_SECONDS=LEASE_S,
                                           SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=500,
                                           SQS_RETRY_VISIBILITY_BASE_SECONDS=0)

    def at(self, step: str, percent: float, fault: Callable[[], None]) -> None:
        self.faults[(step, percent)] = fault

    def _train(self, job, work_dir: Path, stop, progress, ledger=None):
        fetch = functools.partial(download, settings=DownloadSettings(), s3_client=self.s3, stop=stop)

        def report(step: str, percent: float) -> None:
            fault = self.faults.pop((step, percent), None)
            if fault is not None:
                fault()
            if (step, percent) == (TRAIN, 50.0):
                self.go.touch()
            progress(step, percent)

        self.go.unlink(missing_ok=True)
        paths = run_pipeline(job, work_dir, stop, config=self.config, fetch=fetch, progress=report, grace_s=2)
        fault = self.faults.pop(("trained", 100.0), None)
        if fault is not None:
            fault()
        return paths

    def submit(self) -> None:
        key = f"recordings/{self.profile_id}/clip.wav"
        self.s3.put_object(Bucket=RECORDINGS, Key=key, Body=self.recording)
        self.store.submit({"_id": self.job_id, "profileId": self.profile_id, "environment": "production"},
                          {"_id": self.profile_id})
        self.queues.send(_body(self.job_id, self.profile_id, f"s3://{RECORDINGS}/{key}"))

    def deliver(self) -> str:
        """Receive and work the job's message once; the loop's action."""
        for _ in range(50):
            action = self.worker.run_once()
            if action is not None:
                return action
        raise AssertionError("the message never came back")

    def job(self) -> dict:
        return self.store.get_job(self.job_id)

    def files_named(self, name: str) -> list[Path]:
        """Every file called ``name`` in the work root, wherever the layout puts it."""
        return sorted(p for p in self.fs.work_root.rglob(name) if p.is_file())

    def assert_completed(self) -> None:
        job, profile = self.job(), self.store.get_profile(self.profile_id)
        assert job["status"] == "completed", job.get("error")
        assert profile["status"] == "completed"
        model = self.s3.get_object(Bucket=MODELS, Key=profile["s3Paths"]["fullModel"].split("/", 3)[3])
        assert model["Body"].read() == b"m" * MODEL_BYTES
        for key in ARTIFACT_KEYS:
            assert profile["s3Paths"][key].startswith(f"s3://{MODELS}/models/production/")


def _body(job_id: str, profile_id: str, url: str) -> str:
    import json

    return json.dumps({
        "_doc": {"_id": job_id}, "jobId": job_id, "profileId": profile_id, "environment": "production",
        "metadata": {"directoryName": "voice-1", "language": "en"},
        "input": [{"recordingUrl": url, "originalText": "Hello there, this is my voice."}],
    })


def half_written(work_root: Path, config: PipelineConfig, recording: bytes) -> list[str]:
    """Every file under a final name that a retry would trust but that is not whole; [] when none.

    A download is trusted by its name, a dataset by its metadata.csv, a stage's outputs by its manifest;
    a temp file left behind is not trusted, but it holds the space a retry needs.
    """
    problems = []
    if not work_root.is_dir():
        return problems
    for path in sorted(p for p in work_root.rglob("*") if p.is_file()):
        shown = path.relative_to(work_root)
        if path.name.endswith(".part") or TEMP_MARKER in path.name:
            problems.append(f"{shown}: a temp file left behind")
        if path.parent.name == "downloads" and path.suffix == ".audio" and path.read_bytes() != recording:
            problems.append(f"{shown}: a partial download under its final name")
        if path.name == METADATA_NAME:
            problems += [f"{shown}: {p}" for p in _dataset_problems(path.parent)]
    for output in sorted(p for p in work_root.rglob("output") if p.is_dir()):
        for stage in config.stages:
            manifest = manifest_path(output, stage.name)
            problem = manifest_problem(manifest, output, stage.name, stage.fingerprint, stage.outputs)
            if manifest.exists() and problem is not None:
                problems.append(f"{manifest.relative_to(work_root)}: {problem}")
            if problem is not None:
                present = [rel for rel in stage.outputs if (output / rel).exists()]
                if present:
                    problems.append(f"{output.relative_to(work_root)}: outputs {present} of stage "
                                    f"{stage.name} without a manifest that vouches for them")
    return problems


def _dataset_problems(dataset: Path) -> list[str]:
    problems = []
    for line in (dataset / METADATA_NAME).read_text(encoding="utf-8").splitlines():
        wav = dataset / WAVS_DIR_NAME / f"{split_metadata_line(line)[0]}.wav"
        try:
            samples, rate_hz = sf.read(wav)
        except Exception as exc:  # noqa: BLE001 - any way it fails to decode is the finding
            problems.append(f"{wav.name} does not decode ({type(exc).__name__})")
            continue
        if rate_hz != 22_050 or len(samples) == 0:
            problems.append(f"{wav.name} is not a whole 22.05 kHz recording")
    return problems


@pytest.fixture
def rig(small_fs, tmp_path, queues, make_worker):
    rig = DiskRig(small_fs, tmp_path, queues, make_worker)
    rig.submit()
    yield rig
    rig.store.close()


def assert_host_fault(rig: DiskRig, action: str, words: str) -> str:
    """The attempt ended as a host fault: released, no failure recorded, the worker out of service
    (it takes no other message), nothing half-written; the reason recorded on the attempt."""
    job = rig.job()
    assert (action, job["status"], job.get("error")) == ("release", "processing", None)
    assert job.get("failedAttempts", 0) == 0 and job["history"][-1]["outcome"] == "host_fault"
    reason = job["history"][-1]["hostFault"]
    assert words in reason, reason
    assert rig.worker.unfit is not None
    assert half_written(rig.fs.work_root, rig.config, rig.recording) == []
    return reason


def restarted(rig: DiskRig) -> DiskRig:
    """The unfit worker takes no message; a new one (the supervisor's restart after exit 7) does."""
    assert rig.deliver() == "release" and rig.job()["history"][-1]["outcome"] == "host_fault"
    rig.restart()
    return rig


# --- disk full


def test_disk_full_during_a_download_is_retried_and_leaves_no_partial_download(rig):
    """A download that runs out of space mid-file is a recorded DownloadError and leaves no file behind."""
    rig.fs.fill(leave_bytes=64 * 1024)
    assert_host_fault(rig, rig.deliver(), "No space left on device")
    assert rig.files_named("*.audio*") == []
    rig.fs.drain()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


def test_disk_full_during_the_dataset_is_retried_and_leaves_no_metadata(rig):
    """A dataset step that runs out of space writes no metadata.csv; the host leaving service frees the
    disk of the job's work (a download included: the job goes to another host)."""
    rig.at("dataset", 0.0, lambda: rig.fs.fill(leave_bytes=32 * 1024))
    assert_host_fault(rig, rig.deliver(), "dataset step ran out of disk space")
    assert rig.files_named(METADATA_NAME) == []
    assert rig.files_named("*.audio") == []
    rig.fs.drain()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


@pytest.mark.parametrize("leave_bytes", [256 * 1024, 0], ids=["room-for-the-log", "not-a-byte-left"])
def test_disk_full_during_a_stage_is_retried_and_leaves_no_partial_output(rig, leave_bytes):
    """A stage that runs out of space mid-output leaves neither a manifest nor the partial output."""
    rig.at(TRAIN, 50.0, lambda: rig.fs.fill(leave_bytes=leave_bytes))
    assert_host_fault(rig, rig.deliver(), "bytes free, below WORK_MIN_FREE_BYTES")
    assert rig.files_named("model.pth") == []
    rig.fs.drain()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


def test_disk_full_as_a_stage_finishes_leaves_neither_manifest_nor_outputs(rig):
    """A stage whose exit or manifest cannot be recorded on a full disk counts as failed: its outputs go too."""
    rig.at(TRAIN, 100.0, lambda: rig.fs.fill(leave_bytes=0))
    assert_host_fault(rig, rig.deliver(), "No space left on device")
    assert rig.files_named("model.pth") == []
    rig.fs.drain()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


def test_disk_full_before_the_publish_does_not_stop_a_linked_publish(rig, monkeypatch):
    """Publishing by hard link needs no room for the models' bytes: on a full disk the job still commits."""
    import pipeline.files

    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_NS", 0)  # the outputs count as settled when hashed
    rig.at("trained", 100.0, lambda: rig.fs.fill(leave_bytes=256 * 1024))
    assert rig.deliver() == "ack"
    rig.assert_completed()
    assert_published_files_whole(rig)
    assert_model_paths_hold_the_uploaded_bytes(rig)


@pytest.fixture
def no_links(monkeypatch):
    """MODELS_ROOT as if on another file system: linking the attempt's file fails with EXDEV."""
    import errno

    import worker.voice.publish

    real_link = os.link

    def cross_device(src, dst, **kwargs):
        if str(src).startswith("/proc/self/fd/"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(worker.voice.publish.os, "link", cross_device)


def test_disk_full_during_the_publish_is_retried_and_leaves_no_partial_model(rig, no_links):
    """Publishing the models by copy on a full disk is a retryable error that names no model path and
    leaves no partial file; once there is room the retry publishes files that hold the uploaded bytes."""
    rig.at("trained", 100.0, lambda: rig.fs.fill(leave_bytes=256 * 1024))
    assert_host_fault(rig, rig.deliver(), "No space left on device")
    assert not (rig.store.get_profile(rig.profile_id) or {}).get("modelPaths")
    assert_published_files_whole(rig)
    rig.fs.drain()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()
    assert_model_paths_hold_the_uploaded_bytes(rig)


def assert_published_files_whole(rig: DiskRig) -> None:
    """Nothing under MODELS_ROOT is a temp file, and every published file holds the bytes its digest names."""
    for path in (p for p in rig.fs.work_root.joinpath(".models").rglob("*") if p.is_file()):
        assert ".publishing-" not in path.name, path
        assert sha256_and_size(path)[0] == path.relative_to(rig.fs.work_root / ".models").parts[3], path


def assert_model_paths_hold_the_uploaded_bytes(rig: DiskRig) -> None:
    profile = rig.store.get_profile(rig.profile_id)
    for key in ARTIFACT_KEYS:
        local = Path(profile["modelPaths"][key])
        assert (rig.fs.work_root / ".models") in local.parents
        head = rig.s3.head_object(Bucket=MODELS, Key=profile["s3Paths"][key].split("/", 3)[3])
        assert sha256_and_size(local)[0] == head["Metadata"]["sha256"]


# --- read-only


@pytest.mark.parametrize("step", ["download", "dataset"])
def test_a_work_root_turned_read_only_before_a_step_is_retried(rig, step):
    """A work root that turns read-only between steps is a host fault, not a crash, and a new worker
    carries on once it is writable again."""
    rig.at(step, 0.0, rig.fs.read_only)
    assert_host_fault(rig, rig.deliver(), "read-only")
    rig.fs.writable_again()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


def test_a_work_root_turned_read_only_during_a_stage_is_retried(rig):
    """A stage whose outputs cannot be created on a read-only work root is a host fault, no manifest written."""
    rig.at(TRAIN, 50.0, rig.fs.read_only)
    assert_host_fault(rig, rig.deliver(), "read-only")
    rig.fs.writable_again()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


def test_a_work_root_turned_read_only_after_training_is_retried_at_the_publish(rig):
    """Publishing onto a read-only work root is a host fault; writable again, the retry commits."""
    rig.at("trained", 100.0, rig.fs.read_only)
    assert_host_fault(rig, rig.deliver(), "read-only")
    assert not (rig.store.get_profile(rig.profile_id) or {}).get("modelPaths")
    rig.fs.writable_again()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()
    assert_model_paths_hold_the_uploaded_bytes(rig)


# --- gone


def test_a_work_root_unmounted_during_a_stage_is_retried_and_never_rebuilt_on_the_disk_below(rig):
    """A work file system that goes away mid-stage is a host fault: the worker writes nothing under the
    mount point after it, takes no other message, and once it is mounted again a new worker completes."""
    rig.at(TRAIN, 50.0, rig.fs.vanish)
    assert_host_fault(rig, rig.deliver(), "WORK_ROOT")
    assert rig.deliver() == "release"  # unfit: the message handed back unworked
    assert list(rig.fs.root.iterdir()) == []  # nothing on the disk below the mount point
    rig.fs.mount()
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


@pytest.mark.parametrize("when", [(TRAIN, 50.0), ("trained", 100.0)], ids=["during-a-stage", "after-training"])
def test_a_work_root_removed_mid_job_is_retried_once_the_worker_restarts(rig, when):
    """A work root deleted mid-job is a host fault: the worker takes no other message (the path may now
    name another disk) until it is restarted."""
    rig.at(*when, lambda: shutil.rmtree(rig.fs.work_root))
    assert_host_fault(rig, rig.deliver(), "WORK_ROOT")
    rig.fs.work_root.mkdir()  # made again by hand: a new directory, so still not the one the worker had
    assert restarted(rig).deliver() == "ack"
    rig.assert_completed()


def test_work_root_problem_names_a_gone_or_replaced_root_and_nothing_else():
    """The work-root rule: fine until first seen and while the same; 'gone' or 'another' otherwise."""
    assert work_root_problem(None, None) is None
    assert work_root_problem((1, 2), (1, 2)) is None
    assert "gone" in work_root_problem((1, 2), None)
    assert "another directory" in work_root_problem((1, 2), (1, 3))
    assert "another directory" in work_root_problem((1, 2), (9, 2))


def test_the_small_disk_refuses_to_run_without_root(tmp_path, monkeypatch):
    """Without root the disk-fault tests fail with a line saying why, never a silent skip."""
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match="need root"):
        SmallFs(tmp_path / "fs", 1024 * 1024).mount()
