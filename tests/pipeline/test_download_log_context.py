"""The download threads log in the job's context: a grep of a job id finds its downloads (issue #27, defect 2)."""

from __future__ import annotations

import structlog

from pipeline.download_pool import DownloadPool
from tests.pipeline.test_download_pool import items_in
from worker.core.stop import StopSignal


def test_every_download_thread_sees_the_context_of_the_job_that_started_it(tmp_path):
    """What the job bound (job_id, message_id) is what each fetch thread reads, on every file."""
    seen: list[dict] = []

    def fetch(_url, dest, **_kwargs) -> None:
        seen.append(structlog.contextvars.get_contextvars())
        dest.write_bytes(b"x")

    pool = DownloadPool(items_in(tmp_path, 4), fetch, StopSignal(), budget_bytes=None, file_max_bytes=None,
                        concurrency=2, over_budget="over the budget")
    with structlog.contextvars.bound_contextvars(job_id="665f1c2e9b1e8a0012ab34cd", message_id="m-1"):
        pool.run(lambda _done: None)
    assert len(seen) == 4
    assert all(c.get("job_id") == "665f1c2e9b1e8a0012ab34cd" and c.get("message_id") == "m-1" for c in seen)
