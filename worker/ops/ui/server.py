"""``python -m worker ui``: the read-only web page, on the standard library's ThreadingHTTPServer.

Why no web framework: the page has seven GET routes and no forms that write, sessions or templates
beyond escaped strings; the standard library serves that with no new dependency in the image (Flask
is in the dev environment only, as moto's), and a thread per request keeps a slow reader from
holding up the others (the stores' clients are thread-safe).

What keeps it safe to leave open on an operator's machine:
- loopback by default, and there a Host header that is not the loopback's is refused (a page on
  another site that rebinds its DNS name to 127.0.0.1 cannot read the answers);
- GET only: any other method is 405, whatever its name; no route writes;
- every answer carries a strict Content-Security-Policy (scripts, styles, fetches from this origin
  only; no inline script or style; no framing), nosniff and no-referrer; the API is never cached;
- job ids in paths are validated (``is_safe_name``), query values bounded; errors are one redacted line.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import structlog

from worker.core.errors import WorkerError
from worker.ops.commands import error_line, parse_since
from worker.ops.ui import pages
from worker.ops.ui.assets import UI_CSS, UI_JS
from worker.ops.ui.sources import Sources
from worker.ops.ui.views import text
from worker.voice.message import is_safe_name
from worker.voice.records.view import JOB_STATUSES

log = structlog.get_logger(__name__)

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")
MAX_QUERY_CHARS = 128
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
}
STATIC = {"/static/ui.js": ("text/javascript; charset=utf-8", UI_JS),
          "/static/ui.css": ("text/css; charset=utf-8", UI_CSS)}
_JOB_PATH = re.compile(r"/(api/)?jobs/([^/]+)")


class BadRequest(ValueError):
    """A request the page answers 400: the reason is shown as is (it names no value's secret)."""


def allowed_hosts(host: str, port: int) -> frozenset[str] | None:
    """The Host headers a server bound to ``host`` answers; None (any) when it is not on loopback,
    where the operator chose to expose it."""
    if host not in LOOPBACK_NAMES and not host.startswith("127."):
        return None
    names = {*LOOPBACK_NAMES, host}
    return frozenset({f"{n}:{port}" for n in names} | ({*names} if port == 80 else set()))


def jobs_filters(query: dict[str, list[str]]) -> tuple[str, str, str, Any]:
    """(status, since as typed, id text, since parsed) of the jobs list's query, or BadRequest."""
    def one(name: str) -> str:
        value = (query.get(name) or [""])[-1].strip()
        if len(value) > MAX_QUERY_CHARS:
            raise BadRequest(f"{name}: at most {MAX_QUERY_CHARS} characters")
        return value

    status, since_text, id_text = one("status"), one("since"), one("q")
    if status and status not in JOB_STATUSES:
        raise BadRequest(f"status: one of {', '.join(JOB_STATUSES)}")
    since: Any = None
    if since_text:
        try:
            since = parse_since(since_text)
        except ValueError:
            raise BadRequest("since: an ISO 8601 time (2026-12-01T09:00Z) or a duration (30m, 2h, 7d)") from None
    return status, since_text, id_text, since


class Handler(BaseHTTPRequestHandler):
    server: UiServer
    server_version = "voice-worker-ui"
    sys_version = ""

    # ------------------------------------------------------------ methods: GET, and 405 for any other

    def __getattr__(self, name: str) -> Callable[[], None]:
        # http.server looks up do_<METHOD>; without one it answers 501. Every method but GET is 405.
        if name.startswith("do_") and name != "do_GET":
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", "GET only: this page is read-only\n",
                   extra={"Allow": "GET"})

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        allowed = self.server.allowed_hosts
        if allowed is not None and self.headers.get("Host", "") not in allowed:
            self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain; charset=utf-8", "unexpected Host header\n")
            return
        try:
            self._route()
        except BadRequest as exc:
            self._page(HTTPStatus.BAD_REQUEST, pages.error_page(400, "bad request", str(exc)))
        except WorkerError as exc:
            log.warning("ui.read_failed", path=urlsplit(self.path).path[:200], error=error_line(exc))
            self._page(HTTPStatus.SERVICE_UNAVAILABLE,
                       pages.error_page(503, "unavailable", text(error_line(exc))))
        except Exception as exc:  # noqa: BLE001 - one request's failure must not end the server or show a traceback
            log.error("ui.request_failed", path=urlsplit(self.path).path[:200], error_type=type(exc).__name__)
            self._page(HTTPStatus.INTERNAL_SERVER_ERROR,
                       pages.error_page(500, "error", f"{type(exc).__name__} (see the ui's log)"))

    # ------------------------------------------------------------ routes

    def _route(self) -> None:
        url = urlsplit(self.path)
        path, sources = url.path, self.server.sources
        if path in STATIC:
            kind, body = STATIC[path]
            self._send(HTTPStatus.OK, kind, body, extra={"Cache-Control": "no-cache"})
        elif path == "/":
            status, since_text, id_text, since = jobs_filters(parse_qs(url.query))
            rows = sources.jobs(status=status or None, since=since, id_text=id_text)
            self._page(HTTPStatus.OK, pages.jobs_page(rows, status=status, since=since_text, id_text=id_text))
        elif path == "/api/jobs":
            status, _, id_text, since = jobs_filters(parse_qs(url.query))
            self._json(sources.jobs(status=status or None, since=since, id_text=id_text))
        elif match := _JOB_PATH.fullmatch(path):
            job_id = unquote(match[2])
            if not is_safe_name(job_id):
                raise BadRequest("not a job id: 1-128 letters, digits, '.', '_' or '-', starting alphanumeric")
            detail = sources.job(job_id)
            if detail is None:
                self._not_found(f"no job {job_id}", api=bool(match[1]))
            elif match[1]:
                self._json(detail)
            else:
                self._page(HTTPStatus.OK, pages.job_page(detail))
        elif path == "/workers":
            self._page(HTTPStatus.OK, pages.workers_page(*sources.workers()))
        elif path == "/api/workers":
            rows, note = sources.workers()
            self._json({"workers": rows, "note": note})
        elif path == "/queue":
            self._page(HTTPStatus.OK, pages.queue_page(*sources.queue()))
        elif path == "/api/queue":
            view, note = sources.queue()
            self._json({"queue": view, "note": note})
        else:
            self._not_found("no such page", api=path.startswith("/api/"))

    # ------------------------------------------------------------ answers

    def _not_found(self, detail: str, *, api: bool) -> None:
        if api:
            self._send(HTTPStatus.NOT_FOUND, "application/json", json.dumps({"error": detail}))
        else:
            self._page(HTTPStatus.NOT_FOUND, pages.error_page(404, "not found", detail))

    def _page(self, status: HTTPStatus, html_text: str) -> None:
        self._send(status, "text/html; charset=utf-8", html_text)

    def _json(self, value: Any) -> None:
        self._send(HTTPStatus.OK, "application/json", json.dumps(value), extra={"Cache-Control": "no-store"})

    def _send(self, status: HTTPStatus, kind: str, body: str, extra: dict[str, str] | None = None) -> None:
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for name, value in {**SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        # One structured line per request, the path only (a query may hold what was typed in a filter).
        log.debug("ui.request", method=self.command, path=urlsplit(self.path).path[:200], status=args[1]
                  if len(args) > 1 else None)


class UiServer(ThreadingHTTPServer):
    daemon_threads = True  # an open keep-alive connection never holds up the exit

    def __init__(self, address: tuple[str, int], sources: Sources):
        super().__init__(address, Handler)
        self.sources = sources
        self.allowed_hosts = allowed_hosts(address[0], self.server_address[1])


def make_server(sources: Sources, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> UiServer:
    """The server bound (port 0: any free one, read back from ``server_address``), not yet serving."""
    return UiServer((host, port), sources)


def serve(sources: Sources, host: str, port: int, *, out=None) -> int:
    """Serve until Ctrl-C."""
    out = out or sys.stdout
    server = make_server(sources, host, port)
    if server.allowed_hosts is None:
        print(f"warning: {host} is not loopback: anyone who reaches it reads every job, and the page has no "
              "login", file=sys.stderr)
    print(f"serving the read-only page on http://{host}:{server.server_address[1]}/ (Ctrl-C stops)", file=out,
          flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how this command ends: exit 0, not 130
    finally:
        server.server_close()
    return 0
