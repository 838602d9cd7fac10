"""The web page in a real browser: Debian's headless chromium loads it, runs /static/ui.js under the
page's own Content-Security-Policy, and prints the DOM it ends with (``--dump-dom``).

``--virtual-time-budget`` lets the page's timers run (the 3 s poll) without the test waiting for them in
wall time; chromium holds virtual time while a fetch is in flight, so the poll's answer is in the DOM.
Without chromium these tests fail, naming the package: they are the only check that the script runs.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess

import pytest

from tests.ops.ui_support import JOB, LOSS, running_job, write_fields
from tests.ops.ui_support import bench as bench  # noqa: F401 - the fixture

BROWSERS = ("chromium", "chromium-browser", "chromium-headless-shell")
BUDGET_MS = 12_000  # virtual: four polls


@pytest.fixture(scope="module")
def chromium() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        pytest.fail("chromium is not installed: the web page's browser tests need Debian's chromium "
                    "(apt-get install chromium); .ci/run installs it")
    return found


def dump_dom(chromium: str, url: str, tmp_path, budget_ms: int = BUDGET_MS) -> str:
    """The DOM after the page's scripts ran for ``budget_ms`` of virtual time."""
    argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
            "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--disable-features=Translate",
            f"--virtual-time-budget={budget_ms}", "--dump-dom", url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def polylines(dom: str) -> list[int]:
    """The number of points of each loss polyline in the DOM, in order."""
    return [len(points.split()) for points in re.findall(r'<polyline class="curve" points="([^"]*)"', dom)]


def test_the_jobs_list_and_the_workers_and_queue_pages_load(chromium, bench, tmp_path):
    """Each page renders in the browser with its heading and the job linked."""
    running_job(bench.store)
    assert f'href="/jobs/{JOB}"' in dump_dom(chromium, bench.url + "/", tmp_path, 500)
    assert "<h1>Workers</h1>" in dump_dom(chromium, bench.url + "/workers", tmp_path, 500)
    assert "<h1>Queue</h1>" in dump_dom(chromium, bench.url + "/queue", tmp_path, 500)


def test_the_loss_curve_is_drawn_with_every_recorded_point(chromium, bench, tmp_path):
    """After the script redrew the charts from the API, each polyline has one point per recorded step."""
    running_job(bench.store)
    dom = dump_dom(chromium, f"{bench.url}/jobs/{JOB}", tmp_path)
    assert polylines(dom) == [len(LOSS), 3]
    assert f"/api/jobs/{JOB}" in bench.requests  # the polylines above were drawn by the script


def test_progress_updates_without_a_reload(chromium, bench, tmp_path):
    """The record changes after the page was served: the page shows the new step, percent and curve,
    though the page itself was fetched once."""
    running_job(bench.store)
    served, calls = bench.sources.job, []

    def job_then_progress(job_id: str):
        page = served(job_id)
        calls.append(job_id)
        if len(calls) == 1:  # the worker moves on right after the page was drawn
            write_fields(bench.store, JOB, {
                "progress": {"percent": 90.0, "step": 450, "overallPercent": 80.0},
                "metrics": {"train_full": {"loss": [*LOSS, [300, 0.01], [310, 0.009]]}}})
        return page

    bench.sources.job = job_then_progress  # type: ignore[method-assign]
    dom = dump_dom(chromium, f"{bench.url}/jobs/{JOB}", tmp_path)
    assert bench.requests.count(f"/jobs/{JOB}") == 1 and f"/api/jobs/{JOB}" in bench.requests
    assert '<span data-field="progress.percentText">90 %</span>' in dom
    assert '<span data-field="progress.step">450</span>' in dom
    assert '<span data-field="progress.overallText">80 %</span>' in dom
    assert polylines(dom) == [len(LOSS) + 2]


def test_a_finished_job_stops_polling(chromium, bench, tmp_path):
    """A job in a final status is not polled: its page says no more updates come."""
    running_job(bench.store)
    write_fields(bench.store, JOB, {"status": "completed"})
    dom = dump_dom(chromium, f"{bench.url}/jobs/{JOB}", tmp_path)
    assert "the job has ended: no more updates" in dom and f"/api/jobs/{JOB}" not in bench.requests


EVIL = ('<script src="/pwned-script.js"></script><img src="/pwned-img" onerror="document.title=\'pwned\'">'
        '<iframe src="/pwned-frame"></iframe><b>bold</b>')


def test_a_malicious_job_field_is_rendered_inert(chromium, bench, tmp_path):
    """HTML and script in the job's fields, on the first render and after the script's updates: no
    element made of them (nothing they name is ever requested, no title changed), only their text."""
    running_job(bench.store)
    write_fields(bench.store, JOB, {
        "error": {"type": EVIL, "message": EVIL + "x" * 50_000, "retryable": True},
        "progress": {"stage": EVIL, "latest": {EVIL: 1.0}},
        "metrics": {EVIL: {"loss" + EVIL: LOSS}},
        "baseModel": {"name": EVIL, "licence": EVIL, "digest": EVIL}})
    bench.tails[JOB] = EVIL
    for url in (f"{bench.url}/jobs/{JOB}", f"{bench.url}/"):
        dom = dump_dom(chromium, url, tmp_path)
        assert not [r for r in bench.requests if "pwned" in r]
        assert "<b>bold</b>" not in dom and "<iframe" not in dom and "<img" not in dom
        assert re.findall(r"<script\b[^>]*>", dom) == ['<script src="/static/ui.js" defer="">']
        assert "<title>pwned" not in dom
        assert html.escape('<script src="/pwned-script.js">', quote=False) in dom  # shown as text
    assert f"/api/jobs/{JOB}" in bench.requests  # the script's own writes were exercised too
