"""Tracing with OpenTelemetry: an optional dependency (the ``tracing`` extra), off by default.

With ``TRACING_ENABLED=true`` a job is one trace from ``submit`` to its commit: ``submit`` puts the
W3C trace context (``traceparent``, ``tracestate``) into the SQS message's attributes, the worker
continues it, and the job's span (``job``) holds spans for the claim, the downloads, the dataset
step, each stage, the uploads and the commit, so a slow job can be read in any OpenTelemetry
backend. Where the spans go is OpenTelemetry's own configuration: run the worker under
``opentelemetry-instrument`` (or set a ``TracerProvider`` before it starts) with the ``OTEL_*``
variables of the exporter you use. Without a provider the API records nothing.

Off, or without the package, every call here is a no-op costing a function call; nothing of
OpenTelemetry is imported, so an idle worker does not pay for it. Spans carry ids, names, counts and
durations only: never a URL, a text or a path from the message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from worker.core.errors import ConfigError

NAME = "voice-worker"
# The W3C Trace Context fields, carried as SQS message attributes of type String.
CARRIED = ("traceparent", "tracestate")
_state: dict[str, Any] = {}


def enable(provider: Any = None) -> None:
    """Turn tracing on: spans from here on go to ``provider`` (a TracerProvider), or to the global one."""
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        raise ConfigError("TRACING_ENABLED=true needs OpenTelemetry: pip install 'voice-worker[tracing]'") from None
    source = provider if provider is not None else trace.get_tracer_provider()
    _state.update(tracer=source.get_tracer(NAME), trace=trace, propagate=propagate)


def disable() -> None:
    _state.clear()


def enabled() -> bool:
    return bool(_state)


@contextlib.contextmanager
def span(name: str, parent: Any = None, **attributes: str | int | float | bool) -> Iterator[None]:
    """A span around the block (a no-op while tracing is off); ``parent``: a context from ``extract``."""
    if not _state:
        yield
        return
    with _state["tracer"].start_as_current_span(name, context=parent, attributes=attributes):
        yield


def current_context() -> Any:
    """The active context, to hand to work done on another thread (``span(parent=...)``); None when off."""
    if not _state:
        return None
    from opentelemetry import context

    return context.get_current()


def message_attributes() -> dict[str, dict[str, str]]:
    """The current trace context as SQS message attributes (empty while tracing is off)."""
    if not _state:
        return {}
    carrier: dict[str, str] = {}
    _state["propagate"].inject(carrier)
    return {key: {"DataType": "String", "StringValue": value} for key, value in carrier.items() if key in CARRIED}


def extract(attributes: Mapping[str, Any]) -> Any:
    """The trace context a message carries (its attributes as SQS returns them), or None."""
    if not _state:
        return None
    carrier = {key: str(value.get("StringValue", "")) for key, value in attributes.items()
               if key in CARRIED and isinstance(value, Mapping)}
    return _state["propagate"].extract(carrier) if carrier else None
