"""Attempts mirrored in S3: a retry on a host with an empty work root resumes where the last attempt was."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import boto3
import pytest

from pipeline.config import StageSpec, load_pipeline_config
from pipeline.downloads import DownloadSettings
from pipeline.manifest import manifest_path, manifest_problem, write_manifest
from pipeline.recording_url import parse_recording_url
from pipeline.remote_work import MemoryLedger, RemoteWork, RemoteWorkConfig, job_key, shared_file_system
from pipeline.run import PipelineTrainer, run_pipeline
from tests.pipeline.test_run import FakeFetch, Rec, write_inputs
from tests.support import FakeJob
from worker.core.stop import StopSignal

BUCKET = "models"
CONFIG = RemoteWorkConfig(bucket=BUCKET, prefix="voice", sync_interval_s=3600)
JOB = "production/user-1/665f1c2e9b1e8a0012ab34cd"


@pytest.fixture
def s3(aws):
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


# What the job record vouches for, per attempt (the store's history entries in production).
VOUCHED: dict[str, dict[str, str]] = {}


@pytest.fixture(autouse=True)
def _fresh_record():
    VOUCHED.clear()


def mirror(s3, attempt: str, job: str = JOB) -> RemoteWork:
    return RemoteWork(s3, CONFIG, job, attempt, MemoryLedger(attempt, VOUCHED))


def listing_key(attempt: str, stage: str = "train_full") -> str:
    """Where the listing the record vouches for lies: under its own digest."""
    return f"voice/.work/{JOB}/attempts/{attempt}/checkpoints/{stage}.{VOUCHED[attempt][f'checkpoints/{stage}']}.json"


def write(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def keys(s3, prefix: str = "voice/") -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


CHECKPOINTS = {"ckpt-000004.pth": b"four" * 1000, "nested/opt-000004.pth": b"opt" * 100}


def test_checkpoints_mirrored_by_one_attempt_are_restored_by_the_next_on_an_empty_host(s3, tmp_path):
    """What attempt 1 mirrored lands, byte for byte, in attempt 2's empty checkpoint directory."""
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "host-a", CHECKPOINTS))
    target = tmp_path / "host-b" / "checkpoints" / "train_full"
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", target) == "1-aaaa"
    assert tree(target) == CHECKPOINTS
    assert all(key.startswith(f"voice/.work/{JOB}/attempts/1-aaaa/") for key in keys(s3))


def test_only_changed_checkpoints_are_sent_and_dropped_ones_leave_the_mirror(s3, tmp_path):
    """An unchanged file is not sent again; a removed one's blob is deleted once the new listing is up."""
    source = write(tmp_path / "ckpt", CHECKPOINTS)
    ours = mirror(s3, "1-aaaa")
    assert ours.push_checkpoints("train_full", source) == 2
    assert ours.push_checkpoints("train_full", source) == 0
    (source / "ckpt-000004.pth").unlink()
    write(source, {"ckpt-000006.pth": b"six" * 1000})
    assert ours.push_checkpoints("train_full", source) == 1
    blobs = [k for k in keys(s3) if "/checkpoints/train_full/" in k]
    assert len(blobs) == 2
    target = tmp_path / "restored"
    mirror(s3, "2-bbbb").pull_checkpoints("train_full", target)
    assert tree(target) == {"ckpt-000006.pth": b"six" * 1000, "nested/opt-000004.pth": b"opt" * 100}


def test_the_newest_attempt_wins_and_a_tampered_one_is_passed_over(s3, tmp_path):
    """Restores take the newest attempt's set; one whose blob no longer matches its digest is skipped whole."""
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "a", {"c.pth": b"one"}))
    mirror(s3, "3-cccc").push_checkpoints("train_full", write(tmp_path / "c", {"c.pth": b"three", "d.pth": b"d"}))
    target = tmp_path / "restored"
    assert mirror(s3, "4-dddd").pull_checkpoints("train_full", target) == "3-cccc"
    assert tree(target) == {"c.pth": b"three", "d.pth": b"d"}
    base = f"voice/.work/{JOB}/attempts/3-cccc/checkpoints/train_full"
    listing = json.loads(s3.get_object(Bucket=BUCKET, Key=listing_key("3-cccc"))["Body"].read())
    s3.put_object(Bucket=BUCKET, Key=f"{base}/{listing['files']['c.pth']['sha256']}", Body=b"tampered")
    assert mirror(s3, "4-dddd").pull_checkpoints("train_full", target) == "1-aaaa"
    assert tree(target) == {"c.pth": b"one"}


def test_the_attempt_that_got_furthest_wins_over_a_newer_one_that_started_over(s3, tmp_path):
    """A newer attempt whose restore failed and that began again does not hide an older attempt's
    further checkpoints; equal progress, or none recorded, goes to the newest attempt."""
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "a", {"c.pth": b"step 80"}), 80.0)
    mirror(s3, "2-bbbb").push_checkpoints("train_full", write(tmp_path / "b", {"c.pth": b"step 10"}), 10.0)
    assert mirror(s3, "3-cccc").pull_checkpoints("train_full", tmp_path / "r1") == "1-aaaa"
    assert tree(tmp_path / "r1") == {"c.pth": b"step 80"}
    mirror(s3, "3-cccc").push_checkpoints("train_full", write(tmp_path / "c", {"c.pth": b"step 80 again"}), 80.0)
    assert mirror(s3, "4-dddd").pull_checkpoints("train_full", tmp_path / "r2") == "3-cccc"
    mirror(s3, "5-eeee").push_checkpoints("train_full", write(tmp_path / "e", {"c.pth": b"no progress"}))
    mirror(s3, "6-ffff").push_checkpoints("train_full", write(tmp_path / "f", {"c.pth": b"no progress"}))
    assert mirror(s3, "7-gggg").pull_checkpoints("train_full", tmp_path / "r3", newer_than="4-dddd") == "6-ffff"


def test_a_syncing_stage_records_how_far_it_had_got_with_each_set(s3, tmp_path):
    """The listing a stopped stage leaves names the progress the stage last reported."""
    source = write(tmp_path / "attempt" / "checkpoints" / "train_full", {"c.pth": b"c"})
    with pytest.raises(RuntimeError), mirror(s3, "1-aaaa").syncing("train_full", source, None, lambda: 42.5):
        raise RuntimeError("stopped")
    listing = json.loads(s3.get_object(Bucket=BUCKET, Key=listing_key("1-aaaa"))["Body"].read())
    assert listing["progress"] == 42.5


def test_the_pipeline_hands_the_mirror_the_stages_latest_progress(s3, tmp_path):
    """What a resumable stage last reported is what its mirrored sets record, not another step's."""
    from pipeline.run import ReportedProgress, _mirroring
    from pipeline.stages import StageContext

    seen: list = []
    progress = ReportedProgress(lambda step, pct: seen.append((step, pct)))
    stage = StageSpec(name="train_full", argv=("x",), outputs=("m.pth",), resumable=True)
    ctx = StageContext(dataset_dir=tmp_path, output_dir=tmp_path, checkpoints_root=tmp_path / "ck",
                       log_dir=tmp_path, job_id="j", language="en", env={})
    beside = _mirroring(stage, ctx, mirror(s3, "1-aaaa"), StopSignal(), progress)
    progress("train_full", 61.0)
    progress("train_full", 61.0)
    progress("embed", 100.0)
    assert beside.keywords == {} and beside.args[3]() == 61.0
    assert seen == [("train_full", 61.0), ("embed", 100.0)]  # a repeat is still dropped


def test_a_restore_that_fails_leaves_the_local_checkpoints_in_place(s3, tmp_path):
    """A newer mirror whose blob is missing does not cost the checkpoints this host already had."""
    mirror(s3, "3-cccc").push_checkpoints("train_full", write(tmp_path / "c", {"c.pth": b"three"}))
    base = f"voice/.work/{JOB}/attempts/3-cccc/checkpoints/train_full"
    [blob] = keys(s3, base + "/")
    s3.delete_object(Bucket=BUCKET, Key=blob)
    target = write(tmp_path / "local", {"c.pth": b"local two"})
    assert mirror(s3, "4-dddd").pull_checkpoints("train_full", target, newer_than="2-bbbb") is None
    assert tree(target) == {"c.pth": b"local two"}
    assert not (tmp_path / ".restore-local").exists()


def test_a_file_that_changes_while_it_is_mirrored_keeps_the_last_whole_set(s3, tmp_path, monkeypatch):
    """A round that could not take every file consistently names nothing new: the mirror keeps the
    previous complete set, blobs included."""
    import pipeline.remote_work as remote_work_module

    source = write(tmp_path / "ckpt", {"model.pt": b"m1", "step.json": b"1"})
    ours = mirror(s3, "1-aaaa")
    ours.push_checkpoints("train_full", source)
    write(source, {"model.pt": b"m2", "step.json": b"2"})
    real = remote_work_module.sha256_and_size_of

    def busy_writer(handle):
        digest = real(handle)
        os.utime(handle.fileno(), ns=(1, 1))  # the trainer touched it while it was read
        return digest

    monkeypatch.setattr(remote_work_module, "sha256_and_size_of", busy_writer)
    ours.push_checkpoints("train_full", source)
    monkeypatch.undo()
    restored = tmp_path / "restored"
    mirror(s3, "2-bbbb").pull_checkpoints("train_full", restored)
    assert tree(restored) == {"model.pt": b"m1", "step.json": b"1"}


def test_a_checkpoints_link_out_of_the_job_mirrors_nothing_from_outside(s3, tmp_path):
    """A stage that made checkpoints/ a link elsewhere gets nothing from there mirrored."""
    outside = write(tmp_path / "outside" / "train_full", {"secret.pth": b"another job's"})
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / "checkpoints").symlink_to(tmp_path / "outside")
    assert mirror(s3, "1-aaaa").push_checkpoints("train_full", attempt / "checkpoints" / "train_full") == 0
    assert keys(s3) == [] and tree(outside) == {"secret.pth": b"another job's"}


def test_odd_failures_on_the_way_are_warnings_too(s3, tmp_path, monkeypatch):
    """An error that is not botocore's (s3transfer's own) or a file name the output rules refuse never
    escapes a push or a restore."""
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "a", {"c.pth": b"one"}))

    def broken(*_args, **_kwargs):
        raise RuntimeError("RetriesExceededError: Max Retries Exceeded")

    other = mirror(s3, "2-bbbb")
    monkeypatch.setattr(s3, "get_object", broken)
    assert other.pull_checkpoints("train_full", tmp_path / "r") is None
    monkeypatch.setattr(s3, "upload_fileobj", broken)
    assert other.push_checkpoints("train_full", write(tmp_path / "b", {"back\\slash.pth": b"x"})) == 0


def test_a_local_attempt_as_new_as_the_mirror_keeps_its_checkpoints(s3, tmp_path):
    """Only an attempt newer than the local one replaces what the host already had."""
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "a", {"c.pth": b"one"}))
    target = write(tmp_path / "local", {"c.pth": b"local two"})
    assert mirror(s3, "3-cccc").pull_checkpoints("train_full", target, newer_than="2-bbbb") is None
    assert tree(target) == {"c.pth": b"local two"}


def test_a_listing_that_leads_out_of_the_directory_restores_nothing(s3, tmp_path):
    """A listing naming ../ (an edited mirror) is refused; nothing is written outside the directory."""
    key = f"voice/.work/{JOB}/attempts/1-aaaa/checkpoints/train_full"
    s3.put_object(Bucket=BUCKET, Key=f"{key}/{'0' * 64}", Body=b"evil")
    listing = {"version": 1, "stage": "train_full", "attempt": "1-aaaa",
               "files": {"../evil.pth": {"sha256": "0" * 64, "size": 4}}}
    body = json.dumps(listing).encode()
    VOUCHED["1-aaaa"] = {"checkpoints/train_full": hashlib.sha256(body).hexdigest()}  # even vouched for
    s3.put_object(Bucket=BUCKET, Key=listing_key("1-aaaa"), Body=body)
    target = tmp_path / "job" / "checkpoints" / "train_full"
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", target) is None
    assert not (tmp_path / "job" / "checkpoints" / "evil.pth").exists() and tree(target) == {}


STAGE = StageSpec(name="train_full", argv=("{python}", "-m", "x"), outputs=("full/model.pth", "full/config.json"))


def finished_outputs(root: Path, stage: StageSpec = STAGE) -> Path:
    out = write(root, {"full/model.pth": b"weights" * 5000, "full/config.json": b"{}"})
    write_manifest(manifest_path(out, stage.name), out, stage.name, stage.fingerprint, stage.outputs)
    return out


def test_verified_outputs_are_restored_with_their_manifest(s3, tmp_path):
    """A finished stage's outputs and manifest come back on another host, and the manifest verifies there."""
    mirror(s3, "1-aaaa").push_outputs(STAGE, finished_outputs(tmp_path / "a" / "output"))
    target = tmp_path / "b" / "output"
    target.mkdir(parents=True)
    assert mirror(s3, "2-bbbb").pull_outputs(STAGE, target) == "1-aaaa"
    path = manifest_path(target, STAGE.name)
    assert manifest_problem(path, target, STAGE.name, STAGE.fingerprint, STAGE.outputs) is None


def test_outputs_of_another_stage_definition_are_not_restored(s3, tmp_path):
    """A stage whose argv changed since the mirror was made runs again."""
    mirror(s3, "1-aaaa").push_outputs(STAGE, finished_outputs(tmp_path / "a" / "output"))
    changed = StageSpec(name="train_full", argv=("{python}", "-m", "y"), outputs=STAGE.outputs)
    target = tmp_path / "b" / "output"
    target.mkdir(parents=True)
    assert mirror(s3, "2-bbbb").pull_outputs(changed, target) is None
    assert not manifest_path(target, STAGE.name).exists()


def test_a_stale_attempt_writes_only_below_its_own_prefix(s3, tmp_path):
    """An older attempt that keeps mirroring never changes what a newer attempt mirrored."""
    mirror(s3, "2-bbbb").push_checkpoints("train_full", write(tmp_path / "new", {"c.pth": b"new"}))
    before = {k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys(s3, f"voice/.work/{JOB}/attempts/2-bbbb/")}
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "old", {"c.pth": b"old, still running"}))
    after = {k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys(s3, f"voice/.work/{JOB}/attempts/2-bbbb/")}
    assert after == before
    assert mirror(s3, "3-cccc").pull_checkpoints("train_full", tmp_path / "restored") == "2-bbbb"


def test_a_stopped_stage_mirrors_its_last_checkpoint_on_the_way_out(s3, tmp_path):
    """The checkpoint written at the stop (on the checkpoint signal, say) is mirrored as the block ends."""
    source = tmp_path / "attempt" / "checkpoints" / "train_full"
    source.mkdir(parents=True)
    ours = mirror(s3, "1-aaaa")
    with pytest.raises(RuntimeError), ours.syncing("train_full", source):
        write(source, {"last.pth": b"written at the stop"})
        raise RuntimeError("stopped")
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", tmp_path / "restored") == "1-aaaa"


def test_once_the_shutdown_is_announced_the_mirror_follows_within_seconds(s3, tmp_path, monkeypatch):
    """With a sync interval of an hour, a forewarned stop still gets the new checkpoint mirrored at
    the notice's pace, while the stage runs."""
    import threading

    import pipeline.remote_work as remote_work_module
    from worker.core.stop import StopSignal

    monkeypatch.setattr(remote_work_module, "NOTICE_SYNC_INTERVAL_S", 0.05)
    source = tmp_path / "attempt" / "checkpoints" / "train_full"
    source.mkdir(parents=True)
    stop, ours, other = StopSignal(), mirror(s3, "1-aaaa"), mirror(s3, "2-bbbb")
    with ours.syncing("train_full", source, stop):
        write(source, {"on-signal.pth": b"saved"})
        stop.forewarn()
        seen = threading.Event()
        for _ in range(400):
            if other.pull_checkpoints("train_full", tmp_path / f"r{_}") == "1-aaaa":
                seen.set()
                break
            threading.Event().wait(0.05)
        assert seen.is_set()


def test_s3_failures_are_warnings_never_errors(tmp_path, aws):
    """With a bucket that does not exist, pushes send nothing and restores find nothing; nothing raises."""
    gone = RemoteWork(boto3.client("s3", region_name="us-east-1"), RemoteWorkConfig("absent", "", 1), JOB, "1-a",
                      MemoryLedger("1-a", {"0-z": {"checkpoints/train_full": "0" * 64, "output/train_full": "0" * 64}}))
    assert gone.push_checkpoints("train_full", write(tmp_path / "c", {"c.pth": b"x"})) == 0
    gone.push_outputs(STAGE, finished_outputs(tmp_path / "out"))
    assert gone.pull_checkpoints("train_full", tmp_path / "r") is None
    assert gone.pull_outputs(STAGE, tmp_path / "out") is None
    assert gone.forget() == 0


def test_forget_removes_every_attempts_mirror_of_the_job_only(s3, tmp_path):
    """After the commit the job's mirror goes, all attempts; another job's stays."""
    for attempt in ("1-aaaa", "2-bbbb"):
        mirror(s3, attempt).push_checkpoints("train_full", write(tmp_path / attempt, {"c.pth": attempt.encode()}))
    other = mirror(s3, "1-x", "production/user-1/aaaaaaaaaaaaaaaaaaaaaaaa")
    other.push_checkpoints("train_full", write(tmp_path / "other", {"c.pth": b"other"}))
    assert mirror(s3, "").forget() == 4
    assert all("/aaaaaaaaaaaaaaaaaaaaaaaa/" in k for k in keys(s3))


def test_the_job_key_is_the_job_directory_below_the_work_root(tmp_path):
    """<environment>/<directoryName>/<jobId>, from the job's work directory."""
    assert job_key(tmp_path / "work" / "production" / "user-1" / "665f") == "production/user-1/665f"


MOUNTINFO = """\
22 1 8:1 / / rw,relatime - ext4 /dev/vda1 rw
40 22 0:50 / /mnt/efs rw,relatime - nfs4 fs-1.efs.eu-west-1.amazonaws.com:/ rw,vers=4.1
41 22 0:51 / /mnt/efs/local rw,relatime - tmpfs tmpfs rw
"""


def test_a_work_root_on_nfs_is_seen_as_shared():
    """The longest mount point containing the work root decides whether it is a shared file system."""
    assert shared_file_system(Path("/mnt/efs/work"), MOUNTINFO) == "nfs4"
    assert shared_file_system(Path("/mnt/efs/local/work"), MOUNTINFO) is None
    assert shared_file_system(Path("/var/lib/voice-worker"), MOUNTINFO) is None
    assert shared_file_system(Path("/mnt/efsx"), MOUNTINFO) is None


def run_on_host_a(s3, tmp_path):
    """The reference pipeline run whole by attempt 1 on host A, mirroring to S3: (config, trainer, job, fetch)."""
    config = load_pipeline_config(Path(__file__).resolve().parents[2] / "config" / "pipeline.toml")
    trainer = PipelineTrainer(config, DownloadSettings(), s3_client=s3, remote=CONFIG)
    inputs = write_inputs(tmp_path / "media")
    recordings = tuple(Rec(parse_recording_url(f"https://media.example.com/{i}.wav"), t)
                       for i, (_, t, _) in enumerate(inputs))
    fetch = FakeFetch({rec.url: path for rec, (path, _, _) in zip(recordings, inputs, strict=True)})
    job = FakeJob(recordings, job_id="665f1c2e9b1e8a0012ab34cd")
    host_a = tmp_path / "a" / JOB / "attempts" / "1-aaaa"
    run_pipeline(job, host_a, StopSignal(), config=config, fetch=fetch, progress=lambda *_: None,
                 remote=trainer.remote_work(host_a, MemoryLedger("1-aaaa", VOUCHED)))
    return config, trainer, job, fetch


def test_a_retry_on_an_empty_work_root_skips_the_stages_another_host_finished(s3, tmp_path):
    """Attempt 1 on host A mirrors its finished stages; attempt 2 on host B with an empty work root
    restores them and runs only the last stage (whose outputs the commit would send anyway)."""
    config, trainer, job, fetch = run_on_host_a(s3, tmp_path)
    host_b = tmp_path / "b" / JOB / "attempts" / "2-bbbb"
    ran: list[str] = []
    paths = run_pipeline(job, host_b, StopSignal(), config=config, fetch=fetch,
                         progress=lambda step, pct: ran.append(step) if pct == 0 else None,
                         remote=trainer.remote_work(host_b, MemoryLedger("2-bbbb", VOUCHED)))
    assert all(path.is_file() for path in paths.values())
    logs = {p.name.split("-", 1)[1] for p in (tmp_path / "b" / JOB / "logs").glob("*.log")}
    assert "train_light.log" in logs and "train_full.log" not in logs and "embed.log" not in logs
    trainer.forget_remote_work(tmp_path / "b" / JOB)
    assert keys(s3, "voice/.work/") == []


def test_the_app_mirrors_only_when_asked_and_never_on_a_shared_work_root(tmp_path, monkeypatch):
    """CHECKPOINT_S3_SYNC_SECONDS turns mirroring on; on NFS or EFS it stays off (every host sees the files)."""
    import pipeline.remote_work as remote_work_module
    from worker.app import remote_work
    from worker.settings import load_settings

    base = {"S3_BUCKET": BUCKET, "S3_PREFIX": "voice", "WORK_ROOT": str(tmp_path)}
    assert remote_work(load_settings(base)) is None
    on = load_settings({**base, "CHECKPOINT_S3_SYNC_SECONDS": "120"})
    assert remote_work(on) == RemoteWorkConfig(BUCKET, "voice", 120.0)
    monkeypatch.setattr(remote_work_module, "shared_file_system", lambda _path: "nfs4")
    assert remote_work(on) is None
