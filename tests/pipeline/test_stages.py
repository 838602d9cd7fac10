"""The stage runner: argv handling, logs, exit codes, stop/timeout, manifests and re-runs."""

from __future__ import annotations

import errno
import json
import textwrap
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pipeline.config import StageSpec
from pipeline.errors import StageFailed, StageFailedPermanently
from pipeline.manifest import manifest_path
from pipeline.stages import (
    StageContext,
    exit_error,
    log_file_name,
    parse_progress,
    run_stage,
)
from worker.core.errors import Stopped, TimeLimitExceeded
from worker.core.stop import StopSignal
from worker.voice.records.errors import StaleWrite

# Records what it saw at start (outputs, checkpoints), then succeeds or fails as told.
WRITER = """
import os, sys
out, ckpt, runs, mode = sys.argv[1:5]
seen = {"output": os.path.exists(os.path.join(out, "a.bin")),
        "checkpoint": os.path.exists(os.path.join(ckpt, "state"))}
with open(runs, "a") as f:
    f.write(repr(seen) + "\\n")
os.makedirs(out, exist_ok=True)
open(os.path.join(ckpt, "state"), "w").write("step")
if mode == "partial":
    open(os.path.join(out, "a.bin"), "wb").write(b"half")
    sys.exit(1)
open(os.path.join(out, "a.bin"), "wb").write(b"A" * 10)
if mode != "missing":
    open(os.path.join(out, "b.bin"), "wb").write(b"B" * 10)
"""

# Spawns a grandchild, publishes both pids, then waits to be stopped.
SLEEPER = """
import os, signal, subprocess, sys, time
pidfile, how = sys.argv[1], sys.argv[2]
if how == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild too
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(pidfile + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(pidfile + ".tmp", pidfile)
print("PROGRESS 1", flush=True)
time.sleep(60)
"""


@pytest.fixture
def ctx(tmp_path) -> StageContext:
    return StageContext(
        dataset_dir=tmp_path / "dataset",
        output_dir=tmp_path / "output",
        checkpoints_root=tmp_path / "checkpoints",
        log_dir=tmp_path / "logs",
        job_id="job-1",
        language="en",
    )


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


def writer_stage(tmp_path, mode="ok", resumable=False) -> StageSpec:
    return StageSpec(
        name="write",
        argv=("{python}", script(tmp_path, "writer", WRITER), "{output_dir}/w", "{checkpoint_dir}",
              str(tmp_path / "runs.txt"), mode),
        outputs=("w/a.bin", "w/b.bin"),
        resumable=resumable,
    )


def runs(tmp_path) -> list[dict]:
    path = tmp_path / "runs.txt"
    if not path.exists():
        return []
    return [eval(line) for line in path.read_text().splitlines()]  # noqa: S307 - our own repr


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def no_progress(stage, percent):
    pass


def test_argv_elements_reach_the_command_literally(tmp_path, ctx):
    """Spaces and shell metacharacters in an argv element arrive as that one literal argument."""
    nasty = "; rm -rf x $(id) | & `id` > out"
    echo = script(tmp_path, "echo", "import json, sys\nopen(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))\n")
    stage = StageSpec(
        name="echo",
        argv=("{python}", echo, "{output_dir}/argv.json", nasty, "two words", "{job_id}", "{{x}}"),
        outputs=("argv.json",),
    )
    run_stage(stage, ctx, StopSignal(), no_progress)
    assert json.loads((ctx.output_dir / "argv.json").read_text()) == [nasty, "two words", "job-1", "{x}"]
    assert not (tmp_path / "x").exists() and not (ctx.output_dir / "out").exists()


def test_progress_lines_are_reported_and_others_ignored(tmp_path, ctx):
    """PROGRESS n lines in range reach the callback; malformed and out-of-range ones do not."""
    # The pause lets the runner report 10 before 55.5 arrives (bursts are coalesced to the latest).
    body = (
        "import sys, time\n"
        "for line in ['PROGRESS 10', 'progress 20', 'PROGRESS 150', 'noise PROGRESS 30']:\n"
        "    print(line, flush=True)\n"
        "time.sleep(0.3)\n"
        "print('PROGRESS 55.5', flush=True)\n"
        "open(sys.argv[1], 'w').write('done')\n"
    )
    stage = StageSpec(name="p", argv=("{python}", script(tmp_path, "p", body), "{output_dir}/o"), outputs=("o",))
    seen = []
    run_stage(stage, ctx, StopSignal(), lambda name, pct: seen.append((name, pct)))
    assert seen == [("p", 10.0), ("p", 55.5)]


def test_nonzero_exit_keeps_the_log_and_raises_with_its_tail(tmp_path, ctx):
    """A failing stage's whole output is in its log and the error carries the last lines."""
    body = "import sys\nfor i in range(40):\n    print(f'line {i}')\nprint('boom', file=sys.stderr)\nsys.exit(3)\n"
    stage = StageSpec(name="fails", argv=("{python}", script(tmp_path, "f", body)), outputs=("x",),
                      permanent_exit_codes=frozenset({65}))
    with pytest.raises(StageFailed) as caught:
        run_stage(stage, ctx, StopSignal(), no_progress)
    assert not isinstance(caught.value, StageFailedPermanently)
    message = str(caught.value)
    assert "exited with code 3" in message and "boom" in message and "line 39" in message
    assert "line 10\n" not in message
    [log] = list(ctx.log_dir.glob("*-fails.log"))
    text = log.read_text()
    assert all(f"line {i}\n" in text for i in range(40)) and "boom" in text
    assert not manifest_path(ctx.output_dir, "fails").exists()


def test_failed_stage_message_is_redacted_before_it_leaves_the_runner(tmp_path, ctx):
    """Credentials a failing stage prints (URI userinfo, key ids, secret assignments, signed queries) stay out of its error."""
    body = ("import sys\n"
            "print('connect mongodb+srv://voice:hunter2@cluster0.example.net/voice failed')\n"
            "print('using AKIAIOSFODNN7EXAMPLE aws_secret_access_key=wJalrXUtnFEMIK7MDENG')\n"
            "print('GET https://b.example/a.wav?X-Amz-Signature=sig123 503')\n"
            "sys.exit(1)\n")
    stage = StageSpec(name="leaky", argv=("{python}", script(tmp_path, "leaky", body)), outputs=("x",))
    with pytest.raises(StageFailed) as caught:
        run_stage(stage, ctx, StopSignal(), no_progress)
    message = str(caught.value)
    assert not any(s in message for s in ("hunter2", "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMIK7MDENG", "sig123"))
    assert "cluster0.example.net/voice" in message and "https://b.example/a.wav 503" in message


def test_declared_permanent_exit_code_is_permanent(tmp_path, ctx):
    """An exit code listed in permanent_exit_codes raises StageFailedPermanently."""
    stage = StageSpec(name="bad_data", argv=("{python}", "-c", "import sys; sys.exit(65)"), outputs=("x",),
                      permanent_exit_codes=frozenset({65}))
    with pytest.raises(StageFailedPermanently, match="exited with code 65"):
        run_stage(stage, ctx, StopSignal(), no_progress)


def test_exit_error_classifies_codes():
    """Only declared codes are permanent; signals and other codes stay retryable."""
    stage = StageSpec(name="s", argv=("x",), outputs=("o",), permanent_exit_codes=frozenset({65, 70}))
    assert isinstance(exit_error(stage, 70, "l.log", ""), StageFailedPermanently)
    assert type(exit_error(stage, 1, "l.log", "")) is StageFailed
    assert "signal 9" in str(exit_error(stage, -9, "l.log", ""))


@pytest.mark.parametrize("how", ["normal", "ignore-term"])
def test_stop_ends_the_whole_process_group_within_the_grace(tmp_path, ctx, how):
    """On stop the stage and its grandchild are gone: by SIGTERM, or by SIGKILL once the grace ends."""
    pidfile = tmp_path / "pids"
    grace_s = 0.6
    stage = StageSpec(name="sleepy", argv=("{python}", script(tmp_path, "s", SLEEPER), str(pidfile), how),
                      outputs=("never",))
    stop = StopSignal()
    stopped_at = []

    def on_progress(name, pct):
        stopped_at.append(time.monotonic())
        stop.set("cancelled", "user asked")

    with pytest.raises(Stopped) as caught:
        run_stage(stage, ctx, stop, on_progress, grace_s=grace_s)
    elapsed_s = time.monotonic() - stopped_at[0]
    assert caught.value.reason == "cancelled"
    pids = [int(p) for p in pidfile.read_text().split()]
    assert not any(process_alive(pid) for pid in pids)
    if how == "ignore-term":
        assert grace_s <= elapsed_s < grace_s + 2.0
    else:
        assert elapsed_s < grace_s
    assert "stopped: cancelled" in next(ctx.log_dir.glob("*-sleepy.log")).read_text()


def test_stage_timeout_raises_time_limit_exceeded(tmp_path, ctx):
    """A stage running past its timeout_seconds is ended and reported as TimeLimitExceeded."""
    stage = StageSpec(name="slow", argv=("{python}", "-c", "import time; time.sleep(30)"), outputs=("x",),
                      timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded, match="timeout of 0.3 s"):
        run_stage(stage, ctx, StopSignal(), no_progress, grace_s=1.0)
    assert time.monotonic() - started < 3.0


def test_progress_error_stops_the_stage_and_propagates(tmp_path, ctx):
    """When the progress callback raises StaleWrite, the stage's processes end and the error surfaces."""
    pidfile = tmp_path / "pids"
    stage = StageSpec(name="stale", argv=("{python}", script(tmp_path, "s", SLEEPER), str(pidfile), "normal"),
                      outputs=("never",))

    def stale(name, pct):
        raise StaleWrite("job record is not ours")

    with pytest.raises(StaleWrite):
        run_stage(stage, ctx, StopSignal(), stale, grace_s=1.0)
    assert not any(process_alive(int(p)) for p in pidfile.read_text().split())


def test_stop_signal_from_another_thread_interrupts_a_silent_stage(tmp_path, ctx):
    """A stop set elsewhere while the stage prints nothing is still noticed promptly."""
    stage = StageSpec(name="quiet", argv=("{python}", "-c", "import time; time.sleep(30)"), outputs=("x",))
    stop = StopSignal()
    threading.Timer(0.3, stop.set, args=("lease_lost",)).start()
    started = time.monotonic()
    with pytest.raises(Stopped) as caught:
        run_stage(stage, ctx, stop, no_progress, grace_s=1.0)
    assert caught.value.reason == "lease_lost" and time.monotonic() - started < 2.0


# Far beyond any stage here: a runner that noticed the end only on its next poll would meet this stop.
_BACKSTOP_S = 30.0


def test_the_runner_returns_when_the_stage_exits_not_at_its_next_poll(tmp_path, ctx):
    """A stage that exits at once completes although the runner's poll interval is an hour."""
    stop = StopSignal()
    backstop = threading.Timer(_BACKSTOP_S, stop.set, args=("shutdown", "the runner missed the exit"))
    backstop.start()
    try:
        result = run_stage(writer_stage(tmp_path), ctx, stop, no_progress, poll_interval_s=3600.0)
    finally:
        backstop.cancel()
    assert not result.skipped and not stop.is_set()


def test_without_pidfds_the_runner_still_sees_the_stages_end_and_a_stop(tmp_path, ctx, monkeypatch):
    """Where the kernel offers no pidfd, a stage still completes and a stop still ends a silent one."""
    def no_pidfd(pid):
        raise OSError(errno.ENOSYS, "pidfd_open not implemented")

    monkeypatch.setattr("pipeline.stages.os.pidfd_open", no_pidfd)
    assert not run_stage(writer_stage(tmp_path), ctx, StopSignal(), no_progress, poll_interval_s=0.05).skipped
    quiet = StageSpec(name="quiet", argv=("{python}", "-c", "import time; time.sleep(30)"), outputs=("x",))
    stop = StopSignal()
    threading.Timer(0.3, stop.set, args=("lease_lost",)).start()
    with pytest.raises(Stopped) as caught:
        run_stage(quiet, ctx, stop, no_progress, grace_s=1.0)
    assert caught.value.reason == "lease_lost"


def test_verified_manifest_skips_the_stage(tmp_path, ctx):
    """A second attempt after success does not run the command again."""
    first = run_stage(writer_stage(tmp_path), ctx, StopSignal(), no_progress)
    second = run_stage(writer_stage(tmp_path), ctx, StopSignal(), no_progress)
    assert not first.skipped and second.skipped
    assert len(runs(tmp_path)) == 1


@pytest.mark.parametrize(
    "damage",
    [
        lambda ctx: manifest_path(ctx.output_dir, "write").write_text("{not json"),
        lambda ctx: (ctx.output_dir / "w/b.bin").write_bytes(b"C" * 10),
        lambda ctx: (ctx.output_dir / "w/a.bin").unlink(),
    ],
    ids=["corrupted-manifest", "modified-output", "deleted-output"],
)
def test_unverifiable_manifest_makes_the_stage_run_again(tmp_path, ctx, damage):
    """A corrupted manifest or a changed output is not trusted: the stage re-runs from clean outputs."""
    run_stage(writer_stage(tmp_path), ctx, StopSignal(), no_progress)
    damage(ctx)
    result = run_stage(writer_stage(tmp_path), ctx, StopSignal(), no_progress)
    assert not result.skipped
    assert [r["output"] for r in runs(tmp_path)] == [False, False]
    assert (ctx.output_dir / "w/b.bin").read_bytes() == b"B" * 10


@pytest.mark.parametrize("resumable", [False, True])
def test_partial_outputs_are_removed_and_only_resumable_stages_keep_checkpoints(tmp_path, ctx, resumable):
    """A crashed attempt's outputs never survive; its checkpoint dir survives only when resumable."""
    with pytest.raises(StageFailed):
        run_stage(writer_stage(tmp_path, "partial", resumable), ctx, StopSignal(), no_progress)
    assert not (ctx.output_dir / "w/a.bin").exists()  # the failed run's part is gone at once
    (ctx.output_dir / "w/a.bin").write_bytes(b"half")  # as a worker killed mid-stage leaves it
    run_stage(writer_stage(tmp_path, "ok", resumable), ctx, StopSignal(), no_progress)
    second = runs(tmp_path)[1]
    assert second["output"] is False
    assert second["checkpoint"] is resumable
    assert len(list(ctx.log_dir.glob("*-write.log"))) == 2  # logs are kept across attempts


def test_exit_zero_without_declared_outputs_fails_without_manifest(tmp_path, ctx):
    """A stage that 'succeeds' but leaves an output missing is a failure and gets no manifest."""
    with pytest.raises(StageFailed, match="w/b.bin"):
        run_stage(writer_stage(tmp_path, "missing"), ctx, StopSignal(), no_progress)
    assert not manifest_path(ctx.output_dir, "write").exists()


# Makes output/full a link to a directory outside the job (holding the declared file), or links the
# declared file itself, or (mode "ok") writes it for real; exits 0 every time.
LINKER = """
import os, sys
out, outside, mode = sys.argv[1:4]
os.makedirs(out, exist_ok=True)
if mode == "link-dir":
    os.symlink(outside, os.path.join(out, "full"))
elif mode == "link-file":
    os.makedirs(os.path.join(out, "full"), exist_ok=True)
    os.symlink(os.path.join(outside, "model.pth"), os.path.join(out, "full", "model.pth"))
else:
    os.makedirs(os.path.join(out, "full"), exist_ok=True)
    open(os.path.join(out, "full", "model.pth"), "wb").write(b"trained")
"""


def linker_stage(tmp_path, outside, mode) -> StageSpec:
    return StageSpec(name="link", argv=("{python}", script(tmp_path, "linker", LINKER), "{output_dir}",
                                        str(outside), mode), outputs=("full/model.pth",))


@pytest.fixture
def outside(tmp_path_factory) -> Path:
    """A directory outside the job's work root holding a file named like the declared output."""
    directory = tmp_path_factory.mktemp("outside-the-work-root")
    (directory / "model.pth").write_bytes(b"not the job's")
    return directory


def test_an_output_reached_through_a_linked_directory_fails_and_the_rerun_spares_the_target(
        tmp_path, ctx, outside):
    """output/full -> a directory outside: the stage fails (retryable, no manifest); the rerun removes the
    link itself, never the files it points to."""
    with pytest.raises(StageFailed, match=r"full/model.pth \(reached through a symbolic link \(full\)\)") as info:
        run_stage(linker_stage(tmp_path, outside, "link-dir"), ctx, StopSignal(), no_progress)
    assert info.value.retryable
    assert not manifest_path(ctx.output_dir, "link").exists()
    run_stage(linker_stage(tmp_path, outside, "ok"), ctx, StopSignal(), no_progress)
    assert (outside / "model.pth").read_bytes() == b"not the job's"
    assert not (ctx.output_dir / "full").is_symlink()
    assert (ctx.output_dir / "full/model.pth").read_bytes() == b"trained"


def test_a_declared_output_that_is_itself_a_link_fails_the_stage(tmp_path, ctx, outside):
    """A symlinked final component is refused like any link; the rerun removes the link, not its target."""
    with pytest.raises(StageFailed, match="a symbolic link"):
        run_stage(linker_stage(tmp_path, outside, "link-file"), ctx, StopSignal(), no_progress)
    run_stage(linker_stage(tmp_path, outside, "ok"), ctx, StopSignal(), no_progress)
    assert (outside / "model.pth").read_bytes() == b"not the job's"


def test_missing_program_is_a_retryable_stage_failure(tmp_path, ctx):
    """A command that cannot start raises StageFailed instead of a raw OSError."""
    stage = StageSpec(name="ghost", argv=(str(tmp_path / "no-such-program"),), outputs=("x",))
    with pytest.raises(StageFailed, match="could not start"):
        run_stage(stage, ctx, StopSignal(), no_progress)


def test_parse_progress_and_log_names():
    """PROGRESS parsing accepts 0..100 only; log names are UTC-timestamped per step."""
    assert parse_progress(b"PROGRESS 42\n") == 42.0
    assert parse_progress(b"PROGRESS 100\r\n") == 100.0
    assert parse_progress(b"PROGRESS 101\n") is None
    assert parse_progress(b"PROGRESS -1\n") is None
    assert parse_progress(b"PROGRESS\n") is None
    now = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    assert log_file_name(now, "train_full") == "20240506T070809.123456Z-train_full.log"


def test_a_failed_stages_message_carries_no_terminal_control_sequences(tmp_path, ctx):
    """Screen clears, retitles, C1 controls and CR-forged lines a stage prints never reach its error message."""
    body = ("import sys\n"
            "sys.stderr.write('\\x1b[2J\\x1b]0;owned\\x07real failure\\rjob 1: completed\\n')\n"
            "sys.stderr.write('\\u009b31mred\\u0085\\n')\n"
            "sys.exit(1)\n")
    stage = StageSpec(name="noisy", argv=("{python}", script(tmp_path, "noisy", body)), outputs=("x",))
    with pytest.raises(StageFailed) as caught:
        run_stage(stage, ctx, StopSignal(), no_progress)
    message = str(caught.value)
    assert not any(ch in message for ch in "\x1b\x07\r\x9b\x85"), repr(message)
    assert "real failure\njob 1: completed\nred" in message


# Replaces checkpoints/ (or checkpoints/<next>) with a link to a directory outside the job, then
# writes its own declared output; exits 0.
CHECKPOINT_LINKER = """
import os, shutil, sys
root, which, outside, out = sys.argv[1:5]
victim = root if which == "root" else os.path.join(root, "next")
if os.path.isdir(victim):
    shutil.rmtree(victim)
os.symlink(outside, victim)
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "linked.txt"), "w").write("done")
"""

# Writes a file into {checkpoint_dir} and its declared output.
CHECKPOINT_WRITER = """
import os, sys
ckpt, out = sys.argv[1:3]
open(os.path.join(ckpt, "state"), "w").write("mine")
open(os.path.join(out, "next.txt"), "w").write("done")
"""


@pytest.fixture
def outside_checkpoints(tmp_path_factory) -> Path:
    """A directory outside the job laid out like checkpoints/, its next/ holding a file."""
    directory = tmp_path_factory.mktemp("outside-checkpoints")
    (directory / "next").mkdir()
    (directory / "next" / "state").write_bytes(b"not the job's")
    return directory


@pytest.mark.parametrize("resumable", [False, True])
@pytest.mark.parametrize("which", ["root", "stage"])
def test_a_linked_checkpoint_dir_is_replaced_never_followed(tmp_path, ctx, outside_checkpoints, which, resumable):
    """After a stage links checkpoints/ (or checkpoints/<next>) out of the job, the next stage's preparation
    removes the link itself: the outside files stay and the stage gets a real directory inside the job."""
    linker = StageSpec(name="linker", argv=("{python}", script(tmp_path, "ckpt_linker", CHECKPOINT_LINKER),
                                            str(ctx.checkpoints_root), which, str(outside_checkpoints),
                                            "{output_dir}"), outputs=("linked.txt",))
    following = StageSpec(name="next", argv=("{python}", script(tmp_path, "ckpt_writer", CHECKPOINT_WRITER),
                                             "{checkpoint_dir}", "{output_dir}"), outputs=("next.txt",),
                          resumable=resumable)
    run_stage(linker, ctx, StopSignal(), no_progress)
    run_stage(following, ctx, StopSignal(), no_progress)
    assert (outside_checkpoints / "next" / "state").read_bytes() == b"not the job's"
    assert sorted(p.name for p in outside_checkpoints.iterdir()) == ["next"]
    for directory in (ctx.checkpoints_root, ctx.checkpoint_dir(following)):
        assert not directory.is_symlink() and directory.is_dir()
    assert (ctx.checkpoint_dir(following) / "state").read_text() == "mine"


def test_a_linked_output_dir_is_replaced_before_the_next_stage(tmp_path, ctx, outside):
    """A stage that makes output/ itself a link: the next stage writes into a real output directory, and
    the outside files are left as they were."""
    relink = StageSpec(name="relink", argv=("{python}", "-c", "import os, shutil, sys; shutil.rmtree(sys.argv[1]); "
                                            "os.symlink(sys.argv[2], sys.argv[1])", "{output_dir}", str(outside)),
                       outputs=("r.txt",))
    with pytest.raises(StageFailed, match="symbolic link"):
        run_stage(relink, ctx, StopSignal(), no_progress)
    run_stage(linker_stage(tmp_path, outside, "ok"), ctx, StopSignal(), no_progress)
    assert not ctx.output_dir.is_symlink()
    assert (ctx.output_dir / "full/model.pth").read_bytes() == b"trained"
    assert sorted(p.name for p in outside.iterdir()) == ["model.pth"]
    assert (outside / "model.pth").read_bytes() == b"not the job's"


def test_a_manifest_dir_made_a_link_by_the_stage_is_not_written_through(tmp_path, ctx, outside):
    """A stage that links output/.manifests out of the job: its manifest lands in a real directory, and
    nothing is written outside."""
    stage = StageSpec(name="forger", argv=("{python}", "-c", "import os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
                                           "open(os.path.join(sys.argv[1], 'f.txt'), 'w').write('x'); "
                                           "os.symlink(sys.argv[2], os.path.join(sys.argv[1], '.manifests'))",
                                           "{output_dir}", str(outside)), outputs=("f.txt",))
    run_stage(stage, ctx, StopSignal(), no_progress)
    assert sorted(p.name for p in outside.iterdir()) == ["model.pth"]
    assert not manifest_path(ctx.output_dir, "forger").parent.is_symlink()
    assert run_stage(stage, ctx, StopSignal(), no_progress).skipped


def test_a_log_dir_made_a_link_by_a_stage_is_replaced_never_written_through(tmp_path):
    """A stage that turns {log_dir} into a link out of the job gets no log written there: the next log
    goes into a real directory inside the job and the outside directory stays empty."""
    from pipeline.stages import open_step_log

    outside = tmp_path / "outside"
    outside.mkdir()
    job = tmp_path / "job"
    job.mkdir()
    (job / "logs").symlink_to(outside)
    path, handle = open_step_log(job / "logs", "train")
    with handle:
        handle.write(b"line\n")
    assert list(outside.iterdir()) == []
    assert not (job / "logs").is_symlink() and path.parent == job / "logs" and path.read_bytes() == b"line\n"
