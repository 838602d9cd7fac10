"""The real end-to-end rig: `python -m worker run` on the local stack with the real trainers.

The queues, buckets and records come from the reliability suite's per-case stack (tests/reliability/
stack.py) on the session's moto server; the worker is a real daemon process (tests/reliability/
procs.py). What differs here: the pipeline is config/pipeline.real.toml in the trainers' ci profile,
the stages run under the trainer virtualenv's interpreter (TRAINER_PYTHON), and the job's recordings
are several espeak-ng sentences (tests/real/speech.py) instead of a tone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import load_pipeline_config
from tests.reliability.procs import WorkerProcess, descendants, is_alive, wait_until
from tests.reliability.stack import ENVIRONMENT, Stack, make_stack, new_object_id, quick_pipeline, recording_key_for
from tests.support import ARTIFACT_KEYS
from worker.ops.demo import CI_PROFILE, REAL_PIPELINE, pipeline_with_profile

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainers" / ".venv" / "bin" / "python"
CHECKER = Path(__file__).with_name("check_artifacts.py")
DIRECTORY = "real-voice-1"

# The visibility timeout is short so that a second worker takes a killed worker's job within
# seconds; heartbeats every 2 s keep it alive with room to spare while training loads both cores.
VISIBILITY_S = 12
HEARTBEAT_MS = 2000
# Torch's intra-op threads: the machine's two cores.
TORCH_THREADS = "2"
LOG_TAIL_LINES = 40
# A job in one of these states stays in it: waiting for another would wait for nothing.
FINAL_STATUSES = frozenset({"completed", "refused", "cancelled"})
CHECKER_TIMEOUT_S = 600


def trainer_python() -> Path:
    """The trainer virtualenv's interpreter; AssertionError when it is not built."""
    if not os.access(TRAINER_PYTHON, os.X_OK):
        raise AssertionError(f"{TRAINER_PYTHON} does not exist: the real tests need the trainer "
                             "environment (make trainers/.venv/.installed, which make test-real runs first)")
    return TRAINER_PYTHON


@dataclass
class RealJob:
    stack: Stack
    job_id: str
    profile_id: str
    directory: str = DIRECTORY

    @property
    def work_dir(self) -> Path:
        return self.stack.work_dir(self.job_id, self.directory)

    def record(self) -> dict:
        with self.stack.reader() as store:
            return store.get_job(self.job_id) or {}

    def profile(self) -> dict:
        with self.stack.reader() as store:
            return store.get_profile(self.profile_id) or {}

    def stage_logs(self, stage: str) -> list[Path]:
        """The stage's log files, oldest first (one per run of the stage)."""
        return sorted((self.work_dir / "logs").glob(f"*-{stage}.log"))

    def checkpoints(self, stage: str, pattern: str) -> list[Path]:
        return sorted(self.work_dir.glob(f"attempts/*/checkpoints/{stage}/{pattern}"))


# The ci copies record and show the report and hold nothing back (six CPU steps make no voice): the
# shipped file's [quality.gate] is production's.
REPORT_ONLY: dict = {}


def make_real_stack(endpoint: str, root: Path, pipeline: Path = REAL_PIPELINE, *,
                    gate: dict | None = REPORT_ONLY) -> Stack:
    """A fresh stack whose workers run ``pipeline`` in the trainers' ci profile on the CPU (the demo's
    copy of it: the shipped file trains the production profile on a GPU); ``gate`` replaces its
    ``[quality.gate]`` (``{}``, the default: report only; None: the file's own)."""
    root.mkdir(parents=True, exist_ok=True)
    ci = pipeline_with_profile(pipeline, CI_PROFILE, root / "pipeline.ci.toml", device="cpu", gate=gate)
    load_pipeline_config(ci, trainer_python=str(trainer_python()))
    # make_stack checks the config it is given without TRAINER_PYTHON: it gets a stand-in, checked above.
    stack = make_stack(endpoint, root, quick_pipeline())
    stack.pipeline = ci
    return stack


def requested_steps(pipeline: Path) -> int:
    """The global steps ``pipeline`` asks train_full for: its --steps, else its profile's (from the trainers)."""
    config = load_pipeline_config(pipeline, trainer_python=str(trainer_python()))
    argv = next(stage.argv for stage in config.stages if stage.name == "train_full")
    if "--steps" in argv:
        return int(argv[argv.index("--steps") + 1])
    profile = argv[argv.index("--profile") + 1]
    code = f"from voice_trainers.profiles import PROFILES; print(PROFILES[{profile!r}].total_steps)"
    return int(subprocess.run([str(trainer_python()), "-c", code], capture_output=True, text=True, check=True,
                              timeout=60).stdout)


def submit_speech_job(stack: Stack, clips: list[tuple[Path, str]], directory: str = DIRECTORY,
                      language: str = "en") -> RealJob:
    """Records for a new job whose recordings are ``clips`` (uploaded under its profile), and its message."""
    job_id, profile_id = new_object_id(), new_object_id()
    entries = []
    for path, text in clips:
        key = recording_key_for(profile_id, path.name)
        stack.s3.upload_file(str(path), stack.recordings, key)
        entries.append({"recordingUrl": f"s3://{stack.recordings}/{key}", "originalText": text})
    body = {"_doc": {"_id": job_id}, "jobId": job_id, "profileId": profile_id, "environment": ENVIRONMENT,
            "metadata": {"directoryName": directory, "language": language}, "input": entries}
    with stack.store() as store:
        store.submit({"_id": job_id, "profileId": profile_id, "environment": ENVIRONMENT,
                      "directoryName": directory}, {"_id": profile_id})
    stack.queues.send(json.dumps(body))
    return RealJob(stack, job_id, profile_id, directory)


def real_worker(stack: Stack, root: Path, name: str, **extra: str) -> WorkerProcess:
    """A worker daemon (not started) for the stack's pipeline with the trainer interpreter, logging JSON
    to ``root/<name>.log``."""
    env = stack.env(
        WORKER_ID=name, TRAINER_PYTHON=str(trainer_python()),
        SQS_VISIBILITY_TIMEOUT_SECONDS=str(VISIBILITY_S), SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=str(HEARTBEAT_MS),
        # The production default: after the commit only logs/ stays, which is all the checks read.
        KEEP_WORK_FILES="false", OMP_NUM_THREADS=TORCH_THREADS, MKL_NUM_THREADS=TORCH_THREADS, **extra)
    return WorkerProcess(env, root / f"{name}.log")


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<{path}: {exc}>"


def diagnosis(job: RealJob, *workers: WorkerProcess) -> str:
    """The job record, each worker's log tail and each stage log's tail: what a failure message needs."""
    parts = [f"job record: {json.dumps(job.record(), default=str)[:3000]}"]
    parts += [f"--- {w.log_path.name}:\n{tail(w.log_path)}" for w in workers]
    logs = job.work_dir / "logs"
    parts += [f"--- {p.name}:\n{tail(p)}" for p in sorted(logs.glob("*.log"))] if logs.is_dir() else []
    return "\n".join(parts)


def wait_for_commit(job: RealJob, worker: WorkerProcess, timeout_s: float, *others: WorkerProcess,
                    status: str = "completed") -> None:
    """Until the job has ``status`` (completed: committed) and the worker has deleted its message;
    AssertionError with the logs as soon as the worker dies, the job ends otherwise, or ``timeout_s`` passes."""

    def ended() -> bool:
        record = job.record()
        if record.get("status") == status and "message.deleted" in worker.event_names():
            return True
        error = record.get("error") or {}
        ended_otherwise = record.get("status") in FINAL_STATUSES - {status}
        if not worker.running() or ended_otherwise or (error and not error.get("retryable")
                                                        and record.get("status") != status):
            raise AssertionError(f"the job cannot end {status} (worker running: {worker.running()}, "
                                 f"status {record.get('status')!r})\n" + diagnosis(job, worker, *others))
        return False

    try:
        wait_until(ended, timeout_s, f"job {job.job_id} to end {status}", interval_s=1.0)
    except AssertionError as exc:
        if "timed out" in str(exc):
            raise AssertionError(f"{exc}\n{diagnosis(job, worker, *others)}") from None
        raise


def s3_problems(job: RealJob) -> list[str]:
    """What is wrong with 'the profile names five non-empty S3 objects, each uploaded once, each holding
    the bytes whose SHA-256 its content-addressed key names'; [] if nothing."""
    stack, paths = job.stack, job.profile().get("s3Paths") or {}
    if sorted(paths) != sorted(ARTIFACT_KEYS):
        return [f"the profile's S3 paths are {paths}"]
    problems = []
    for name, uri in sorted(paths.items()):
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        data = stack.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        if not data:
            problems.append(f"{name}: {uri} is empty")
        if hashlib.sha256(data).hexdigest() not in key.split("/"):
            problems.append(f"{name}: {uri} does not hold the bytes its key names")
        if stack.versions(key) != 1:
            problems.append(f"{name}: {stack.versions(key)} versions of {key}")
    return problems


def download_artifacts(job: RealJob, dest: Path) -> dict[str, Path]:
    """The five objects the profile names, downloaded to ``dest`` under their paths in the output
    directory (the part of the key after its SHA-256)."""
    files = {}
    for name, uri in (job.profile().get("s3Paths") or {}).items():
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        parts = key.split("/")
        digest = next(i for i, part in enumerate(parts) if re.fullmatch(r"[0-9a-f]{64}", part))
        path = dest.joinpath(*parts[digest + 1:])
        path.parent.mkdir(parents=True, exist_ok=True)
        job.stack.s3.download_file(bucket, key, str(path))
        files[name] = path
    return files


def check_artifacts(artifacts: dict[str, Path], wav: Path, sentence: str) -> dict:
    """tests/real/check_artifacts.py, run by the trainer interpreter on the five files; its JSON report."""
    argv = [str(trainer_python()), str(CHECKER), "--wav", str(wav), "--sentence", sentence,
            *[arg for name, path in sorted(artifacts.items()) for arg in (f"--{name}", str(path))]]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(wav.parent),
           "OMP_NUM_THREADS": TORCH_THREADS, "HF_HUB_OFFLINE": "1", "NUMBA_CACHE_DIR": str(wav.parent / "numba")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=CHECKER_TIMEOUT_S, env=env, cwd=wav.parent)
    if proc.returncode != 0:
        raise AssertionError(f"the checker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def model_step(model_pth: Path) -> int:
    """The global step a full model was written at, read by the trainer interpreter (torch lives there)."""
    code = "import sys, torch; print(torch.load(sys.argv[1], map_location='cpu', weights_only=True)['step'])"
    proc = subprocess.run([str(trainer_python()), "-c", code, str(model_pth)], capture_output=True, text=True,
                          timeout=CHECKER_TIMEOUT_S, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return int(proc.stdout)


@dataclass(frozen=True)
class Resumable:
    """How a resumable stage's trainer shows its progress: where its checkpoints land, and the log lines
    (regular expressions with one group, a step number) for a resume and for each finished step."""

    stage: str
    checkpoint_glob: str
    resumed: re.Pattern
    step_done: re.Pattern

    def resumed_at(self, log: Path) -> list[int]:
        return [int(m.group(1)) for m in self.resumed.finditer(log.read_text(errors="replace"))]

    def steps_done(self, log: Path) -> list[int]:
        return [int(m.group(1)) for m in self.step_done.finditer(log.read_text(errors="replace"))]


@dataclass
class KillOutcome:
    job: RealJob
    first: WorkerProcess
    second: WorkerProcess
    checkpoints_at_kill: list[str]
    stage_processes: list[int]
    verified_at_kill: set[str]


def stage_finished(job: RealJob, stage: str) -> bool:
    return any(job.work_dir.glob(f"attempts/*/output/.manifests/{stage}.json"))


def kill_after_first_checkpoint(job: RealJob, first: WorkerProcess, second: WorkerProcess, stage: Resumable,
                                timeout_s: float) -> KillOutcome:
    """Run ``first`` until ``stage`` has written its first checkpoint, SIGKILL that worker alone (its
    stage keeper ends the stage), then run ``second`` until the job is committed."""
    first.start()

    def first_checkpoint() -> list[Path]:
        if not first.running():
            raise AssertionError("the first worker died before the checkpoint\n" + diagnosis(job, first))
        if stage_finished(job, stage.stage):
            raise AssertionError(f"{stage.stage} finished before a checkpoint was seen: the kill would "
                                 "test nothing (checkpoints too far apart?)\n" + diagnosis(job, first))
        return job.checkpoints(stage.stage, stage.checkpoint_glob)

    try:
        found = wait_until(first_checkpoint, timeout_s, f"the first checkpoint of {stage.stage}", interval_s=0.5)
    except AssertionError as exc:
        if "timed out" in str(exc):
            raise AssertionError(f"{exc}\n{diagnosis(job, first)}") from None
        raise
    stage_processes = descendants(first.pid)
    verified = {s for s in ("embed", "train_full", "train_light") if stage_finished(job, s)}
    os.kill(first.pid, signal.SIGKILL)
    first.proc.wait(30)
    # The keeper notices the worker's death and ends the stage: SIGTERM, SIGKILL after the grace.
    wait_until(lambda: not any(is_alive(p) for p in stage_processes), 60,
               "the dead worker's stage processes to end")
    second.start()
    wait_for_commit(job, second, timeout_s, first)
    return KillOutcome(job, first, second, [p.name for p in found], stage_processes, verified)


def worker_status(stack: Stack, job_id: str, *, as_json: bool = False) -> str:
    """What `python -m worker status JOB_ID [--json]` prints for the stack's records (exit 0 asserted)."""
    argv = [sys.executable, "-m", "worker", "status", job_id, *(["--json"] if as_json else [])]
    proc = subprocess.run(argv, cwd=REPO, env=stack.env(LOG_FORMAT="console"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def unwrapped(text: str) -> str:
    """``text`` with every run of whitespace one space: a wrapped line reads as it was before wrapping."""
    return " ".join(text.split())
