"""An isolated set of queues, buckets, records and work files on the shared moto server, per test case.

Every case gets its own queue (with a DLQ and redrive policy), model bucket (versioned, so a re-upload
shows up as a second version), recordings bucket, SQLite file and WORK_ROOT, so cases can run side by
side on one moto server without seeing each other.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import numpy as np
import soundfile as sf

from pipeline.config import load_pipeline_config
from pipeline.manifest import manifest_path, manifest_problem
from tests.support import ARTIFACT_KEYS, SHIPPED_ARTIFACTS, Queues, create_queues
from worker.voice.records.sqlite import READ_ONLY, SqliteStore

REPO = Path(__file__).resolve().parents[2]
ENVIRONMENT = "production"

ARTIFACTS = SHIPPED_ARTIFACTS
_ARTIFACTS_TOML = "[artifacts]\n" + "".join(f'{k} = "{v}"\n' for k, v in ARTIFACTS.items())


def reference_pipeline(steps: int, step_delay_s: float) -> str:
    """Three reference-trainer stages (embed, train_full, train_light); the two trainers are slowed."""
    trainer = '"{python}", "-m", "pipeline.reference_trainer"'
    common = '"--dataset", "{dataset_dir}", "--checkpoints", "{checkpoint_dir}"'
    slow = f'"--steps", "{steps}", "--step-delay-s", "{step_delay_s}"'
    return _ARTIFACTS_TOML + f"""
[[stages]]
name = "embed"
argv = [{trainer}, "embed", {common}, "--out", "{{output_dir}}/full"]
outputs = ["full/speakers.pth"]
permanent_exit_codes = [65]

[[stages]]
name = "train_full"
argv = [{trainer}, "full", {common}, "--out", "{{output_dir}}/full", {slow}]
outputs = ["full/model.pth", "full/config.json"]
resumable = true
permanent_exit_codes = [65]

[[stages]]
name = "train_light"
argv = [{trainer}, "light", {common}, "--out", "{{output_dir}}/light", {slow},
        "--full-model", "{{output_dir}}/full/model.pth"]
outputs = ["light/model.onnx", "light/model.onnx.json"]
resumable = true
permanent_exit_codes = [65]
"""


# One stage that writes the five outputs at once: for load tests, where the trainer is not the point.
_QUICK_SCRIPT = (
    "import sys, pathlib; out = pathlib.Path(sys.argv[1]); "
    f"rels = {tuple(ARTIFACTS.values())!r}; "
    "[(out / r).parent.mkdir(parents=True, exist_ok=True) for r in rels]; "
    "[(out / r).write_text('artifact ' + r + ' of ' + sys.argv[2]) for r in rels]; "
    "print('PROGRESS 100')"
)


def quick_pipeline() -> str:
    rels = ", ".join(f'"{v}"' for v in ARTIFACTS.values())
    script = _QUICK_SCRIPT.replace("\\", "\\\\").replace('"', '\\"')
    return _ARTIFACTS_TOML + f"""
[[stages]]
name = "quick"
argv = ["{{python}}", "-c", "{script}", "{{output_dir}}", "{{job_id}}"]
outputs = [{rels}]
"""


def write_tiny_wav(path: Path, seconds: float = 0.4, rate_hz: int = 22_050) -> Path:
    """A short, non-silent mono WAV at the dataset's own rate (so no resampling work)."""
    t = np.arange(int(rate_hz * seconds)) / rate_hz
    wave = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 530 * t)
    sf.write(path, wave, rate_hz, subtype="PCM_16")
    return path


def recording_key_for(profile_id: str, name: str) -> str:
    """Where the worker's default RECORDINGS_S3_KEY_PREFIX lets ``profile_id``'s jobs read ``name``."""
    return f"recordings/{profile_id}/{name}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_object_id() -> str:
    return uuid.uuid4().hex[:24]


@dataclass
class Stack:
    endpoint: str
    root: Path
    queues: Queues
    s3: object
    bucket: str
    recordings: str
    db: Path
    work_root: Path
    pipeline: Path

    # --- wiring
    def env(self, **extra: str) -> dict[str, str]:
        """The daemon's environment for this stack (short visibility, quick retries, JSON logs)."""
        import os

        from worker.settings import ENV_NAMES

        # Hermetic: no worker setting leaks in from the shell running the tests.
        env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
        env.update({
            "SQS_QUEUE_URL": self.queues.url, "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
            "STORE_URL": f"sqlite:///{self.db}", "S3_BUCKET": self.bucket, "S3_PREFIX": "models",
            "WORK_ROOT": str(self.work_root), "PIPELINE_CONFIG": str(self.pipeline),
            "SQS_VISIBILITY_TIMEOUT_SECONDS": "3", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "1000",
            "SQS_WAIT_TIME_SECONDS": "1", "SQS_RETRY_VISIBILITY_BASE_SECONDS": "1",
            "SQS_RETRY_VISIBILITY_MAX_SECONDS": "4", "SHUTDOWN_GRACE_SECONDS": "5",
            "LOG_LEVEL": "INFO", "LOG_FORMAT": "json", "RECORDINGS_S3_BUCKET": self.recordings,
            # completion_problems compares each S3 object with the local file it was uploaded from.
            "KEEP_WORK_FILES": "true",
        })
        env.update(extra)
        return env

    def store(self) -> SqliteStore:
        return SqliteStore(str(self.db))

    def reader(self) -> SqliteStore:
        """Read-only: no BEGIN IMMEDIATE at open, so a SIGSTOPped worker holding the write lock
        cannot block a single-threaded harness that is the one due to SIGCONT it."""
        return SqliteStore(str(self.db), mode=READ_ONLY)

    # --- jobs
    def body(self, job_id: str, profile_id: str, directory: str, recording_key: str = "clip.wav") -> dict:
        return {
            "_doc": {"_id": job_id}, "jobId": job_id, "profileId": profile_id, "environment": ENVIRONMENT,
            "metadata": {"directoryName": directory, "language": "en"},
            "input": [{"recordingUrl": f"s3://{self.recordings}/"
                                       f"{recording_key_for(profile_id, recording_key)}",
                       "originalText": "Hello there, this is my voice."}],
        }

    def submit(self, directory: str = "voice-1", *, send: bool = True) -> tuple[str, str, str]:
        """Create the records and (unless ``send`` is False) enqueue the job; (job id, profile id, body)."""
        job_id, profile_id = new_object_id(), new_object_id()
        # The worker reads only recordings under the job's own profile's prefix.
        self.s3.copy_object(Bucket=self.recordings, Key=recording_key_for(profile_id, "clip.wav"),
                            CopySource={"Bucket": self.recordings, "Key": "clip.wav"})
        body = json.dumps(self.body(job_id, profile_id, directory))
        with self.store() as store:
            store.submit({"_id": job_id, "profileId": profile_id, "environment": ENVIRONMENT,
                          "directoryName": directory}, {"_id": profile_id})
        if send:
            self.queues.send(body)
        return job_id, profile_id, body

    def work_dir(self, job_id: str, directory: str = "voice-1") -> Path:
        return self.work_root / ENVIRONMENT / directory / job_id

    # --- observations
    def queue_counts(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((visible, in flight) on the queue, the same on the DLQ)."""
        return self.queues.counts(), self.queues.counts(self.queues.dlq_url)

    def versions(self, key: str) -> int:
        listed = self.s3.list_object_versions(Bucket=self.bucket, Prefix=key)
        return sum(1 for v in listed.get("Versions", []) if v["Key"] == key)

    def attempt_dirs(self, job_id: str, directory: str = "voice-1") -> list[Path]:
        """The job's per-attempt work directories (each attempt writes only its own)."""
        return sorted(p for p in (self.work_dir(job_id, directory) / "attempts").glob("*") if p.is_dir())

    def verified_stages(self, job_id: str, directory: str = "voice-1") -> set[str]:
        """Stages whose manifest vouches for their outputs on disk right now, in any attempt's directory."""
        config = load_pipeline_config(self.pipeline)
        outputs = [attempt / "output" for attempt in self.attempt_dirs(job_id, directory)]
        return {s.name for s in config.stages for output in outputs
                if manifest_problem(manifest_path(output, s.name), output, s.name, s.fingerprint,
                                    s.outputs) is None}

    def stage_logs(self, job_id: str, directory: str = "voice-1") -> list[str]:
        logs = self.work_dir(job_id, directory) / "logs"
        return sorted(p.name for p in logs.glob("*.log")) if logs.is_dir() else []

    def completion_problems(self, job_id: str, profile_id: str) -> list[str]:
        """Everything wrong with 'completed exactly once, five verified objects, ten paths'; [] if none."""
        with self.store() as store:
            job, profile = store.get_job(job_id) or {}, store.get_profile(profile_id) or {}
        problems = []
        if job.get("status") != "completed":
            problems.append(f"job status {job.get('status')!r}, error {job.get('error')}")
        completions = [h for h in job.get("history") or [] if h.get("outcome") == "completed"]
        if len(completions) != 1:
            problems.append(f"{len(completions)} completions in history {job.get('history')}")
        if profile.get("status") != "completed":
            problems.append(f"profile status {profile.get('status')!r}")
        model_paths, s3_paths = profile.get("modelPaths") or {}, profile.get("s3Paths") or {}
        if sorted(model_paths) != sorted(ARTIFACT_KEYS) or sorted(s3_paths) != sorted(ARTIFACT_KEYS):
            return problems + [f"profile paths incomplete: {model_paths} {s3_paths}"]
        for name in ARTIFACT_KEYS:
            local = Path(model_paths[name])
            bucket, _, key = s3_paths[name].removeprefix("s3://").partition("/")
            if bucket != self.bucket:
                problems.append(f"{name} uploaded to bucket {bucket}")
                continue
            remote = self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            if sha256_bytes(remote) != sha256_bytes(local.read_bytes()):
                problems.append(f"{name}: S3 object differs from {local}")
            if self.versions(key) != 1:
                problems.append(f"{name}: {self.versions(key)} versions of {key} (uploaded more than once)")
        return problems


def make_stack(endpoint: str, root: Path, pipeline_toml: str) -> Stack:
    session = boto3.session.Session(region_name="us-east-1")
    sqs = session.client("sqs", endpoint_url=endpoint)
    s3 = session.client("s3", endpoint_url=endpoint)
    suffix = uuid.uuid4().hex[:12]
    queues = create_queues(sqs, name=f"rel-{suffix}")
    bucket, recordings = f"models-{suffix}", f"recordings-{suffix}"
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    s3.create_bucket(Bucket=recordings)
    root.mkdir(parents=True, exist_ok=True)
    wav = write_tiny_wav(root / "clip.wav")
    s3.upload_file(str(wav), recordings, "clip.wav")
    pipeline = root / "pipeline.toml"
    pipeline.write_text(pipeline_toml)
    load_pipeline_config(pipeline)  # a broken test config should fail here, not inside a worker
    return Stack(endpoint=endpoint, root=root, queues=queues, s3=s3, bucket=bucket, recordings=recordings,
                 db=root / "records.db", work_root=root / "work", pipeline=pipeline)
