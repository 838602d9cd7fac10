"""A traced job: its spans (claim, upload, commit) hang under the job's span, in the submitter's trace."""

from __future__ import annotations

import pytest

from tests.support import recorded_spans
from tests.voice.conftest import message_body
from worker.core import tracing
from worker.core.core_config import LeaseTimings
from worker.core.lease import Lease, Shutdown
from worker.core.queue import Message, Queue


@pytest.fixture
def spans():
    with recorded_spans() as exporter:
        yield exporter


def test_a_job_is_one_trace_from_its_submitter_through_claim_upload_and_commit(handler, spans):
    """The job's span continues the submitter's trace; claim, commit and upload are its children."""
    import time

    with tracing.span("submit"):
        carried = tracing.message_attributes()
    message = Message("m-1", "-", message_body(), 1, time.monotonic(), message_attributes=carried)
    timings = LeaseTimings(visibility_timeout_s=60, interval_s=10, time_limit_s=600, shutdown_grace_s=1)
    assert handler(message, Lease(Queue(None, "q"), message, timings, shutdown=Shutdown())) == "completed"
    by_name = {span.name: span for span in spans.get_finished_spans()}
    assert {"submit", "job", "claim", "commit", "upload"} <= set(by_name)
    trace = by_name["submit"].context.trace_id
    assert all(span.context.trace_id == trace for span in by_name.values())
    job = by_name["job"]
    assert by_name["claim"].parent.span_id == job.context.span_id
    assert by_name["upload"].parent.span_id == by_name["commit"].context.span_id
    assert job.attributes["job.id"] and job.attributes["receive_count"] == 1
    assert not any("http" in str(v) for span in by_name.values() for v in span.attributes.values())
