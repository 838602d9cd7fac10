"""Tracing: off by default and free, on with OpenTelemetry: one trace from submit to the commit."""

from __future__ import annotations

import sys

import pytest

from tests.support import recorded_spans
from worker.core import tracing
from worker.core.errors import ConfigError


@pytest.fixture
def spans():
    with recorded_spans() as exporter:
        yield exporter


def test_off_every_call_is_a_no_op():
    """Without enable(): no span, no attributes to carry, nothing extracted."""
    assert not tracing.enabled()
    with tracing.span("job", x=1):
        pass
    assert tracing.message_attributes() == {} and tracing.extract({"traceparent": {}}) is None


def test_the_trace_context_travels_in_message_attributes(spans):
    """What submit puts in the message's attributes continues the same trace in the worker."""
    with tracing.span("submit"):
        attributes = tracing.message_attributes()
    assert set(attributes) == {"traceparent"} and attributes["traceparent"]["DataType"] == "String"
    with tracing.span("job", parent=tracing.extract(attributes)):
        pass
    submit, job = spans.get_finished_spans()
    assert job.context.trace_id == submit.context.trace_id and job.parent.span_id == submit.context.span_id


def test_enabling_without_opentelemetry_is_a_config_error(monkeypatch):
    """TRACING_ENABLED without the package stops the start with how to install it."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ConfigError, match="voice-worker\\[tracing\\]"):
        tracing.enable()
    assert not tracing.enabled()
