"""ECS task scale-in protection: the one place the ECS container agent's endpoint is called.

While a job runs, the task asks the agent on its host to protect it
(``PUT $ECS_AGENT_URI/task-protection/v1/state``), so that neither a deployment nor the service's
scale-in stops it mid-job; once the job is settled it drops the protection again. The worker loop
calls ``busy`` and ``idle`` (its ``Activity`` hook) and knows nothing of ECS.

The agent's endpoint is local to the task (ECS sets ``ECS_AGENT_URI``); the agent makes the
``UpdateTaskProtection`` call to ECS with the task role's credentials, so the task role needs
``ecs:UpdateTaskProtection`` (without it, each call is refused with ``AccessDeniedException`` and the
warning says so). Outside ECS the variable is absent and nothing here is made.

Protection is a courtesy, never a condition of the job: a call that fails or times out is one
warning line and the job runs on unprotected (the shutdown grace still applies). Each call waits at
most ``TIMEOUT_S``: it runs on the loop's thread, and a hung agent must not stall it.

Clearing it matters more: a clear that is lost leaves an idle task protected for up to the job's
whole time limit, so scale-in cannot remove it (hours of an idle GPU). ``idle`` therefore tries again
after ``CLEAR_BACKOFF_S`` pauses, all tries within ``CLEAR_DEADLINE_S`` (it also runs on the shutdown
path, after the last message is settled); one that never held is an error line and the
``TaskProtectionClearFailures`` metric, which an alarm can watch.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from worker.core.metrics import NULL_METRICS, PROTECTION_CLEAR_FAILURES, Metrics
from worker.core.redact import strip_control

log = structlog.get_logger(__name__)

PATH = "/task-protection/v1/state"
TIMEOUT_S = 3.0
# What the agent accepts for ExpiresInMinutes.
MIN_MINUTES, MAX_MINUTES = 1, 2880
_MAX_SHOWN_CHARS = 200
MAX_ANSWER_BYTES = 64 * 1024
IAM_HINT = "the task role needs ecs:UpdateTaskProtection on this cluster's tasks"
# Pauses between the tries of a clear, and the bound on all of them (tries and pauses) together.
CLEAR_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
CLEAR_DEADLINE_S = 15.0


def retry_pauses_s(backoff_s: Sequence[float], deadline_s: float, try_s: float = TIMEOUT_S) -> list[float]:
    """The pauses before each further try that fit ``deadline_s`` with the first try and one more try
    (at most ``try_s``) after each pause: the bounded backoff of a clear."""
    pauses, spent_s = [], try_s
    for pause_s in backoff_s:
        if spent_s + pause_s + try_s > deadline_s:
            break
        pauses.append(pause_s)
        spent_s += pause_s + try_s
    return pauses


def protection_minutes(for_at_most_s: float) -> int:
    """Minutes of protection for a job that may take ``for_at_most_s``: rounded up, one minute more for
    settling the message, within what the agent accepts (1 to 2880, i.e. 48 hours)."""
    return max(MIN_MINUTES, min(MAX_MINUTES, math.ceil(for_at_most_s / 60) + 1))


def protection_body(enabled: bool, for_at_most_s: float | None = None) -> dict[str, Any]:
    """The request body: protection on for as long as the job may take, or off."""
    if not enabled:
        return {"ProtectionEnabled": False}
    assert for_at_most_s is not None
    return {"ProtectionEnabled": True, "ExpiresInMinutes": protection_minutes(for_at_most_s)}


def refusal(status: int, body: bytes) -> str | None:
    """Why the agent's answer is not a success, or None when it is one; never raises, whatever the body.

    The agent answers errors with a status of 400 or more and ``{"error": {"Code", "Message"}}``, and
    a call ECS itself refused with 200 and ``{"failure": {"Reason", "Detail"}}``."""
    try:
        answer = json.loads(body or b"{}")
    # RecursionError: a body of nested brackets, under the read cap, is deeper than the decoder goes.
    except (ValueError, RecursionError):
        answer = {}
    if not isinstance(answer, dict):
        answer = {}
    if status >= 400:
        error = answer.get("error")
        if not isinstance(error, dict):
            error = {}
        return _reason(f"HTTP {status}:", error.get("Code"), error.get("Message"))
    failure = answer.get("failure")
    if failure:
        if not isinstance(failure, dict):
            return "failure"
        return _reason("failure:", failure.get("Reason"), failure.get("Detail"))
    return None


def _reason(prefix: str, *fields: Any) -> str:
    # Text fields only: the str() of a deeply nested value could itself hit the recursion limit.
    return " ".join([prefix, *(field for field in fields if isinstance(field, str) and field)])


class TaskProtection:
    """The worker's ``Activity`` on ECS: protection on while busy, off when idle; failures only logged."""

    def __init__(self, agent_uri: str, *, timeout_s: float = TIMEOUT_S,
                 clear_backoff_s: Sequence[float] = CLEAR_BACKOFF_S, clear_deadline_s: float = CLEAR_DEADLINE_S,
                 metrics: Metrics = NULL_METRICS,
                 sleep: Callable[[float], None] = time.sleep):
        self._url = agent_uri.rstrip("/") + PATH
        self._timeout_s = timeout_s
        self._clear_pauses_s = retry_pauses_s(clear_backoff_s, clear_deadline_s, timeout_s)
        self._metrics, self._sleep = metrics, sleep
        # No proxy: the agent is on the task's own host (169.254.170.2), and an HTTP(S)_PROXY set for
        # the downloads must not carry the call elsewhere.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def busy(self, for_at_most_s: float) -> None:
        self._put(protection_body(True, for_at_most_s))

    def idle(self) -> None:
        """Clear the protection, trying again with a bounded backoff until it holds (see the module)."""
        body = protection_body(False)
        for pause_s in [*self._clear_pauses_s, None]:
            if self._put(body, last=pause_s is None):
                return
            if pause_s is not None:
                self._sleep(pause_s)
        log.error("task_protection.clear_failed", tries=len(self._clear_pauses_s) + 1,
                  note="this task may stay protected from scale-in until the protection expires")
        self._metrics.count(PROTECTION_CLEAR_FAILURES)

    def _put(self, body: dict[str, Any], *, last: bool = True) -> bool:
        enabled = body["ProtectionEnabled"]
        request = urllib.request.Request(self._url, data=json.dumps(body).encode(), method="PUT",
                                         headers={"Content-Type": "application/json"})
        try:
            problem = self._answer(request)
        # URLError, a timeout, a refused or dropped connection, a garbled answer, a bad URI.
        except (OSError, http.client.HTTPException, ValueError) as exc:
            problem = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        if problem is not None:
            # The agent URI is not shown: it names the task, and the event says enough to find it.
            hint = {"hint": IAM_HINT} if "AccessDenied" in problem else {}
            # A try that will be made again is not yet a failure: one warning per call, as before.
            (log.warning if last else log.info)("task_protection.failed" if last else "task_protection.retrying",
                                                enabled=enabled,
                        error=strip_control(problem, keep_lines=False)[:_MAX_SHOWN_CHARS], **hint)
            return False
        log.info("task_protection.set", enabled=enabled, expires_in_minutes=body.get("ExpiresInMinutes"))
        return True

    def _answer(self, request: urllib.request.Request) -> str | None:
        # An error's body is read here too, so that a read that fails half-way (a garbled chunk, a reset
        # connection) is caught by the caller like any other failed call.
        try:
            with self._opener.open(request, timeout=self._timeout_s) as response:
                return refusal(response.status, response.read(MAX_ANSWER_BYTES))
        except urllib.error.HTTPError as exc:
            with exc:
                return refusal(exc.code, exc.read(MAX_ANSWER_BYTES))


def task_protection(agent_uri: str | None, metrics: Metrics = NULL_METRICS) -> TaskProtection | None:
    """The protection for this task when ECS runs it (``ECS_AGENT_URI`` set), else None."""
    return TaskProtection(agent_uri, metrics=metrics) if agent_uri else None
