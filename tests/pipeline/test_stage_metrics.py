"""A stage's ``METRIC step=<n> <name>=<value> ...`` lines: parsed strictly and boundedly, handed to a
progress object that keeps metrics, and never a danger to the output reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.config import StageSpec
from pipeline.run import ReportedProgress
from pipeline.stages import METRIC_LINE_MAX_BYTES, METRIC_MAX_PAIRS, Metric, parse_metric, run_stage
from tests.pipeline.test_stages import ctx, script  # noqa: F401 - ctx is the fixture
from worker.core.stop import StopSignal


class Keeper:
    """A progress callback that keeps metrics, as the job's does, and counts its ticks."""

    def __init__(self):
        self.progress: list[tuple[str, float]] = []
        self.metrics: list[tuple[str, int, dict]] = []
        self.ticks = 0
        self.flushes = 0

    def __call__(self, stage: str, percent: float) -> None:
        self.progress.append((stage, percent))

    def metric(self, stage: str, step: int, values) -> None:
        self.metrics.append((stage, step, dict(values)))

    def tick(self) -> None:
        self.ticks += 1

    def flush(self) -> None:
        self.flushes += 1


@pytest.mark.parametrize(("line", "expected"), [
    (b"METRIC step=12 loss=0.25 lr=2e-4\n", Metric(12, {"loss": 0.25, "lr": 2e-4})),
    (b"  METRIC   step=0\tval_loss=-1.5E+2 loss.mel=.5  \r\n", Metric(0, {"val_loss": -150.0, "loss.mel": 0.5})),
    (b"METRIC step=3 loss=1 loss=2\n", Metric(3, {"loss": 2.0})),
    # Non-finite values are dropped, the rest kept; a line left with none is no metric.
    (b"METRIC step=4 loss=nan lr=0.1 grad=inf x=1e999\n", Metric(4, {"lr": 0.1})),
    (b"METRIC step=4 loss=NaN\n", None),
])
def test_a_metric_line_gives_its_step_and_finite_values(line, expected):
    """Names, decimal numbers (with exponents) and a repeated name's last value are read; NaN and infinities are not kept."""
    assert parse_metric(line) == expected


@pytest.mark.parametrize("line", [
    b"step 78/120 loss 0.138980\n",
    b"METRIC loss=1\n",                       # no step
    b"METRIC step=-1 loss=1\n",
    b"METRIC step=1.5 loss=1\n",
    b"METRIC step=1\n",                       # no value
    b"METRIC step=1 1loss=1\n",               # a name starts with a letter
    b"METRIC step=1 lo$s=1\n",
    b"METRIC step=1 " + b"n" * 49 + b"=1\n",  # names are at most 48 characters
    b"METRIC step=1 loss=1_000\n",            # float() would take these; the contract does not
    b"METRIC step=1 loss=0x10\n",
    b"METRIC step=1 loss=infinity\n",
    b"METRIC step=1 loss=1 trailing\n",
    b"METRIC step=1 loss==1\n",
    b"METRICS step=1 loss=1\n",
    b"say METRIC step=1 loss=1\n",
    b"METRIC step=1 loss=\xff\n",
    b"METRIC step=1 " + b" ".join(b"m%d=1" % i for i in range(METRIC_MAX_PAIRS + 1)) + b"\n",
    b"METRIC step=1 loss=1" + b" " * METRIC_LINE_MAX_BYTES + b"\n",
    b"METRIC step=1234567890123 loss=1\n",    # at most 12 digits
])
def test_a_malformed_metric_line_is_not_a_metric(line):
    """Anything but the documented format (bad names, numbers or counts, too long) is only a log line."""
    assert parse_metric(line) is None


def test_the_most_pairs_a_line_may_carry_are_read():
    """A line with METRIC_MAX_PAIRS pairs is whole."""
    line = b"METRIC step=9 " + b" ".join(b"m%d=%d" % (i, i) for i in range(METRIC_MAX_PAIRS)) + b"\n"
    assert parse_metric(line) == Metric(9, {f"m{i}": float(i) for i in range(METRIC_MAX_PAIRS)})


def test_metric_lines_reach_a_progress_object_that_keeps_metrics(tmp_path, ctx):  # noqa: F811
    """Each METRIC line is handed on with its stage, in order, through the pipeline's progress wrapper;
    the bad ones, a huge line and PROGRESS lines are not, and the stage still succeeds with its log whole."""
    body = (
        "import sys\n"
        "print('METRIC step=1 loss=2.5 lr=0.001', flush=True)\n"
        "print('PROGRESS 50', flush=True)\n"
        "print('METRIC step=2 loss=nonsense', flush=True)\n"
        "print('METRIC step=3 ' + 'x=1 ' * 100000, flush=True)\n"
        "sys.stdout.buffer.write(b'METRIC step=4 loss=\\xff\\n'); sys.stdout.flush()\n"
        "print('METRIC step=5 loss=1.25', flush=True)\n"
        "open(sys.argv[1], 'w').write('done')\n"
    )
    stage = StageSpec(name="m", argv=("{python}", script(tmp_path, "m", body), "{output_dir}/o"), outputs=("o",))
    keeper = Keeper()
    result = run_stage(stage, ctx, StopSignal(), ReportedProgress(keeper))
    assert keeper.metrics == [("m", 1, {"loss": 2.5, "lr": 0.001}), ("m", 5, {"loss": 1.25})]
    assert keeper.progress == [("m", 50.0)]
    assert keeper.ticks >= 1 and keeper.flushes == 1  # flushed once the stage exited
    assert b"METRIC step=2 loss=nonsense" in result.log_path.read_bytes()


def test_a_plain_progress_callback_is_not_bothered_by_metrics(tmp_path, ctx):  # noqa: F811
    """A stage's metrics need nothing of a callback that keeps none."""
    body = "import sys\nprint('METRIC step=1 loss=1', flush=True)\nopen(sys.argv[1], 'w').write('done')\n"
    stage = StageSpec(name="m", argv=("{python}", script(tmp_path, "m", body), "{output_dir}/o"), outputs=("o",))
    seen: list = []
    run_stage(stage, ctx, StopSignal(), lambda name, pct: seen.append((name, pct)))
    assert seen == []


def test_a_stage_may_declare_its_weight_and_it_changes_no_fingerprint():
    """``weight`` (default 1) is the stage's share of the job's time; it does not void the stage's manifests."""
    from pipeline.config import parse_pipeline_config
    from tests.pipeline.test_config import good_config

    plain = parse_pipeline_config(good_config())
    data = good_config()
    data["stages"][0]["weight"] = 6
    weighted = parse_pipeline_config(data)
    assert [s.weight for s in plain.stages] == [1.0, 1.0] and weighted.stages[0].weight == 6.0
    assert weighted.stages[0].fingerprint == plain.stages[0].fingerprint


@pytest.mark.parametrize("weight", [0, -1, True, "6", float("nan"), float("inf"), 1e6])
def test_a_weight_that_is_no_share_of_time_is_refused(weight):
    """A weight must be a number above 0 (and below a million): one problem line naming the stage."""
    from tests.pipeline.test_config import good_config, problems_of

    data = good_config()
    data["stages"][1]["weight"] = weight
    assert problems_of(data) == ["cfg: stage 'light': weight must be a number above 0 "
                                 "(a share of the job's time; default 1)"]


def documented_pattern() -> re.Pattern:
    text = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    [pattern] = [line for line in text.splitlines() if line.startswith("^\\s*METRIC")]
    return re.compile(pattern)


def test_the_documented_regex_reads_what_the_worker_reads():
    """docs/trainer.md's regex matches each line the worker reads as a metric and none it refuses for its shape."""
    pattern = documented_pattern()
    good = [b"METRIC step=12 loss=0.25 lr=2e-4", b"  METRIC   step=0\tval_loss=-1.5E+2 loss.mel=.5  ",
            b"METRIC step=4 loss=nan lr=0.1 grad=inf x=1e999", b"METRIC step=4 loss=NaN"]
    bad = [b"step 78/120 loss 0.138980", b"METRIC loss=1", b"METRIC step=-1 loss=1", b"METRIC step=1",
           b"METRIC step=1 1loss=1", b"METRIC step=1 " + b"n" * 49 + b"=1", b"METRIC step=1 loss=1_000",
           b"METRIC step=1 loss=0x10", b"METRIC step=1 loss=infinity", b"METRIC step=1 loss=1 trailing",
           b"METRICS step=1 loss=1", b"say METRIC step=1 loss=1", b"METRIC step=1234567890123 loss=1",
           b"METRIC step=1 " + b" ".join(b"m%d=1" % i for i in range(METRIC_MAX_PAIRS + 1))]
    for line in good:
        assert pattern.fullmatch(line.decode()), line
    assert [line for line in bad if pattern.fullmatch(line.decode())] == []
    assert [line for line in bad if parse_metric(line + b"\n") is not None] == []
