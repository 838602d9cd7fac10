"""Stopping a stage ends processes that left its session, and their open pipe never blocks the runner."""

from __future__ import annotations

import os
import queue
import signal
import textwrap
import time

import pytest

from pipeline.config import StageSpec
from pipeline.stages import OutputReader, StageContext, run_stage
from tests.pipeline.test_stages import process_alive
from tests.support import run_unprivileged
from worker.core.errors import Stopped
from worker.core.stop import StopSignal

# Forks a child that starts its own session (outside the stage's process group) and writes to the
# shared stdout until killed; the parent waits for the setsid, publishes both pids, then either exits
# 0 at once or waits to be stopped. "clean-env" re-execs the child without the inherited environment;
# "detached" lets go of the pipe as a daemon would.
ESCAPER = """
import os, signal, subprocess, sys, time
pidfile, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
ready = pidfile + ".child"
child = os.fork()
if child == 0:
    os.setsid()
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "detached":
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    open(ready, "w").close()
    loop = "import time\\nwhile True:\\n    try:\\n        print('tick', flush=True)\\n    except OSError:\\n        pass\\n    time.sleep(0.2)\\n"
    if mode == "clean-env":
        os.execve(sys.executable, [sys.executable, "-c", loop], {})
    exec(loop)
while not os.path.exists(ready):
    time.sleep(0.01)
with open(pidfile + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child}")
os.replace(pidfile + ".tmp", pidfile)
if mode in ("exit-0", "clean-env"):
    open(out, "w").write("done")
    sys.exit(0)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("PROGRESS 1", flush=True)
time.sleep(60)
"""


@pytest.fixture
def ctx(tmp_path) -> StageContext:
    return StageContext(dataset_dir=tmp_path / "ds", output_dir=tmp_path / "out", checkpoints_root=tmp_path / "ck",
                        log_dir=tmp_path / "logs", job_id="j", language="en")


@pytest.fixture
def escaper(tmp_path):
    """The escaping stage for a mode, and the pids it published (killed at teardown if a test failed)."""
    script = tmp_path / "escaper.py"
    script.write_text(textwrap.dedent(ESCAPER))
    pidfile = tmp_path / "pids"

    def stage(mode: str) -> StageSpec:
        return StageSpec(name="escaper", argv=("{python}", str(script), str(pidfile), mode, "{output_dir}/o"),
                         outputs=("o",))

    stage.pids = lambda: [int(p) for p in pidfile.read_text().split()]
    yield stage
    if pidfile.exists():
        for pid in stage.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("mode", ["normal", "ignore-term", "detached"])
def test_stop_ends_a_child_that_started_its_own_session(ctx, escaper, mode):
    """A stopped stage's setsid child is ended too, and run_stage returns within the grace plus a second."""
    grace_s = 0.5
    stop = StopSignal()
    stopped_at = []

    def on_progress(name, pct):
        stopped_at.append(time.monotonic())
        stop.set("cancelled")

    with pytest.raises(Stopped):
        run_stage(escaper(mode), ctx, stop, on_progress, grace_s=grace_s)
    assert time.monotonic() - stopped_at[0] < grace_s + 1.0
    assert not any(process_alive(pid) for pid in escaper.pids())


@pytest.mark.parametrize("mode", ["exit-0", "clean-env"])
def test_stage_exiting_while_a_setsid_grandchild_holds_the_pipe_does_not_hang(ctx, escaper, mode):
    """A stage that exits 0 leaving a setsid grandchild on its stdout completes promptly; the stray is ended."""
    grace_s = 1.0
    started = time.monotonic()
    result = run_stage(escaper(mode), ctx, StopSignal(), lambda *_: None, grace_s=grace_s)
    assert not result.skipped and time.monotonic() - started < grace_s + 1.0
    assert not any(process_alive(pid) for pid in escaper.pids())


def test_output_reader_finishes_while_a_writer_still_holds_the_pipe(tmp_path):
    """finish() drains what was written, closes the pipe and returns although the write end stays open."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"first\nPROGRESS 5\npartial")
    updates: queue.SimpleQueue = queue.SimpleQueue()
    pipe = os.fdopen(read_fd, "rb")
    try:
        with open(tmp_path / "log", "ab") as log_file:
            reader = OutputReader(pipe, log_file, updates, name="test-reader")
            started = time.monotonic()
            assert reader.finish(0.3)
            assert time.monotonic() - started < 1.0
        assert (tmp_path / "log").read_bytes() == b"first\nPROGRESS 5\npartial"
        assert updates.get_nowait() == 5.0 and pipe.closed
    finally:
        os.close(write_fd)


# As an undumpable worker would: start a process in its own session carrying the run's token, and
# look for it by that token alone (not the group, not the pipe).
FIND_BY_TOKEN_WHILE_UNDUMPABLE = """
import os, subprocess, time
from pipeline.proctree import TOKEN_NAME, StageTree
from worker.core.hardening import make_undumpable
assert make_undumpable() is None
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True,
                         env={TOKEN_NAME: "run-1"}, stdout=subprocess.DEVNULL)
try:
    for _ in range(200):  # until the child has exec'd and its environ holds the token
        if child.pid in StageTree(pgid=os.getpgrp(), token="run-1").members():
            print("found")
            break
        time.sleep(0.05)
    else:
        print("not found")
finally:
    child.kill()
    child.wait()
"""


def test_an_undumpable_worker_still_finds_its_stage_by_the_environment_token():
    """A stage re-gains dumpable at exec, so an unprivileged, undumpable worker still reads its environ."""
    assert run_unprivileged(FIND_BY_TOKEN_WHILE_UNDUMPABLE) == "found"
