"""Submitting a job: records first (idempotently), then the message. Used by `submit` and the demo.

The record keeps the exact body as ``messageBody`` and gets ``enqueuedAt`` once the send succeeded:
a pending job without that stamp is one whose message may never have reached the queue, and the
reconciler (worker/ops/reconcile.py) sends ``messageBody`` again, once.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import structlog

from worker.core import tracing
from worker.core.errors import InvalidMessage, QueueError, WorkerError
from worker.core.queue import Queue
from worker.voice.input_policy import SHAPE_ONLY, InputPolicy
from worker.voice.message import Job, parse_job
from worker.voice.records import Store

log = structlog.get_logger(__name__)

def new_object_id() -> str:
    """A fresh 24-hex id, the shape of a MongoDB ObjectId."""
    return secrets.token_hex(12)


def prepare(payload: Any, policy: InputPolicy = SHAPE_ONLY) -> tuple[dict, Job, str | None]:
    """The message body to send, its validated Job, and the idempotency key; InvalidMessage if bad."""
    if not isinstance(payload, dict):
        raise InvalidMessage("submission must be a JSON object with the message's fields")
    body = dict(payload)
    key = body.pop("idempotencyKey", None)
    if key is not None and (not isinstance(key, str) or not key.strip() or len(key) > 256):
        raise InvalidMessage("idempotencyKey: must be a non-empty string of at most 256 characters")
    body.setdefault("jobId", new_object_id())
    body.setdefault("_doc", {"_id": body["jobId"]})
    job = parse_job(json.dumps(body), policy)
    return body, job, key


def submit(store: Store, sqs, queue_url: str, payload: Any, *,
           policy: InputPolicy = SHAPE_ONLY) -> tuple[str, bool]:
    """Create the records when absent, then enqueue; a repeated idempotency key enqueues nothing.

    With the worker's ``policy`` (``Settings.input_policy()``) a job the worker would refuse is
    refused here, before any record exists; the default checks the shape only and leaves the rest
    to the worker, which dead-letters what its policy refuses.
    """
    return submit_prepared(store, sqs, queue_url, prepare(payload, policy))


def submit_prepared(store: Store, sqs, queue_url: str,
                    prepared: tuple[dict, Job, str | None]) -> tuple[str, bool]:
    """``submit`` for what ``prepare`` already validated: records, then the message."""
    body, job, key = prepared
    record = {
        "_id": job.job_id,
        "profileId": job.profile_id,
        "environment": job.environment,
        "directoryName": job.directory_name,
        "messageBody": json.dumps(body),
    }
    job_id, created = store.submit(record, {"_id": job.profile_id}, idempotency_key=key)
    if not created and key is not None:
        return job_id, False
    try:
        # On a FIFO queue the job is its own group, and a second send of it within SQS's five
        # minutes (a retried submit with the same jobId) is dropped as a duplicate.
        with tracing.span("submit", **{"job.id": job_id}):  # the job's trace starts here and goes with it
            Queue(sqs, queue_url).send(record["messageBody"], group_id=job_id, dedup_id=job_id,
                                       attributes=tracing.message_attributes())
    except QueueError as exc:
        # The record stays pending; `reconcile` re-enqueues pending jobs whose message never arrived.
        raise QueueError(f"job {job_id} recorded but not enqueued: {exc}") from exc
    try:
        store.mark_enqueued(job_id)
    except WorkerError as exc:
        # The message is on its way: at worst the reconciler sends a duplicate, which the worker
        # acknowledges without work. Failing the submit here would invite a second submit instead.
        log.warning("submit.mark_enqueued_failed", job_id=job_id, error=str(exc))
    return job_id, created
