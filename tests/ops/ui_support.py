"""The web page's test bench: a real SQLite store, the real server on a free loopback port in a thread,
and a way to write a job's fields as another writer (or the worker, later) would."""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field

import pytest

from tests.voice.records.conftest import WallClock
from worker.ops.ui.server import UiServer, make_server
from worker.ops.ui.sources import Sources
from worker.voice.records.sqlite import SqliteStore

JOB = "a" * 24
OTHER = "b" * 24

LOSS = [[step * 10, round(2.0 / (step + 1), 4)] for step in range(25)]  # 25 points, falling
METRICS = {"train_full": {"loss": LOSS, "loss_kl": [[0, 0.5], [120, 0.3], [240, 0.2]], "lr": [[0, 1e-4], [240, 5e-5]],
                          "val_cer": [[240, 0.07]]}}
PROGRESS = {"step": 240, "stageIndex": 2, "stageCount": 3, "overallPercent": 52.0, "etaS": 4230.0,
            "latest": {"loss": 0.08, "lr": 5e-5}}


def write_fields(store: SqliteStore, job_id: str, fields: dict) -> None:
    """Write fields over the stored job document as another writer would (a dict merges into a dict)."""
    (text,) = store._conn.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
    doc = json.loads(text)
    for key, value in fields.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) and isinstance(doc.get(key), dict) else value
    store._conn.execute("UPDATE jobs SET doc = ?, status = ? WHERE id = ?", (json.dumps(doc), doc["status"], job_id))


def running_job(store: SqliteStore, job_id: str = JOB, percent: float = 40.0) -> str:
    """A job claimed by worker w1 and 40 % into train_full, with a loss series and the stage contract's
    progress fields."""
    store.submit({"_id": job_id, "profileId": f"p-{job_id}"}, {"_id": f"p-{job_id}"})
    store.claim(job_id, owner="w1", token=f"t-{job_id}", lease_s=600)
    store.set_progress(job_id, f"t-{job_id}", "train_full", percent)
    write_fields(store, job_id, {"metrics": METRICS, "progress": PROGRESS})
    return job_id


@dataclass
class Bench:
    store: SqliteStore
    server: UiServer
    sources: Sources
    tails: dict[str, str] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, path: str, method: str = "GET", host: str | None = None) -> tuple[int, dict[str, str], str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.putrequest(method, path, skip_host=True)
            conn.putheader("Host", host or f"127.0.0.1:{self.port}")
            conn.endheaders()
            answer = conn.getresponse()
            return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read().decode("utf-8")
        finally:
            conn.close()


@pytest.fixture
def bench(tmp_path):
    clock = WallClock()
    store = SqliteStore(str(tmp_path / "records.db"), clock=clock)
    sources = Sources(store, clock=clock)
    bench = Bench(store, make_server(sources, "127.0.0.1", 0), sources)
    sources.log_tail = lambda job_id, count: bench.tails.get(job_id)
    seen = bench.server.RequestHandlerClass.log_message

    def counted(handler, format, *args):  # noqa: A002 - http.server's signature
        bench.requests.append(handler.path)
        seen(handler, format, *args)

    bench.server.RequestHandlerClass = type("CountingHandler", (bench.server.RequestHandlerClass,),
                                            {"log_message": counted})
    thread = threading.Thread(target=bench.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield bench
    bench.server.shutdown()
    bench.server.server_close()
    thread.join(timeout=10)
    store.close()
