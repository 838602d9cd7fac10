"""The checkpoint signal: when a shutdown begins, the stage's own process is told to checkpoint."""

from __future__ import annotations

import signal
import textwrap

import pytest

from pipeline.config import StageSpec
from pipeline.stages import StageContext, run_stage
from worker.core.stop import StopSignal

# Counts the signals it gets; a child of its own records whether the signal reached it too.
STAGE = """
import os, signal, subprocess, sys, time
out, child_marker, wait_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
child = subprocess.Popen(
    [sys.executable, "-c",
     "import signal, sys, time\\n"
     "signal.signal(signal.SIGUSR1, lambda *_: open(sys.argv[1], 'w').write('x'))\\n"
     "print('ready', flush=True)\\n"
     "time.sleep(60)\\n", child_marker],
    stdout=subprocess.PIPE)
child.stdout.readline()  # the child's handler is in place
print("PROGRESS 1", flush=True)
deadline = time.monotonic() + wait_s
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.5)  # room for a repeated request to arrive
child.terminate()
child.wait()
open(out, "w").write(str(len(got)))
"""


@pytest.fixture
def ctx(tmp_path) -> StageContext:
    return StageContext(dataset_dir=tmp_path / "dataset", output_dir=tmp_path / "output",
                        checkpoints_root=tmp_path / "checkpoints", log_dir=tmp_path / "logs",
                        job_id="job-1", language="en")


def stage(tmp_path, checkpoint_signal, wait_s: float) -> StageSpec:
    path = tmp_path / "stage.py"
    path.write_text(textwrap.dedent(STAGE), encoding="utf-8")
    return StageSpec(name="train", argv=("{python}", str(path), "{output_dir}/n", str(tmp_path / "child"),
                                         str(wait_s)),
                     outputs=("n",), checkpoint_signal=checkpoint_signal)


def forewarning(stop: StopSignal):
    """A progress callback that announces a shutdown once the stage is running."""
    return lambda _name, _pct: stop.forewarn()


def test_a_forewarned_stop_sends_the_checkpoint_signal_once_to_the_stage_alone(tmp_path, ctx):
    """A shutdown's notice reaches the stage's own process once, never its children, and is logged."""
    stop = StopSignal()
    # The 60 s is only a backstop for a signal that never comes: the stage ends as soon as it has one.
    run_stage(stage(tmp_path, signal.SIGUSR1, 60), ctx, stop, forewarning(stop))
    assert (ctx.output_dir / "n").read_text() == "1"
    assert not (tmp_path / "child").exists()
    log = next(ctx.log_dir.glob("*-train.log")).read_text()
    assert "asked to checkpoint (SIGUSR1)" in log


def test_a_stage_without_a_checkpoint_signal_is_not_signalled(tmp_path, ctx):
    """Only a stage that declared a checkpoint signal gets one."""
    stop = StopSignal()
    run_stage(stage(tmp_path, None, 1.0), ctx, stop, forewarning(stop))
    assert (ctx.output_dir / "n").read_text() == "0"


def test_no_checkpoint_signal_without_a_shutdown(tmp_path, ctx):
    """A stage that declared a checkpoint signal runs undisturbed while no shutdown is announced."""
    run_stage(stage(tmp_path, signal.SIGUSR1, 1.0), ctx, StopSignal(), lambda *_: None)
    assert (ctx.output_dir / "n").read_text() == "0"


def test_a_stage_started_after_the_notice_is_not_signalled(tmp_path, ctx):
    """A stage that starts once the shutdown was announced has nothing to checkpoint: no signal."""
    stop = StopSignal()
    stop.forewarn()
    run_stage(stage(tmp_path, signal.SIGUSR1, 1.0), ctx, stop, lambda *_: None)
    assert (ctx.output_dir / "n").read_text() == "0"


def test_a_stage_killed_by_its_checkpoint_signal_ends_as_a_shutdown_not_a_failure(tmp_path, ctx):
    """A trainer without the handler (yet) dies of the signal: the attempt is stopped for the shutdown,
    so it is released without spending a retry, not recorded as a failed stage."""
    from worker.core.errors import Stopped

    unhandled = StageSpec(name="train", argv=("{python}", "-c", "import time; print('PROGRESS 1', flush=True); "
                                              "time.sleep(60)"), outputs=("n",), checkpoint_signal=signal.SIGUSR1)
    stop = StopSignal()
    with pytest.raises(Stopped) as caught:
        run_stage(unhandled, ctx, stop, forewarning(stop))
    assert caught.value.reason == "shutdown" and "killed by its checkpoint signal" in str(caught.value)
