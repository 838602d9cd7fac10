"""Error reporting to Sentry, when SENTRY_DSN is set. Reporting never changes a job's outcome.

Breadcrumbs outlive the request that made them: a presigned download recorded as an http breadcrumb
would ride along with every later, unrelated event. So the SDK's stdlib integration, the one that
records http.client requests (URL and query string) and subprocess launches, is off: it would also
add Sentry's trace variables to every stage's environment. Every breadcrumb that other integrations
still make, and every event, is scrubbed anyway, since none of that is ours to audit.
"""

from __future__ import annotations

from typing import Any

import structlog

from worker.core.logs import scrub_value

log = structlog.get_logger(__name__)

# Where the SDK puts a request's query string and fragment, apart from the URL itself.
_DROPPED_KEYS = frozenset({"http.query", "http.fragment", "query_string"})


def scrub_event(event: Any, _hint: Any = None) -> Any:
    """A Sentry event with URLs cut to scheme://host/path, secret shapes masked, query fields dropped."""
    return scrub_value(event, drop_keys=_DROPPED_KEYS)


def scrub_breadcrumb(crumb: Any, _hint: Any = None) -> Any:
    """A breadcrumb scrubbed the way events are, before it is stored on the scope."""
    return scrub_event(crumb)


def _stdlib_integration() -> list:
    from sentry_sdk.integrations.stdlib import StdlibIntegration

    return [StdlibIntegration]


class Reporter:
    def __init__(self, dsn: str | None, *, environment: str | None = None, sdk=None):
        self._sdk = None
        if not dsn:
            return
        if sdk is None:
            import sentry_sdk as sdk  # imported only when configured
        try:
            # No PII, no frame locals (a download's locals hold presigned URLs), no stdlib breadcrumbs
            # (see the module docstring), and every breadcrumb and event scrubbed.
            sdk.init(dsn=dsn, environment=environment, send_default_pii=False, max_breadcrumbs=20,
                     include_local_variables=False, disabled_integrations=_stdlib_integration(),
                     before_breadcrumb=scrub_breadcrumb, before_send=scrub_event)
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
