"""Submitting a job: records first (idempotently), then the message. Used by `submit` and the demo."""

from __future__ import annotations

import json
import secrets
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from worker.errors import InvalidMessage, QueueError
from worker.message import Job, parse_job
from worker.store import Store


def new_object_id() -> str:
    """A fresh 24-hex id, the shape of a MongoDB ObjectId."""
    return secrets.token_hex(12)


def prepare(payload: Any) -> tuple[dict, Job, str | None]:
    """The message body to send, its validated Job, and the idempotency key; InvalidMessage if bad."""
    if not isinstance(payload, dict):
        raise InvalidMessage("submission must be a JSON object with the message's fields")
    body = dict(payload)
    key = body.pop("idempotencyKey", None)
    if key is not None and (not isinstance(key, str) or not key.strip() or len(key) > 256):
        raise InvalidMessage("idempotencyKey: must be a non-empty string of at most 256 characters")
    body.setdefault("jobId", new_object_id())
    body.setdefault("_doc", {"_id": body["jobId"]})
    job = parse_job(json.dumps(body))
    return body, job, key


def submit(store: Store, sqs, queue_url: str, payload: Any) -> tuple[str, bool]:
    """Create the records when absent, then enqueue; a repeated idempotency key enqueues nothing."""
    body, job, key = prepare(payload)
    record = {
        "_id": job.job_id,
        "profileId": job.profile_id,
        "environment": job.environment,
        "directoryName": job.directory_name,
    }
    job_id, created = store.submit(record, {"_id": job.profile_id}, idempotency_key=key)
    if not created and key is not None:
        return job_id, False
    try:
        sqs.send_message(QueueUrl=queue_url, MessageBody=json.dumps(body))
    except (ClientError, BotoCoreError) as exc:
        # The record stays pending; `reconcile` re-enqueues pending jobs whose message never arrived.
        raise QueueError(f"job {job_id} recorded but not enqueued: {exc}") from exc
    return job_id, created
