"""Error reporting to Sentry, when SENTRY_DSN is set. Reporting never changes a job's outcome."""

from __future__ import annotations

from typing import Any

import structlog

from worker.logs import scrub

log = structlog.get_logger(__name__)


def scrub_event(event: Any, _hint: Any = None) -> Any:
    """A Sentry event with every URL in every string cut down to scheme://host/path."""
    if isinstance(event, str):
        return scrub(event) if "://" in event else event
    if isinstance(event, dict):
        return {k: scrub_event(v) for k, v in event.items()}
    if isinstance(event, list | tuple):
        return [scrub_event(v) for v in event]
    return event


class Reporter:
    def __init__(self, dsn: str | None, *, environment: str | None = None, sdk=None):
        self._sdk = None
        if not dsn:
            return
        if sdk is None:
            import sentry_sdk as sdk  # imported only when configured
        try:
            # No PII, no frame locals (a download's locals hold presigned URLs), and every string in
            # the event scrubbed of URL query strings as a last line of defence.
            sdk.init(dsn=dsn, environment=environment, send_default_pii=False, max_breadcrumbs=20,
                     include_local_variables=False, before_send=scrub_event)
            self._sdk = sdk
        except Exception as exc:  # the reporter must never stop the worker
            log.error("reporting.init_failed", error=f"{type(exc).__name__}: {exc}")

    @property
    def enabled(self) -> bool:
        return self._sdk is not None

    def capture(self, exc: BaseException) -> None:
        """Send ``exc`` to Sentry; a failure to report is logged and swallowed."""
        if self._sdk is None:
            return
        try:
            self._sdk.capture_exception(exc)
        except Exception as report_exc:
            log.error("reporting.capture_failed", error=f"{type(report_exc).__name__}: {report_exc}")
