"""Error reporting to Sentry, when SENTRY_DSN is set. Reporting never changes a job's outcome."""

from __future__ import annotations

import structlog

log = structlog.get_logger(__name__)


class Reporter:
    def __init__(self, dsn: str | None, *, environment: str | None = None, sdk=None):
        self._sdk = None
        if not dsn:
            return
        if sdk is None:
            import sentry_sdk as sdk  # imported only when configured
        try:
            # No default PII: message bodies and URLs stay out of events.
            sdk.init(dsn=dsn, environment=environment, send_default_pii=False, max_breadcrumbs=20)
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
