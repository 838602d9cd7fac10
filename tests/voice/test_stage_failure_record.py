"""A failed stage's record: the error line is the stage's own last line, the argv only in the (shipped) log."""

from __future__ import annotations

import pytest

from pipeline.config import StageSpec
from pipeline.stages import StageContext, run_stage
from pipeline.workdir import work_layout
from tests.voice.conftest import BUCKET, JOB_ID, deliver
from worker.core.errors import WorkerError
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.stage_logs import LogShipping, LogShippingConfig, S3Logs, ShippingTrainer

# What a trainer that dies of an exception prints: progress, a traceback, the exception last.
FAILING = """
import sys
for step in range(1, 4):
    print(f"step {step}/100 loss {1 / step:.3f}", flush=True)
print("Traceback (most recent call last):", file=sys.stderr)
print('  File "train.py", line 9, in <module>', file=sys.stderr)
print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
print("", file=sys.stderr)
sys.exit(1)
"""
LONG_ARGUMENT = "--an-argument-only-the-log-keeps=" + "x" * 400


def stage_train(job, work_dir, stop, progress, ledger):
    layout = work_layout(work_dir)
    ctx = StageContext(dataset_dir=layout.dataset, output_dir=layout.output, checkpoints_root=layout.checkpoints,
                       log_dir=layout.logs, job_id=job.job_id, language=job.language)
    script = FAILING.replace("{", "{{").replace("}", "}}")  # literal braces, not placeholders
    stage = StageSpec(name="train_full", argv=("{python}", "-c", script, LONG_ARGUMENT), outputs=("x",))
    run_stage(stage, ctx, stop, progress)
    return {}


def test_the_records_error_line_is_the_failures_last_line_and_the_argv_stays_in_the_log(store, raw_store, s3,
                                                                                        tmp_path):
    """The job record's error starts with the trainer's last line; the argv is in the shipped log's first line only."""
    logs = S3Logs(s3, BUCKET, "models")
    shipping = LogShipping(logs, LogShippingConfig(bucket=BUCKET, prefix="models", interval_s=60, chunk_bytes=65536))
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w",
                                            lease_s=2),
                              store=store, uploader=ArtifactUploader(s3, BUCKET),
                              train=ShippingTrainer(stage_train, shipping))
    with pytest.raises(WorkerError):
        deliver(handler, 1)
    message = raw_store.get_job(JOB_ID)["error"]["message"]
    first, *rest = message.split("\n")
    assert first == "stage train_full exited with code 1: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert "step 3/100 loss 0.333" in rest and "Traceback (most recent call last):" in rest
    assert "argv" not in message and "an-argument-only-the-log-keeps" not in message
    [chunk, *_] = logs.chunks(JOB_ID)
    shipped = logs.read_chunk(chunk)
    assert "stage train_full starting: argv=" in shipped.split("\n")[0]
    assert LONG_ARGUMENT in shipped.split("\n")[0]
    assert "RuntimeError: CUDA out of memory" in shipped
