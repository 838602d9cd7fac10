"""`python -m worker demo`: the whole product on one machine, with nothing configured and no network.

A moto server process stands in for SQS and S3 on a free loopback port, the SQLite store holds the
records, the shipped speech clips are uploaded to the local recordings bucket under the profile's
prefix (RECORDINGS_S3_KEY_PREFIX) and referenced as ``s3://``. The real worker loop and pipeline
(with the reference trainer, the local stand-in for GPU training) run in this process until the
job is completed; then a summary is printed. Exit 0 only if it completed.
The demo keeps the job's work files (KEEP_WORK_FILES), so the local files it lists can be looked at.

``--real`` (``make demo-real``) is the second act: the same job with the real trainers
(config/pipeline.real.toml, run by the trainer virtualenv's interpreter, TRAINER_PYTHON), which clone
the voice of the shipped clips; then piper-tts speaks a sentence with the cloned light model into a
WAV file next to the run, and the demo prints its path so a person can listen to it, with the
scores the evaluate stage gave each model (the job record's ``quality``) beside it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import boto3

from worker.settings import Settings, load_settings

if TYPE_CHECKING:
    from worker.voice.records.models import JobRecord, ProfileRecord

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples"
CLIPS = (
    ("clip-1.wav", "Hello there, this is a short sample of my voice."),
    ("clip-2.wav", "The quick brown fox jumps over the lazy dog."),
    ("clip-3.flac", "Please train a model that sounds just like me."),
)
# The second act's job takes these too: the real trainers' ci profile wants at least four clips.
REAL_EXTRA_CLIPS = (
    ("clip-4.wav", "She sells sea shells by the sea shore every summer."),
    ("clip-5.wav", "Seven bright lanterns hung above the quiet harbour."),
)
QUEUE, DLQ, BUCKET, RECORDINGS_BUCKET = "voice-jobs", "voice-jobs-dlq", "voice-models", "voice-recordings"
PROFILE_ID = "665f1c2e9b1e8a0012ab34ce"
# Where the worker's default RECORDINGS_S3_KEY_PREFIX lets this profile's job read recordings.
RECORDINGS_PREFIX = f"recordings/{PROFILE_ID}/"
DEMO_TIMEOUT_S = 120
REAL_PIPELINE = REPO / "config" / "pipeline.real.toml"
# The shipped real pipeline trains the production profile (hours on a GPU); the demo and the real
# tests run the same stages in the trainers' few-step CPU profile.
CI_PROFILE = "ci"
TRAINER_PYTHON = REPO / "trainers" / ".venv" / "bin" / "python"
# The ci profile trains from scratch in minutes on two cores; an hour leaves room for a loaded machine.
REAL_DEMO_TIMEOUT_S = 3600
REAL_SENTENCE = "This voice was cloned by the worker from the sample recordings."
SPEAK_TIMEOUT_S = 300
# Run by the trainer interpreter: piper's own command line (1.8) ignores --config and looks for the
# JSON next to the model, so the demo loads the pair through the API it documents instead.
_SPEAK = ("import sys, wave\n"
          "from piper import PiperVoice\n"
          "voice = PiperVoice.load(sys.argv[1], config_path=sys.argv[2])\n"
          "with wave.open(sys.argv[3], 'wb') as wav:\n"
          "    voice.synthesize_wav(sys.stdin.read(), wav)\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalAws:
    """A moto server process on loopback; stopped on exit.

    ``tls_args`` (moto's ``-s`` for its own certificate, or ``-c CERT -k KEY``) serve it over HTTPS.
    """

    def __init__(self, port: int | None = None, *, tls_args: Sequence[str] = (),
                 start_timeout_s: float = 30.0) -> None:
        self.port = port or _free_port()
        self.url = f"{'https' if tls_args else 'http'}://127.0.0.1:{self.port}"
        self._tls_args = list(tls_args)
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def __enter__(self) -> LocalAws:
        from worker.ops.localmongo import refuse_used_port

        refuse_used_port(self.port, "is a local stack already running? (choose another with --port)")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port), *self._tls_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # The probe only asks whether it answers: its certificate is a throwaway one.
        context = ssl._create_unverified_context() if self._tls_args else None
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=1, context=context).read()
                return self
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    # __exit__ never runs when __enter__ raises: do not leave a stuck server behind.
                    self._proc.kill()
                    self._proc.wait()
                    raise RuntimeError("the local SQS/S3 server (moto) did not start") from None
                time.sleep(0.1)

    def __exit__(self, *_exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def dev_session() -> boto3.session.Session:
    """A session for the local server: moto accepts any credentials; fixed ones keep the demo and the
    dev stack away from the user's real AWS profile."""
    return boto3.session.Session(aws_access_key_id="demo", aws_secret_access_key="demo",
                                 region_name="us-east-1")


def provision(session, endpoint: str) -> str:
    """Queue with DLQ and redrive policy, the model bucket, the recordings; returns the queue URL."""
    sqs = session.client("sqs", endpoint_url=endpoint)
    s3 = session.client("s3", endpoint_url=endpoint)
    dlq_url = sqs.create_queue(QueueName=DLQ, Attributes={"MessageRetentionPeriod": "1209600"})["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    queue_url = sqs.create_queue(QueueName=QUEUE, Attributes={
        "VisibilityTimeout": "60", "ReceiveMessageWaitTimeSeconds": "20",
        # The template's backstop, well above the worker's own MAX_FAILED_ATTEMPTS.
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "20"}),
    })["QueueUrl"]
    for bucket in (BUCKET, RECORDINGS_BUCKET):
        s3.create_bucket(Bucket=bucket)
    for name, _text in CLIPS + REAL_EXTRA_CLIPS:
        s3.upload_file(str(SAMPLES / name), RECORDINGS_BUCKET, RECORDINGS_PREFIX + name)
    return queue_url


def local_stack_env(endpoint: str, queue_url: str, state_dir: Path, mongo_uri: str | None = None) -> dict[str, str]:
    """The settings of a worker on the local stack: what the demo and the dev stack share.

    The records are in ``state_dir/records.db``, or on the MongoDB server at ``mongo_uri``; the other
    store's setting is empty (unset), so a shell that sourced the other kind of env.sh is not left with both."""
    return {
        "SQS_QUEUE_URL": queue_url,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
        "SQS_VISIBILITY_TIMEOUT_SECONDS": "60",
        "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "5000",
        "STORE_URL": "" if mongo_uri else f"sqlite:///{state_dir / 'records.db'}",
        "MONGO_URI": mongo_uri or "",
        "S3_BUCKET": BUCKET,
        "S3_PREFIX": "models",
        "RECORDINGS_S3_BUCKET": RECORDINGS_BUCKET,
        "KEEP_WORK_FILES": "true",  # the demo's summary lists the local files; a developer reads them
        "WORK_ROOT": str(state_dir / "work"),
        "PIPELINE_CONFIG": str(REPO / "config" / "pipeline.toml"),
        # The local stack's trainer is the reference stand-in, and jobs default to production: allowed here,
        # explicitly, as nowhere else (a deployment keeps the default, false).
        "ALLOW_STAND_IN_TRAINER": "true",
        "LOG_FORMAT": "console",
        "METRICS_ENABLED": "false",  # EMF lines are for CloudWatch, not for a person reading along
    }


def pipeline_with_profile(source: Path, profile: str, dest: Path, *, device: str | None = None,
                          gate: dict | None = None) -> Path:
    """``source`` with every stage's ``--profile`` value replaced by ``profile``, written to ``dest``.

    The copy is the shipped file in every other respect (every table: the artifacts, the stages, the
    quality report and its gate, a pinned base model), except that a ``device`` given replaces every
    stage's declared device (the CPU copy of a GPU pipeline), and a ``gate`` given replaces the
    ``[quality.gate]`` table (``{}`` removes it: report only). A stage without a ``--profile`` argument
    is a ValueError, so a change to the shipped file cannot silently leave a stage in production.
    """
    data = tomllib.loads(source.read_text(encoding="utf-8"))
    for stage in data["stages"]:
        argv = stage["argv"]
        if argv.count("--profile") != 1 or argv.index("--profile") == len(argv) - 1:
            raise ValueError(f"{source}: stage {stage.get('name')!r} has no single --profile argument")
        argv[argv.index("--profile") + 1] = profile
        if device is not None and "device" in stage:
            stage["device"] = device
    if gate is not None and "quality" in data:
        data["quality"].pop("gate", None)
        if gate:
            data["quality"]["gate"] = dict(gate)
    lines = ["# " + f"{source.name} with --profile {profile} (written by worker.ops.demo)"]
    for table, value in data.items():
        if isinstance(value, list):  # an array of tables: [[stages]]
            for item in value:
                lines += ["", f"[[{table}]]", *_toml_table(item, table, lines_only=True)]
        else:
            lines += _toml_table(value, table)
    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


def _toml_table(table: dict, name: str, *, lines_only: bool = False) -> list[str]:
    """A table's ``key = value`` lines, its sub-tables after them as ``[name.sub]`` (TOML's order)."""
    plain = [f"{key} = {_toml(value)}" for key, value in table.items() if not isinstance(value, dict)]
    lines = plain if lines_only else ["", f"[{name}]", *plain]
    for key, value in table.items():
        if isinstance(value, dict):
            lines += _toml_table(value, f"{name}.{key}")
    return lines


def _toml(value) -> str:
    """A TOML value for the pipeline config's types: strings (JSON's escapes are TOML's), integers,
    floats, booleans, arrays of them and inline tables (a base model's files)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {type(value).__name__} in a pipeline config")


def demo_settings(endpoint: str, queue_url: str, run_dir: Path, real: bool = False,
                  mongo_uri: str | None = None) -> Settings:
    trainers = {} if not real else {
        "PIPELINE_CONFIG": str(pipeline_with_profile(REAL_PIPELINE, CI_PROFILE, run_dir / "pipeline.real.ci.toml",
                                                     device="cpu", gate={})),
        "TRAINER_PYTHON": str(TRAINER_PYTHON)}
    return load_settings({**local_stack_env(endpoint, queue_url, run_dir, mongo_uri),
                          "SQS_WAIT_TIME_SECONDS": "1", "LOG_LEVEL": "WARNING", "WORKER_ID": "demo-worker",
                          **trainers})


def sample_job(real: bool = False) -> dict:
    clips = CLIPS + REAL_EXTRA_CLIPS if real else CLIPS
    return {
        "profileId": PROFILE_ID,
        "environment": "development",
        "metadata": {"directoryName": "demo-user-voice-1", "language": "en"},
        "input": [{"recordingUrl": f"s3://{RECORDINGS_BUCKET}/{RECORDINGS_PREFIX}{name}", "originalText": text}
                  for name, text in clips],
    }


@dataclass
class StageClock:
    """Stage timings as seen from the job record's progress, polled while the worker runs."""

    order: list[str] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)

    def see(self, stage: str, percent: float, now: float) -> bool:
        new = stage not in self.started
        if new:
            if self.order:
                self.ended.setdefault(self.order[-1], now)
            self.order.append(stage)
            self.started[stage] = now
        if percent >= 100:
            self.ended.setdefault(stage, now)
        return new

    def durations(self, end: float) -> list[tuple[str, float]]:
        return [(s, self.ended.get(s, end) - self.started[s]) for s in self.order]


def _watch(store, job_id: str, clock: StageClock, done: threading.Event, out) -> None:
    last = None
    while not done.wait(0.05):
        job = store.get_job(job_id)
        progress = job.progress if job is not None else None
        if progress is None or progress.stage is None or progress.percent is None:  # nothing written yet
            continue
        stage, percent = progress.stage, progress.percent
        clock.see(stage, percent, time.monotonic())
        if (stage, percent) != last:
            print(f"  {stage:<12} {percent:5.1f} %", file=out, flush=True)
            last = (stage, percent)


def run_demo(out=None, real: bool = False, store: str = "sqlite") -> int:
    """``real``: the real trainers (the second act); ``store="mongo"``: the records on a local MongoDB
    server (worker.ops.localmongo), the production store."""
    out = out or sys.stdout
    from worker.app import build_app
    from worker.core.logs import configure_logging
    from worker.ops.localmongo import LocalMongo
    from worker.voice.submit import submit

    if real and not TRAINER_PYTHON.is_file():
        print(f"{TRAINER_PYTHON} does not exist: build the trainer environment first "
              "(make trainers/.venv/.installed; make demo-real does it)", file=out, flush=True)
        return 1
    run_dir = REPO / "var" / "demo" / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    records = "MongoDB records (a local SecantusDB server)" if store == "mongo" else "SQLite records"
    if real:
        print(f"voice-worker demo, second act: local SQS/S3 (moto), {records}, the REAL trainers "
              "(Resemblyzer, Coqui VITS trained from scratch in the ci profile, ONNX for Piper): "
              "several minutes on a CPU", file=out, flush=True)
    else:
        print(f"voice-worker demo: local SQS/S3 (moto), {records}, reference trainer "
              "(the local stand-in for GPU training)", file=out, flush=True)
    with LocalAws() as aws, contextlib.ExitStack() as servers:
        mongo_uri = None
        if store == "mongo":
            mongo_uri = servers.enter_context(LocalMongo(log_path=run_dir / "mongo.log")).uri + "voice"
        session = dev_session()
        queue_url = provision(session, aws.url)
        settings = demo_settings(aws.url, queue_url, run_dir, real=real, mongo_uri=mongo_uri)
        configure_logging(settings.log_level, settings.log_format)
        app = build_app(settings, session=session)
        try:
            job_id, _ = submit(app.store, session.client("sqs", endpoint_url=aws.url), queue_url, sample_job(real),
                               policy=settings.input_policy())
            print(f"submitted job {job_id}; working:", file=out, flush=True)
            clock, done = StageClock(), threading.Event()
            watcher = threading.Thread(target=_watch, args=(app.store, job_id, clock, done, out), daemon=True)
            watcher.start()
            deadline = time.monotonic() + (REAL_DEMO_TIMEOUT_S if real else DEMO_TIMEOUT_S)
            job = None
            while time.monotonic() < deadline:
                app.worker.run_once()
                job = app.store.get_job(job_id)
                if job is not None and (job.status in ("completed", "cancelled") or (
                        job.error is not None and not job.error.retryable)):
                    break
            done.set()
            watcher.join()
            ended = time.monotonic()
            profile = app.store.get_profile(job.profile_id) if job is not None and job.profile_id else None
            s3 = session.client("s3", endpoint_url=aws.url)
            code = _summary(out, job_id, job, profile, clock.durations(ended), ended - started, s3)
        finally:
            app.close()
    if real and code == 0:
        spoken = speak_cloned_voice(out, dict(profile.model_paths) if profile is not None else {},
                                    run_dir / "cloned-voice.wav")
        quality = job.document.get("quality") if job is not None else None
        print("\n".join(score_lines(quality)), file=out, flush=True)
        return spoken
    return code


def speak_cloned_voice(out, model_paths: dict, wav: Path, sentence: str = REAL_SENTENCE) -> int:
    """piper-tts (in the trainer virtualenv) speaks ``sentence`` with the job's light model into ``wav``."""
    argv = [str(TRAINER_PYTHON), "-c", _SPEAK, model_paths["lightModel"], model_paths["lightConfig"], str(wav)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(wav.parent)}
    proc = subprocess.run(argv, input=sentence, capture_output=True, text=True, env=env, timeout=SPEAK_TIMEOUT_S)
    if proc.returncode != 0 or not wav.is_file() or wav.stat().st_size <= 44:
        print(f"\npiper could not speak with the cloned voice (exit {proc.returncode}):\n{proc.stderr[-2000:]}",
              file=out, flush=True)
        return 1
    print(f"\nthe cloned light model says {sentence!r}; listen to it:\n  {wav}", file=out, flush=True)
    return 0


def score_lines(quality) -> list[str]:
    """The job's evaluation (its record's ``quality``: the evaluate stage's eval/quality.json as the worker
    read it) as the second act prints it beside the WAV: a short block per model, and the recordings'
    own scores, the bar a model is measured against."""
    from worker.ops.commands import score_text  # status's own rendering of a score
    models = quality.get("models") if isinstance(quality, dict) else None
    if not isinstance(models, dict) or not models:
        return ["\nno scores: the job record has no quality report"]
    gate: dict = quality["gate"] if isinstance(quality.get("gate"), dict) else {}
    decided = ("none configured, report only" if gate.get("applied") is False else "passed" if gate.get("passed")
               else "below the bar: " + "; ".join(map(str, gate.get("failed") or ["?"])))
    lines = [f"\nthe models' scores (the evaluate stage's {quality.get('report', 'report')}; gate: {decided}):"]
    blocks = [(f"{name} model", figures) for name, figures in models.items()]
    if isinstance(quality.get("reference"), dict):
        blocks.append(("reference (the recordings themselves)", quality["reference"]))
    for title, figures in blocks:
        figures = figures if isinstance(figures, dict) else {}
        dnsmos: dict = figures["dnsmos"] if isinstance(figures.get("dnsmos"), dict) else {}
        sanity: dict = figures["sanity"] if isinstance(figures.get("sanity"), dict) else {}
        cer = score_text(figures.get("cer"))
        if figures.get("cer") is None and figures.get("asrUnavailable"):
            cer += f" (no ASR: {str(figures['asrUnavailable'])[:60]})"
        sane = "?" if not isinstance(sanity.get("ok"), bool) else "ok" if sanity["ok"] else (
            "NOT ok: " + "; ".join(map(str, sanity.get("problems") or []))[:100])
        lines += [f"  {title}",
                  f"    speaker similarity  {score_text(figures.get('speakerSimilarity'))}",
                  f"    CER                 {cer}",
                  f"    DNSMOS overall      {score_text(dnsmos.get('ovrl'))}",
                  f"    sanity              {sane}"]
    return lines


def _summary(out, job_id, job: JobRecord | None, profile: ProfileRecord | None, stages, total_s, s3) -> int:
    status = job.status if job is not None else "missing"
    print("\nsummary", file=out)
    print(f"  job id        {job_id}", file=out)
    print(f"  status        {status} (attempts: {job.attempts if job is not None else None})", file=out)
    print("  stages", file=out)
    for name, seconds in stages:
        print(f"    {name:<12} {seconds:6.2f} s", file=out)
    if job is not None and job.error is not None:
        print(f"  error         {job.error.type}: {job.error.message}", file=out)
    model_paths, s3_paths = (profile.model_paths, profile.s3_paths) if profile is not None else ({}, {})
    print("  local files", file=out)
    for key, path in model_paths.items():
        print(f"    {key:<18} {path}", file=out)
    print("  S3 objects", file=out)
    missing = 0
    for key, uri in s3_paths.items():
        bucket, _, obj = uri.removeprefix("s3://").partition("/")
        try:
            size = s3.head_object(Bucket=bucket, Key=obj)["ContentLength"]
            print(f"    {key:<18} {uri} ({size} bytes)", file=out)
        except Exception:
            missing += 1
            print(f"    {key:<18} {uri} (MISSING)", file=out)
    print(f"  wall time     {total_s:.1f} s", file=out)
    ok = status == "completed" and len(s3_paths) == 5 and not missing
    print("\nthe job completed" if ok else "\nthe job did NOT complete", file=out, flush=True)
    return 0 if ok else 1
