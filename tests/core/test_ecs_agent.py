"""ECS task scale-in protection: on while a job runs, off once it is settled, never fatal, only on ECS."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from structlog.testing import capture_logs

from worker.core import ecs_agent
from worker.core.ecs_agent import MAX_MINUTES, PATH, TaskProtection, protection_minutes, refusal, task_protection
from worker.core.loop import busy_for_s
from worker.core.metrics import PROTECTION_CLEAR_FAILURES
from worker.settings import load_settings


class AgentStandIn:
    """The agent's task-protection endpoint on 127.0.0.1: records each PUT, answers as told.

    ``answer`` is (status, body: a dict sent as JSON, bytes as they are); ``hang`` makes it wait for
    ``release`` before answering.
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.answer: tuple[int, dict | bytes] = (200, {"protection": {"ProtectionEnabled": True}})
        # Answers given once each, in order, before ``answer`` takes over.
        self.answers: list[tuple[int, dict | bytes]] = []
        self.hang = False
        self.release = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append({"path": self.path, "body": body,
                                          "content_type": self.headers["Content-Type"]})
                if stand_in.hang:
                    stand_in.release.wait(10)
                status, answer = stand_in.answers.pop(0) if stand_in.answers else stand_in.answer
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.server.server_port}/api/task-1234"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def bodies(self) -> list[dict]:
        return [r["body"] for r in self.requests]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def agent():
    with AgentStandIn() as stand_in:
        yield stand_in


class Recording:
    """An Activity that notes each call and what the queue had done by then."""

    def __init__(self, queue):
        self.queue, self.calls = queue, []

    def busy(self, for_at_most_s):
        self.calls.append(("busy", for_at_most_s, tuple(self.queue.ops())))

    def idle(self):
        self.calls.append(("idle", None, tuple(self.queue.ops())))


@pytest.mark.parametrize(("for_s", "minutes"), [
    (0, 1), (59, 2), (60, 2), (61, 3), (21_600 + 10.2, 362), (3 * 86_400, MAX_MINUTES),
])
def test_the_protection_lasts_the_jobs_longest_run_plus_a_minute_within_ecs_bounds(for_s, minutes):
    """Minutes are rounded up plus one for the settle, at least 1 and at most ECS's 2880."""
    assert protection_minutes(for_s) == minutes


def test_the_loop_says_busy_with_the_time_limit_and_wind_down_then_idle_after_the_settle(
        memory_queue, make_memory_worker):
    """busy() comes when the job starts, with its time limit plus wind-down; idle() only after the delete."""
    activity = Recording(memory_queue)
    worker = make_memory_worker(lambda message, lease: None, activity=activity, JOB_TIME_LIMIT_SECONDS=3600)
    memory_queue.send()
    assert worker.run_once() == "ack"
    limit_s = busy_for_s(load_settings({"JOB_TIME_LIMIT_SECONDS": "3600", "SHUTDOWN_GRACE_SECONDS": "5",
                                        "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "200"}).lease_timings())
    assert limit_s == pytest.approx(3600 + 5 + 0.2)
    assert [call[:2] for call in activity.calls] == [("busy", limit_s), ("idle", None)]
    assert activity.calls[1][2][-1] == "delete"


def test_a_message_handed_back_unworked_never_makes_the_worker_busy(memory_queue, make_memory_worker):
    """A message received during a shutdown is released without a busy() or idle() call."""
    activity = Recording(memory_queue)
    worker = make_memory_worker(lambda message, lease: None, activity=activity)
    worker.stop()
    memory_queue.send()
    assert worker.run_once() == "release"
    assert activity.calls == []


def test_a_job_sets_protection_while_it_runs_and_clears_it_after(agent, memory_queue, make_memory_worker):
    """Through the stand-in agent: PUT enabled with the expiry before the handler runs, PUT disabled after the ack."""
    during = []
    worker = make_memory_worker(lambda message, lease: during.append(list(agent.bodies)),
                                activity=TaskProtection(agent.uri), JOB_TIME_LIMIT_SECONDS=3600)
    memory_queue.send()
    with capture_logs() as logs:
        assert worker.run_once() == "ack"
    enabled = {"ProtectionEnabled": True, "ExpiresInMinutes": 62}  # ceil(3605.2 s / 60) + 1
    assert during == [[enabled]]
    assert agent.bodies == [enabled, {"ProtectionEnabled": False}]
    assert {r["path"] for r in agent.requests} == {f"/api/task-1234{PATH}"}
    assert {r["content_type"] for r in agent.requests} == {"application/json"}
    assert [e["enabled"] for e in logs if e["event"] == "task_protection.set"] == [True, False]


@pytest.mark.parametrize(("status", "answer", "shown"), [
    (400, {"error": {"Code": "InvalidRequest", "Message": "Invalid request: ExpiresInMinutes"}}, "HTTP 400: InvalidRequest"),
    (500, {"error": {"Code": "ServerException", "Message": "boom"}}, "HTTP 500: ServerException boom"),
    (403, {"error": {"Arn": "arn:aws:ecs:task/1", "Code": "AccessDeniedException",
                     "Message": "Invalid Request: no task IAM role credentials available for task"}},
     "HTTP 403: AccessDeniedException"),
    (200, {"failure": {"Arn": "arn:aws:ecs:task/1", "Reason": "TASK_NOT_VALID", "Detail": "stopping"}},
     "failure: TASK_NOT_VALID stopping"),
])
def test_a_refused_protection_is_one_warning_and_the_job_still_completes(agent, memory_queue, make_memory_worker,
                                                                       status, answer, shown):
    """An agent error or an ECS failure is logged as a warning with its reason; the job is acked all the same."""
    agent.answer = (status, answer)
    worker = make_memory_worker(lambda message, lease: None, activity=TaskProtection(agent.uri, sleep=lambda _s: None))
    memory_queue.send()
    with capture_logs() as logs:
        assert worker.run_once() == "ack"
    failed = [e for e in logs if e["event"] == "task_protection.failed"]
    assert [(e["log_level"], e["enabled"]) for e in failed] == [("warning", True), ("warning", False)]
    assert all(e["error"].startswith(shown) for e in failed)
    assert all(("hint" in e) == (status == 403) for e in failed)  # the IAM fix, named where it is the cause
    assert all(agent.uri not in json.dumps(e) for e in logs)


def test_an_unreachable_agent_is_a_warning_not_a_crash(memory_queue, make_memory_worker):
    """Nothing listening at ECS_AGENT_URI: each call logs one warning and the job is acked."""
    with AgentStandIn() as gone:
        uri = gone.uri  # a port that was just closed
    worker = make_memory_worker(lambda message, lease: None, activity=TaskProtection(uri, sleep=lambda _s: None))
    memory_queue.send()
    with capture_logs() as logs:
        assert worker.run_once() == "ack"
    assert [e["event"] for e in logs if e["event"] in ("task_protection.failed", "task_protection.clear_failed")] == [
        "task_protection.failed", "task_protection.failed", "task_protection.clear_failed"]


def test_a_hung_agent_costs_at_most_the_timeout(agent):
    """An agent that never answers is given up after the call's timeout: a warning, and the call returns."""
    agent.hang = True
    protection = TaskProtection(agent.uri, timeout_s=0.2)
    with capture_logs() as logs:
        protection.busy(60)
    [failed] = [e for e in logs if e["event"] == "task_protection.failed"]
    assert "timed out" in failed["error"]


def test_the_agent_is_reached_without_the_download_proxy(agent, monkeypatch):
    """An HTTP proxy set in the environment (for downloads) is not used for the agent on the task's host."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    TaskProtection(agent.uri).idle()
    assert agent.bodies == [{"ProtectionEnabled": False}]


def test_without_ecs_agent_uri_there_is_no_protection():
    """Outside ECS (no ECS_AGENT_URI, as on systemd hosts) no protection is made, so no call is ever sent."""
    assert load_settings({}).ecs_agent_uri is None
    assert task_protection(load_settings({}).ecs_agent_uri) is None
    made = task_protection(load_settings({"ECS_AGENT_URI": "http://169.254.170.2/api/abc"}).ecs_agent_uri)
    assert isinstance(made, TaskProtection)


DEEP = b"[" * 60_000  # under the 64 KiB read cap, far deeper than the JSON decoder goes
DEEP_VALUE = b"[" * 500 + b"]" * 500  # nested, but within what the decoder goes


@pytest.mark.parametrize("status", [200, 400, 500])
@pytest.mark.parametrize("body", [
    DEEP, b"\xff\xfe\x00", b"{", b"null", b"[]", b'"text"', b"1" * 5000,
    b'{"failure": {"Reason": ' + DEEP_VALUE + b', "Detail": ' + DEEP_VALUE + b"}}",
    b'{"error": {"Code": ' + DEEP_VALUE + b', "Message": {"a": 1}}}',
])
def test_any_answer_from_the_agent_reads_as_a_success_or_a_reason(status, body):
    """However garbled the agent's answer, it is read as a success (None) or one line of reason."""
    reason = refusal(status, body)
    if status >= 400:
        assert isinstance(reason, str) and reason.startswith(f"HTTP {status}:") and "\n" not in reason
    else:
        assert reason is None or reason.startswith("failure")


def test_a_reason_shows_only_the_text_the_agent_sent():
    """Code, Message, Reason and Detail are shown when they are strings and left out otherwise."""
    assert refusal(500, b'{"error": {"Code": [[1]], "Message": "boom"}}') == "HTTP 500: boom"
    assert refusal(200, b'{"failure": {"Reason": "TASK_NOT_VALID", "Detail": {"a": 1}}}') == "failure: TASK_NOT_VALID"
    assert refusal(403, b'{"error": {"Code": 7}}') == "HTTP 403:"


def test_a_garbled_error_from_the_agent_is_one_warning_and_the_job_still_completes(agent, memory_queue,
                                                                                  make_memory_worker):
    """An HTTP 500 whose body is 60,000 brackets is a warning naming the status; the job is acked."""
    agent.answer = (500, DEEP)
    worker = make_memory_worker(lambda message, lease: None, activity=TaskProtection(agent.uri, sleep=lambda _s: None))
    memory_queue.send()
    with capture_logs() as logs:
        assert worker.run_once() == "ack"
    assert [e["error"] for e in logs if e["event"] == "task_protection.failed"] == ["HTTP 500:"] * 2


class ShortAnswer:
    """An agent on 127.0.0.1 that answers each request with an error whose chunked body is garbled."""

    def __init__(self, status: int):
        self._server = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self._server.getsockname()[1]}/api/task-1"
        self._status = status
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self):
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed by __exit__
                return
            with connection:
                connection.recv(65536)
                connection.sendall(f"HTTP/1.1 {self._status} Oops\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   "zz\r\n{".encode())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() the thread is blocked in
        self._server.close()


def test_an_error_whose_body_cannot_be_read_is_a_warning_not_a_crash():
    """An error answer whose body breaks off unreadably (a chunk size "zz") is one warning, never raised."""
    with ShortAnswer(500) as agent, capture_logs() as logs:
        TaskProtection(agent.uri, timeout_s=5).busy(60)
    [failed] = [e for e in logs if e["event"] == "task_protection.failed"]
    assert failed["error"].startswith("IncompleteRead")


class Raising:
    """An Activity whose busy() or idle() raises, as a broken hook would; it notes each call."""

    def __init__(self, *, fail_busy: bool = False, fail_idle: bool = False):
        self.fail_busy, self.fail_idle, self.calls = fail_busy, fail_idle, []

    def busy(self, for_at_most_s):
        self.calls.append("busy")
        if self.fail_busy:
            raise RecursionError("maximum recursion depth exceeded")

    def idle(self):
        self.calls.append("idle")
        if self.fail_idle:
            raise ValueError("garbled")


@pytest.mark.parametrize("activity", [Raising(fail_busy=True), Raising(fail_idle=True)], ids=["busy", "idle"])
def test_an_activity_that_raises_is_logged_and_the_loop_goes_on(memory_queue, make_memory_worker, activity):
    """A busy() or idle() that raises is one error line: the job runs and is acked, and the next one too."""
    handled = []
    worker = make_memory_worker(lambda message, lease: handled.append(message.message_id), activity=activity)
    memory_queue.send()
    memory_queue.send()
    with capture_logs() as logs:
        assert [worker.run_once(), worker.run_once()] == ["ack", "ack"]
    assert len(handled) == 2 and activity.calls == ["busy", "idle"] * 2
    assert memory_queue.ops().count("delete") == 2
    assert [e["call"] for e in logs if e["event"] == "worker.activity_failed"] == [
        "busy" if activity.fail_busy else "idle"] * 2
    assert not [t for t in threading.enumerate() if t.name.startswith("heartbeat")]


class Counted:
    """Metrics that keep each count."""

    def __init__(self):
        self.counts: list[str] = []

    def count(self, name, value=1, **properties):
        self.counts.append(name)


REFUSED = (503, {"error": {"Code": "ServerException", "Message": "agent busy"}})


def test_a_clear_that_fails_is_tried_again_until_it_holds(agent):
    """Two refused clears, then one that holds: three PUTs, two pauses of the backoff, no metric."""
    agent.answers = [REFUSED, REFUSED]
    pauses, metrics = [], Counted()
    protection = TaskProtection(agent.uri, metrics=metrics, sleep=pauses.append)
    with capture_logs() as logs:
        protection.idle()
    assert agent.bodies == [{"ProtectionEnabled": False}] * 3
    assert pauses == [0.5, 1.0] and metrics.counts == []
    assert [e["event"] for e in logs] == ["task_protection.retrying"] * 2 + ["task_protection.set"]


def test_a_clear_that_never_holds_is_an_error_and_a_metric_within_its_deadline(agent):
    """Every try refused: the tries stop within CLEAR_DEADLINE_S (tries plus pauses), one error line
    and one TaskProtectionClearFailures count."""
    agent.answer = REFUSED
    pauses, metrics = [], Counted()
    protection = TaskProtection(agent.uri, metrics=metrics, sleep=pauses.append)
    with capture_logs() as logs:
        protection.idle()
    tries = len(agent.requests)
    assert tries == len(pauses) + 1 >= 2
    assert sum(pauses) + tries * ecs_agent.TIMEOUT_S <= ecs_agent.CLEAR_DEADLINE_S
    assert metrics.counts == [PROTECTION_CLEAR_FAILURES]
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == [
        "task_protection.failed", "task_protection.clear_failed"]


def test_setting_the_protection_is_tried_once():
    """Only the clear retries: a refused set costs the job's start one try."""
    with AgentStandIn() as stand_in:
        stand_in.answer = REFUSED
        pauses = []
        TaskProtection(stand_in.uri, sleep=pauses.append).busy(60)
        assert len(stand_in.requests) == 1 and pauses == []


@pytest.mark.parametrize(("backoff", "deadline", "pauses"), [
    ((0.5, 1.0, 2.0, 4.0), 15.0, [0.5, 1.0]), ((1.0,) * 10, 11.0, [1.0, 1.0]), ((5.0,), 3.0, []),
])
def test_the_backoff_keeps_only_the_pauses_that_fit_the_deadline(backoff, deadline, pauses):
    """Each pause is kept while it and one more try of TIMEOUT_S still fit the deadline."""
    assert ecs_agent.retry_pauses_s(backoff, deadline, try_s=3.0) == pauses
