"""Fine-tuning from a pinned base model, end to end: the worker fetches the base from S3 at start-up,
verifies every byte, and its train_full stage fine-tunes from it.

The base is made here, as an operator would make one: a few ci steps of ``voice_trainers full`` on an
espeak-ng voice (trainers/tests/make_dataset.py's dataset), then ``python -m voice_trainers.base`` on the
stage's last checkpoint. It is published to the local S3 (the moto server), and a copy of the ci pipeline
pins it in ``[base_model]`` (each file's size and SHA-256) and passes ``--base-model-dir
{base_model_dir}`` to train_full. A job on another voice then completes, naming the base on its record
and profile; a config whose listed SHA-256 does not match the published bytes keeps the worker from
starting at all (exit 7, host unfit) and leaves the queued job's message alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from tests.real.harness import (
    REPO,
    TORCH_THREADS,
    RealJob,
    make_real_stack,
    real_worker,
    s3_problems,
    submit_speech_job,
    trainer_python,
    wait_for_commit,
)
from tests.real.speech import speech_clips
from tests.reliability.procs import wait_until
from tests.reliability.stack import Stack
from worker.ops.demo import CI_PROFILE

JOB_TIMEOUT_S = 1500
STAGE_TIMEOUT_S = 900
BASE_STEPS = 2
BASE_CLIPS = 6
# The base speaks American English; the job's recordings another espeak-ng voice.
BASE_VOICE, JOB_VOICE = "en-us", "en-gb-x-rp"
BASE_NAME, BASE_LICENCE = "test-vits-base", "CC0-1.0 (made by the test)"
BASE_FILES = ("config.json", "model.pth")  # voice_trainers.base: what a base directory holds
EXIT_HOST_UNFIT = 7
STEP_DONE = re.compile(r"^step (\d+)/(\d+):", re.M)


def trainer_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": TORCH_THREADS, "MKL_NUM_THREADS": TORCH_THREADS}


def run_trainer(argv: list[str], log: Path) -> None:
    with open(log, "w") as handle:
        code = subprocess.run([str(trainer_python()), *argv], stdout=handle, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=trainer_env(), cwd=log.parent,
                              timeout=STAGE_TIMEOUT_S).returncode
    assert code == 0, f"{argv[:3]} exited {code}:\n{log.read_text()[-4000:]}"


@dataclass(frozen=True)
class Published:
    directory: Path  # the base as made, on this machine
    location: str  # s3://bucket/prefix it was published to
    files: dict[str, dict]  # path -> {"size", "sha256"} of the published bytes

    def table(self, **wrong_sha256: str) -> str:
        """The ``[base_model]`` table pinning these files; ``wrong_sha256`` lists another digest for a path."""
        files = ", ".join(f'{{path = "{path}", size = {meta["size"]}, '
                          f'sha256 = "{wrong_sha256.get(path.replace(".", "_"), meta["sha256"])}"}}'
                          for path, meta in sorted(self.files.items()))
        return (f'\n[base_model]\nname = "{BASE_NAME}"\nlocation = "{self.location}"\n'
                f'licence = "{BASE_LICENCE}"\nfiles = [{files}]\n')

    @property
    def digest_hex(self) -> str:
        """pipeline/base_model.py's digest, recomputed from its documented rule: the SHA-256 of the file list's
        canonical JSON (sorted by path, keys sorted, no spaces)."""
        listing = [{"path": path, "sha256": meta["sha256"], "size": meta["size"]}
                   for path, meta in sorted(self.files.items())]
        return hashlib.sha256(json.dumps(listing, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @property
    def trainer_identity(self) -> str:
        """voice_trainers.base.base_identity: the SHA-256 over both files' digests, as the trainer prints it."""
        parts = {path: meta["sha256"] for path, meta in self.files.items()}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def published(moto_server, tmp_path_factory) -> Published:
    """A base made by the trainers (BASE_STEPS ci steps on BASE_VOICE) and uploaded to a bucket of the moto server."""
    root = tmp_path_factory.mktemp("base")
    run_trainer([str(REPO / "trainers" / "tests" / "make_dataset.py"), str(root / "dataset"),
                 "--clips", str(BASE_CLIPS), "--voice", BASE_VOICE], root / "dataset.log")
    run_trainer(["-m", "voice_trainers", "full", "--dataset", str(root / "dataset"), "--out", str(root / "out"),
                 "--checkpoints", str(root / "ck"), "--language", "en", "--profile", CI_PROFILE,
                 "--device", "cpu", "--steps", str(BASE_STEPS)], root / "full.log")
    [checkpoint] = sorted((root / "ck").glob(f"step-{BASE_STEPS:08d}.pt"))
    run_trainer(["-m", "voice_trainers.base", str(checkpoint), str(root / "out" / "config.json"), str(root / "base")],
                root / "base.log")
    assert sorted(p.name for p in (root / "base").iterdir()) == sorted(BASE_FILES)

    s3 = boto3.session.Session(region_name="us-east-1").client("s3", endpoint_url=moto_server)
    bucket, prefix = f"base-models-{uuid.uuid4().hex[:12]}", "vits/test-base/v1"
    s3.create_bucket(Bucket=bucket)
    files = {}
    for name in BASE_FILES:
        data = (root / "base" / name).read_bytes()
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return Published(root / "base", f"s3://{bucket}/{prefix}", files)


def pin_base(stack: Stack, table: str) -> Path:
    """The stack's ci pipeline with ``table`` ([base_model]) and train_full fine-tuning from {base_model_dir}."""
    lines = stack.pipeline.read_text().splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("argv = [") and '"voice_trainers", "full"' in line]
    assert lines[at].endswith("]") and "--base-model-dir" not in lines[at]
    lines[at] = lines[at][:-1] + ', "--base-model-dir", "{base_model_dir}"]'
    pinned = stack.pipeline.with_name("pipeline.base.toml")
    pinned.write_text("\n".join(lines) + "\n" + table)
    from pipeline.config import load_pipeline_config

    config = load_pipeline_config(pinned, trainer_python=str(trainer_python()))
    assert config.base_model is not None
    stack.pipeline = pinned
    return pinned


@pytest.fixture(scope="module")
def tuned(moto_server, tmp_path_factory, published) -> RealJob:
    """A job on JOB_VOICE's recordings run start to finish by one worker whose pipeline pins the base."""
    root = tmp_path_factory.mktemp("tuned")
    stack = make_real_stack(moto_server, root, gate={})
    pin_base(stack, published.table())
    job = submit_speech_job(stack, speech_clips(root / "clips", voice=JOB_VOICE))
    worker = real_worker(stack, root, "tuned")
    try:
        worker.start()
        wait_for_commit(job, worker, JOB_TIMEOUT_S)
        assert worker.stop() == 0
    finally:
        worker.ensure_dead()
    return job


def fine_tune_steps() -> int:
    code = f"from voice_trainers.profiles import PROFILES; print(PROFILES[{CI_PROFILE!r}].fine_tune_steps)"
    return int(subprocess.run([str(trainer_python()), "-c", code], capture_output=True, text=True, check=True,
                              timeout=60).stdout)


def test_a_job_fine_tuned_from_the_pinned_base_commits_and_names_it(tuned, published):
    """The job completes with its five artifacts; its record and its profile name the base: the config's name
    and licence, and the digest of the file list the config pins."""
    assert tuned.record()["status"] == "completed"
    assert s3_problems(tuned) == []
    expected = {"name": BASE_NAME, "digest": f"sha256:{published.digest_hex}", "licence": BASE_LICENCE}
    assert tuned.record().get("baseModel") == expected
    assert tuned.profile().get("baseModel") == expected


def test_train_full_fine_tuned_from_the_cached_base_for_the_profile_s_fine_tune_steps(tuned, published):
    """The train_full log: the trainer loaded the verified cache entry of exactly these bytes (their identity),
    had no checkpoint of its own, and ran the ci profile's fine-tune steps, not its from-scratch steps."""
    [log] = tuned.stage_logs("train_full")
    text = log.read_text()
    loaded = re.search(r"^fine-tuning from the base model in (\S+) \(identity ([0-9a-f]{16}),", text, re.M)
    assert loaded, text[-3000:]
    assert Path(loaded.group(1)) == tuned.stack.work_root / ".base-models" / published.digest_hex
    assert loaded.group(2) == published.trainer_identity[:16]
    assert "no checkpoint to resume from: fine-tuning from the base model's weights" in text
    assert "training from scratch" not in text
    steps = fine_tune_steps()
    assert [(int(a), int(b)) for a, b in STEP_DONE.findall(text)] == [(n, steps) for n in range(1, steps + 1)]
    assert "stage train_full exited with code 0\n" in text


def test_a_base_whose_listed_digest_does_not_match_its_bytes_keeps_the_worker_from_starting(
        moto_server, tmp_path, published):
    """model.pth listed with another SHA-256 (right size): the worker fetches, finds the bytes wrong, logs one
    worker.host_unfit and exits 7 before any receive; the queued job's message was never received."""
    stack = make_real_stack(moto_server, tmp_path, gate={})
    wrong = hashlib.sha256(b"not the published model.pth").hexdigest()
    pin_base(stack, published.table(model_pth=wrong))
    job = submit_speech_job(stack, speech_clips(tmp_path / "clips", count=4))
    worker = real_worker(stack, tmp_path, "unfit")
    try:
        worker.start()
        wait_until(lambda: not worker.running(), 120, "the worker with a wrong base digest to exit")
    finally:
        worker.ensure_dead()
    assert worker.proc.returncode == EXIT_HOST_UNFIT, worker.log_path.read_text()[-3000:]
    [unfit] = [e for e in worker.events() if e.get("event") == "worker.host_unfit"]
    assert "model.pth" in json.dumps(unfit), unfit
    assert not {"message.received", "job.claimed"} & set(worker.event_names()), worker.event_names()
    record = job.record()
    assert record.get("status") == "pending" and not record.get("attempts"), record
    assert stack.queue_counts() == ((1, 0), (0, 0))
    [message] = stack.queues.receive_now()
    assert message["Attributes"]["ApproximateReceiveCount"] == "1"  # this receive is its first
