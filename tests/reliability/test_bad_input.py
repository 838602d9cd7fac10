"""Bad input: whatever the body, the worker never crashes, never deletes a message it did not complete or
dead-letter with why, and never writes outside WORK_ROOT.

The worker is the real loop and VoiceJobHandler with the real pipeline (downloads, dataset, one quick
stage) on moto in-process and SQLite. Recording hosts all resolve to 127.0.0.1, which the address policy
refuses, so no https body ever leads to a connection. Each body gets a fresh queue pair, so one
body's leftovers never meet the next.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import boto3
from botocore.exceptions import ClientError
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from pipeline.config import load_pipeline_config
from pipeline.downloads import DownloadSettings, fetch
from pipeline.run import run_pipeline
from tests.reliability.bodies import CORPUS, JOB_ID, PROFILE_ID, RECORDINGS_BUCKET, message_bodies
from tests.reliability.stack import new_object_id, quick_pipeline, recording_key_for, write_tiny_wav
from tests.support import FaultyClient, create_queues
from worker.core.loop import Worker
from worker.core.queue import Queue
from worker.settings import load_settings
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.message import is_safe_name
from worker.voice.records.rules import is_complete
from worker.voice.records.sqlite import SqliteStore

MAX_EXAMPLES = 200
PERMANENT = {"InvalidMessage", "BadRecording", "StageFailedPermanently", "TimeLimitExceeded"}
# DESIGN.md's rule for one path component, restated here so a loosened rule in the code cannot pass.
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ENVIRONMENTS = ("development", "staging", "production")


class Probe:
    """One worker set-up shared by every body; ``try_body`` runs one body through it and checks the result."""

    def __init__(self, root: Path):
        self.root, self.work_root = root, root / "work"
        self.settings = load_settings({
            "SQS_VISIBILITY_TIMEOUT_SECONDS": "30", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "10000",
            "SQS_WAIT_TIME_SECONDS": "0", "SQS_RETRY_VISIBILITY_BASE_SECONDS": "1",
            "SHUTDOWN_GRACE_SECONDS": "5", "AWS_REGION": "us-east-1",
            "RECORDINGS_S3_BUCKET": RECORDINGS_BUCKET})
        self.sqs = boto3.client("sqs", region_name="us-east-1")
        self.s3 = s3 = boto3.client("s3", region_name="us-east-1")
        for bucket in ("prop-models", RECORDINGS_BUCKET):
            s3.create_bucket(Bucket=bucket)
        s3.upload_file(str(write_tiny_wav(root / "clip.wav")), RECORDINGS_BUCKET, "clip.wav")
        s3.put_object(Bucket=RECORDINGS_BUCKET, Key="not-audio.txt", Body=b"this is not audio")
        (root / "pipeline.toml").write_text(quick_pipeline())
        config = load_pipeline_config(root / "pipeline.toml")
        downloads = DownloadSettings(timeout_s=5, max_bytes=1 << 20)

        def refuse_every_host(_host: str, _port: int) -> list[str]:
            return ["127.0.0.1"]  # loopback: refused by the address policy before any connection

        def train(job, work_dir, stop, progress, ledger=None):
            def fetch_one(url, dest):
                return fetch(url, dest, settings=downloads, s3_client=s3, stop=stop, resolver=refuse_every_host)
            return run_pipeline(job, work_dir, stop, config=config, fetch=fetch_one, progress=progress, grace_s=2)

        self.store = SqliteStore(str(root / "records.db"))
        self.handler = VoiceJobHandler(HandlerConfig(work_root=self.work_root, s3_prefix="models", worker_id="prop",
                                                     lease_s=30, policy=self.settings.input_policy()),
                                       store=self.store, uploader=ArtifactUploader(s3, "prop-models"), train=train)
        self.baseline = self._outside_files()
        # The test's own directory and pytest's session directory above it: an escape lands in one of them.
        self.neighbours = {d: set(os.listdir(d)) for d in (root.parent, root.parent.parent)}
        self.tried, self.actions = 0, Counter()

    def _outside_files(self) -> set[Path]:
        return {p for p in self.root.rglob("*") if self.work_root not in p.parents and p != self.work_root
                and not p.name.startswith("records.db")}

    def try_body(self, body: str, create_records: bool) -> None:
        # A fresh job per body, so an earlier body's completed job does not answer for this one.
        profile_id = new_object_id()
        body = body.replace(JOB_ID, new_object_id()).replace(PROFILE_ID, profile_id)
        for name in ("clip.wav", "not-audio.txt"):  # the recordings the policy lets this profile read
            self.s3.copy_object(Bucket=RECORDINGS_BUCKET, Key=recording_key_for(profile_id, name),
                                CopySource={"Bucket": RECORDINGS_BUCKET, "Key": name})
        queues = create_queues(self.sqs, name=f"bad-{new_object_id()[:10]}")
        client = FaultyClient(self.sqs)
        worker = Worker(self.settings.loop_config(), Queue(client, queues.url), self.handler)
        ids = _ids(body)
        if create_records and ids is not None:
            self.store.submit({"_id": ids[0], "profileId": ids[1], "environment": "production"}, {"_id": ids[1]})
        try:
            queues.send(body)
        except ClientError:
            reject()  # SQS refuses it (size, characters): it can never reach a worker
        action = worker.run_once()
        self.tried += 1
        self.actions[action] += 1
        self._check(body, action, queues, client.ops(), ids)

    def _check(self, body: str, action: str, queues, ops: list[str], ids: tuple[str, str] | None) -> None:
        dead = queues.receive_now(queues.dlq_url)
        counts = queues.counts()
        if action == "ack":
            assert ids is not None and is_complete(self.store.get_job(ids[0]), self.store.get_profile(ids[1]))
            assert counts == (0, 0) and dead == []
        elif action == "dead_letter":
            assert counts == (0, 0) and len(dead) == 1 and dead[0]["Body"] == body
            attrs = {k: v["StringValue"] for k, v in dead[0]["MessageAttributes"].items()}
            assert attrs["ErrorType"] in PERMANENT and attrs["ErrorMessage"].strip()
            assert "secret" not in attrs["ErrorMessage"], "credentials from the URL leaked into the DLQ"
            assert ops.index("send_message") < ops.index("delete_message")
        else:
            assert action == "retry", f"unexpected action {action}"
            assert counts == (0, 1) and dead == [] and "delete_message" not in ops
        self._check_files()

    def _check_files(self) -> None:
        assert self._outside_files() == self.baseline, "a file appeared outside WORK_ROOT"
        for directory, entries in self.neighbours.items():
            assert set(os.listdir(directory)) == entries, f"a file appeared in {directory}"
        for path in self.work_root.rglob("*"):
            parts = path.relative_to(self.work_root).parts
            if parts[0] == ".models":  # the default MODELS_ROOT: <environment>/<directoryName>/<jobId>/...
                parts = parts[1:]
                if not parts:
                    continue
            assert parts[0] in ENVIRONMENTS, path
            assert all(_SAFE.fullmatch(p) for p in parts[1:3]), path


def _ids(body: str) -> tuple[str, str] | None:
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(raw, dict) and is_safe_name(raw.get("jobId")) and is_safe_name(raw.get("profileId")):
        return raw["jobId"], raw["profileId"]
    return None


def make_probe(tmp_path: Path, monkeypatch) -> Probe:
    cwd = tmp_path / "root" / "cwd"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)  # a relative path, if anything used one, would land in here and be caught
    return Probe(tmp_path / "root")


def test_random_bodies_never_crash_lose_or_escape(aws, tmp_path, monkeypatch, record_property):
    """Hypothesis-generated bodies: each ends acked as completed, dead-lettered with why, or left for a retry; no file lands outside WORK_ROOT."""
    probe = make_probe(tmp_path, monkeypatch)
    try:
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=message_bodies, create_records=st.booleans())
        def check(body, create_records):
            probe.try_body(body, create_records)

        check()
    finally:
        probe.store.close()
    record_property("bodies_tried", probe.tried)
    print(f"\nhypothesis bodies tried: {probe.tried}, outcomes: {dict(probe.actions)}")
    assert probe.tried >= MAX_EXAMPLES * 0.9
    assert set(probe.actions) == {"ack", "dead_letter", "retry"}


def test_curated_corpus_never_crashes_loses_or_escapes(aws, tmp_path, monkeypatch, record_property):
    """Hand-picked hostile bodies (deep nesting, path tricks, private and credentialled URLs, odd schemes and ports) end acked, dead-lettered with why, or retried."""
    probe = make_probe(tmp_path, monkeypatch)
    try:
        for body in CORPUS:
            probe.try_body(body, create_records=True)
    finally:
        probe.store.close()
    record_property("bodies_tried", probe.tried)
    print(f"\ncorpus bodies tried: {probe.tried}, outcomes: {dict(probe.actions)}")
    assert probe.tried == len(CORPUS)
