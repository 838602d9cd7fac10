"""How far a job has got, on its record: the bounded metric series, stage k of n, overall percent, ETA,
the latest metrics and the device, written by the progress reporter in its fenced progress writes."""

from __future__ import annotations

import io
import json
import math
import random
from datetime import timedelta

import pytest
import structlog

from pipeline.config import StageSpec
from tests.voice.records.conftest import JOB_ID, PROFILE_ID, WallClock, claim, make_store, submit
from worker.core.errors import LeaseLost
from worker.core.metrics import Metrics
from worker.core.stop import StopSignal
from worker.core.testing import FakeClock
from worker.voice.records.attempt import Attempt, ProgressReporter
from worker.voice.records.training import (
    SERIES_MAX_NAMES,
    SERIES_MAX_POINTS,
    PlannedStage,
    add_point,
    eta_s,
    overall_percent,
    plan_of,
    read_series,
    thin,
)

PLAN = (PlannedStage("download", 0.0, trainer=False), PlannedStage("dataset", 0.0, trainer=False),
        PlannedStage("embed", 1.0, device="cuda"), PlannedStage("train_full", 6.0, device="cuda"),
        PlannedStage("train_light", 1.0))


# ---------------------------------------------------------------- the series

def test_a_series_keeps_at_most_its_bound_however_long_the_run():
    """100,000 steps leave at most 200 points, the first and the latest among them, spread evenly over the steps."""
    points: list[list] = []
    longest = 0
    for step in range(100_000):
        add_point(points, step, 1.0 / (step + 1))
        longest = max(longest, len(points))
    assert longest <= SERIES_MAX_POINTS
    assert len(points) >= SERIES_MAX_POINTS // 2
    assert points[0] == [0, 1.0] and points[-1] == [99_999, 1.0 / 100_000]
    steps = [p[0] for p in points]
    assert steps == sorted(set(steps))
    gaps = [b - a for a, b in zip(steps[1:-2], steps[2:-1], strict=True)]
    assert max(gaps) <= 2 * min(gaps)  # evenly spread: no stretch of the run is left bare


def test_a_series_with_sparse_or_irregular_steps_stays_bounded():
    """Steps that jump by odd amounts (a trainer printing every 7th step, then every 1000th) keep the bound too."""
    points: list[list] = []
    rng = random.Random(5)
    step = 0
    for _ in range(20_000):
        step += rng.choice((1, 7, 1000))
        add_point(points, step, float(step))
        assert len(points) <= SERIES_MAX_POINTS
    assert points[0][0] in (1, 7, 1000)  # the first step printed
    assert points[-1] == [step, float(step)]


def test_a_step_again_or_back_drops_what_came_after_it():
    """A stage resumed from an earlier checkpoint rewrites its curve from there on."""
    points: list[list] = []
    for step in range(10):
        add_point(points, step, float(step))
    add_point(points, 6, -1.0)
    assert points == [[s, float(s)] for s in range(6)] + [[6, -1.0]]
    add_point(points, 0, 5.0)
    assert points == [[0, 5.0]]


def test_a_stored_series_is_read_tolerantly_and_thinned():
    """What another writer stored is read point by point: bad points, names and stages are left out, the rest sorted and bounded."""
    long = [[s, 1.0] for s in range(1000)]
    stored = {
        "train_full": {"loss": [[3, 0.3], [1, 0.1], ["x", 1], [2, float("nan")], [4, True], [2, 0.2], [5]],
                       "1bad": [[1, 1.0]], "lr": "many", "val_loss": long},
        "embed": "nothing",
        7: {"loss": [[1, 1.0]]},
    }
    read = read_series(stored)
    assert read["train_full"]["loss"] == [[1, 0.1], [2, 0.2], [3, 0.3]]
    assert set(read["train_full"]) == {"loss", "val_loss"}
    assert len(read["train_full"]["val_loss"]) <= SERIES_MAX_POINTS
    assert read["train_full"]["val_loss"][-1] == [999, 1.0]
    assert set(read) == {"train_full"}
    assert read_series(None) == {} and read_series([1, 2]) == {}


def test_thinning_keeps_the_first_and_the_latest():
    """Whatever the spacing, thinning never drops the ends."""
    points = [[0, 0.0], *([s, 1.0] for s in range(1000, 1300)), [10**9, 2.0]]
    kept = thin(points, 10)
    assert kept[0] == [0, 0.0] and kept[-1] == [10**9, 2.0] and len(kept) <= 10


# ---------------------------------------------------------------- overall percent and ETA

def test_overall_percent_weighs_each_stage():
    """The worker's own steps weigh nothing; each stage counts by its weight, the current one by its percent."""
    assert overall_percent(PLAN, 0, 50.0) == 0.0
    assert overall_percent(PLAN, 2, 100.0) == 12.5
    assert overall_percent(PLAN, 3, 50.0) == 50.0
    assert overall_percent(PLAN, 4, 100.0) == 100.0
    assert overall_percent((PlannedStage("download", 0.0, trainer=False),), 0, 50.0) is None


def test_eta_extends_the_current_rate_to_later_stages_by_weight():
    """At 1 %/s with half of a weight-6 stage done, its 50 s remain, plus 100 s / 6 for the weight-1 stage after it."""
    assert eta_s(PLAN, 3, 50.0, 1.0) == pytest.approx(50.0 + 100.0 / 6, abs=0.1)
    assert eta_s(PLAN, 4, 50.0, 2.0) == 25.0
    assert eta_s(PLAN, 3, 50.0, None) is None and eta_s(PLAN, 3, 50.0, 0.0) is None
    assert eta_s(PLAN, 0, 50.0, 1.0) is None  # a step that weighs nothing says nothing of the stages after it


def test_the_plan_puts_the_own_steps_first_with_the_configured_weights():
    """plan_of: the worker's own steps weigh nothing and run on no device; each stage keeps its weight and device."""
    stages = (StageSpec("embed", ("x",), ("a",), device="cuda"), StageSpec("train_full", ("x",), ("b",), weight=6.0))
    assert plan_of(stages, ("download", "dataset")) == (
        PlannedStage("download", 0.0, trainer=False), PlannedStage("dataset", 0.0, trainer=False),
        PlannedStage("embed", 1.0, device="cuda"), PlannedStage("train_full", 6.0))


# ---------------------------------------------------------------- the reporter, on each store

@pytest.fixture(params=["sqlite", "mongomock"])
def claimed(request, tmp_path):
    """A store of either kind holding one job claimed with token "t", and the store's clock."""
    clock = WallClock()
    store = make_store(request.param, tmp_path, clock)
    submit(store)
    claim(store, "t")
    yield store, clock
    store.close()


def reporter_for(store, ticks, **kwargs) -> ProgressReporter:
    return ProgressReporter(Attempt(store, JOB_ID, PROFILE_ID, "t", 60.0), StopSignal(), clock=ticks,
                            own_steps=("download", "dataset"), plan=PLAN, **kwargs)


def test_progress_says_stage_k_of_n_overall_percent_eta_step_and_latest(claimed):
    """A trainer stage's write carries its place in the plan, the overall percent, an ETA from the rate
    since its first report above 0, its step, the latest metrics and when it started on the store's clock."""
    store, clock = claimed
    ticks = FakeClock(start_s=100.0)
    reporter = reporter_for(store, ticks)
    reporter("train_full", 0.0)
    ticks.now, clock.now = 110.0, clock.now + timedelta(seconds=10)
    reporter("train_full", 40.0)  # a resumed stage's jump: no rate yet
    reporter.metric("train_full", 780, {"loss": 0.139, "lr": 2e-4})
    ticks.now, clock.now = 120.0, clock.now + timedelta(seconds=10)
    reporter("train_full", 50.0)  # 10 % in 10 s since the anchor
    progress = store.get_job(JOB_ID)["progress"]
    assert {k: progress[k] for k in ("stage", "percent", "step", "stageIndex", "stageCount", "latest")} == {
        "stage": "train_full", "percent": 50.0, "step": 780, "stageIndex": 4, "stageCount": 5,
        "latest": {"loss": 0.139, "lr": 2e-4}}
    assert progress["overallPercent"] == 50.0
    assert progress["etaS"] == pytest.approx(50.0 + 100.0 / 6, abs=0.1)
    assert progress["stageStartedAt"] == clock.now - timedelta(seconds=20)
    assert progress["updatedAt"] == clock.now
    assert store.get_job(JOB_ID)["history"][-1]["device"] == "cuda"


def test_metric_series_are_written_with_progress_and_stay_bounded(claimed):
    """100,000 METRIC lines leave at most 200 points per name on the record, first and latest kept,
    each stage under its own name, in writes no more frequent than the progress interval."""
    store, _ = claimed
    ticks = FakeClock(start_s=0.0)
    writes: list = []
    real = store.set_progress
    store.set_progress = lambda *a, **k: writes.append(a) or real(*a, **k)
    reporter = reporter_for(store, ticks)
    reporter("embed", 0.0)
    reporter.metric("embed", 1, {"loss": 9.0})
    reporter("embed", 100.0)
    reporter("train_full", 0.0)
    for step in range(1, 100_001):
        ticks.now = step * 0.01  # 1000 s in all
        reporter.metric("train_full", step, {"loss": 1.0 / step, "step_time_s": 0.01})
        if step % 100 == 0:
            reporter("train_full", step / 1000)
        reporter.tick()
    metrics = store.get_job(JOB_ID)["metrics"]
    loss = metrics["train_full"]["loss"]
    assert len(loss) <= SERIES_MAX_POINTS and len(metrics["train_full"]["step_time_s"]) <= SERIES_MAX_POINTS
    assert loss[0] == [1, 1.0]
    assert loss[-1][0] >= 99_800  # the latest write's: the interval holds back at most 2 s of steps
    assert metrics["embed"] == {"loss": [[1, 9.0]]}
    assert len(writes) <= 1000 / 2 + 5


def test_a_retry_continues_the_recorded_curve_from_its_resumed_step(claimed):
    """The series an earlier attempt recorded is the start of the next one's; a resumed stage rewrites from its step on."""
    store, _ = claimed
    ticks = FakeClock(start_s=0.0)
    first = reporter_for(store, ticks)
    first("train_full", 0.0)
    for step in range(1, 11):
        first.metric("train_full", step, {"loss": float(step)})
    first("train_full", 100.0)
    store.release_lease(JOB_ID, "t")
    claim(store, "u")
    second = ProgressReporter(Attempt(store, JOB_ID, PROFILE_ID, "u", 60.0), StopSignal(), clock=ticks, plan=PLAN,
                              earlier=store.get_job(JOB_ID)["metrics"])
    second("train_full", 0.0)
    second.metric("train_full", 8, {"loss": -8.0})
    second("train_full", 100.0)
    assert store.get_job(JOB_ID)["metrics"]["train_full"]["loss"] == [
        *([s, float(s)] for s in range(1, 8)), [8, -8.0]]


def test_a_trainer_that_prints_ever_new_names_is_capped(claimed):
    """At most SERIES_MAX_NAMES names are kept per stage."""
    store, _ = claimed
    reporter = reporter_for(store, FakeClock(start_s=0.0))
    reporter("train_full", 0.0)
    for n in range(SERIES_MAX_NAMES + 20):
        reporter.metric("train_full", n, {f"m{n}": 1.0})
    reporter("train_full", 100.0)
    assert len(store.get_job(JOB_ID)["metrics"]["train_full"]) == SERIES_MAX_NAMES


def test_a_metric_write_for_a_replaced_token_stops_the_attempt(claimed):
    """The metrics go in the fenced progress write: once another claim took over, the tick's write is
    refused and the attempt ends with LeaseLost, as a progress write's would."""
    store, _ = claimed
    ticks = FakeClock(start_s=0.0)
    stop = StopSignal()
    reporter = ProgressReporter(Attempt(store, JOB_ID, PROFILE_ID, "t", 60.0), stop, clock=ticks, plan=PLAN)
    reporter("train_full", 0.0)
    store.release_lease(JOB_ID, "t")
    claim(store, "u")
    reporter.metric("train_full", 1, {"loss": 1.0})
    ticks.now = 5.0
    with pytest.raises(LeaseLost):
        reporter.tick()
    assert stop.is_set()
    assert "metrics" not in store.get_job(JOB_ID) or "train_full" not in store.get_job(JOB_ID)["metrics"]


def test_a_steady_progress_line_is_logged_and_the_latest_values_emitted(claimed):
    """Every log interval of a trainer stage one stage.progress line gives step, percent, ETA and the
    latest metrics, and the fixed set of training metrics goes out with a Stage dimension; the worker's
    own steps log none."""
    store, _ = claimed
    ticks = FakeClock(start_s=0.0)
    out = io.StringIO()
    reporter = reporter_for(store, ticks, log_interval_s=60.0, metrics=Metrics(stream=out))
    with structlog.testing.capture_logs() as logs:
        reporter("download", 0.0)
        ticks.now = 100.0
        reporter.tick()
        reporter("download", 100.0)
        reporter("train_full", 0.0)
        for second in range(1, 181):
            ticks.now = 100.0 + second
            reporter.metric("train_full", second * 10, {"loss": 1.0 / second, "lr": 1e-3, "mine": 5.0})
            reporter("train_full", second / 3)
            reporter.tick()
    lines = [entry for entry in logs if entry["event"] == "stage.progress"]
    assert [entry["step"] for entry in lines] == [600, 1200, 1800]
    assert lines[0]["stage"] == "train_full" and lines[0]["percent"] == 20.0
    assert lines[0]["stage_index"] == 4 and lines[0]["stage_count"] == 5
    assert lines[-1]["eta_s"] == pytest.approx(120.0 + 100.0 / 6 * 3, abs=2)
    assert lines[0]["latest"] == {"loss": 1.0 / 60, "lr": 1e-3, "mine": 5.0}
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    training = [d for d in docs if "TrainingLoss" in d]
    assert len(training) == 3
    assert all(d["Stage"] == "train_full" and d["LearningRate"] == 1e-3 and "mine" not in d for d in training)
    assert {m["Name"] for m in training[0]["_aws"]["CloudWatchMetrics"][0]["Metrics"]} == {"TrainingLoss",
                                                                                          "LearningRate"}


def test_the_stage_end_emits_its_final_values_once(claimed):
    """A stage's 100 % emits its latest training metrics once, even when it is reported twice."""
    store, _ = claimed
    out = io.StringIO()
    reporter = reporter_for(store, FakeClock(start_s=0.0), metrics=Metrics(stream=out))
    reporter("train_light", 0.0)
    reporter.metric("train_light", 5, {"val_loss": 0.5, "step_time_s": 0.25})
    reporter("train_light", 100.0)
    reporter("train_light", 100.0)
    docs = [json.loads(line) for line in out.getvalue().splitlines() if "ValidationLoss" in line]
    assert [(d["ValidationLoss"], d["StepTime"], d["Stage"]) for d in docs] == [(0.5, 0.25, "train_light")]
    assert store.get_job(JOB_ID)["history"][-1]["device"] == "cpu"  # no device declared: the CPU's time


def test_a_progress_write_without_detail_leaves_the_old_shape(claimed):
    """The commit's own progress write (no detail) writes stage, percent and time only."""
    store, clock = claimed
    Attempt(store, JOB_ID, PROFILE_ID, "t", 60.0).progress("committing", 100.0)
    assert store.get_job(JOB_ID)["progress"] == {"stage": "committing", "percent": 100.0, "updatedAt": clock.now}


def test_a_cuda_attempt_stays_cuda(claimed):
    """An attempt whose cuda stage ran keeps "cuda" on its entry when a later stage declares cpu."""
    store, _ = claimed
    plan = (PlannedStage("a", 1.0, device="cuda"), PlannedStage("b", 1.0, device="cpu"))
    reporter = ProgressReporter(Attempt(store, JOB_ID, PROFILE_ID, "t", 60.0), StopSignal(),
                                clock=FakeClock(start_s=0.0), plan=plan)
    reporter("a", 0.0)
    reporter("b", 0.0)
    assert store.get_job(JOB_ID)["history"][-1]["device"] == "cuda"
    assert math.isclose(store.get_job(JOB_ID)["progress"]["overallPercent"], 50.0)


def test_metrics_without_progress_lines_are_written_once_the_interval_passes(claimed):
    """A stage that prints METRIC lines but no PROGRESS gets them on the record through the runner's
    ticks: not before the interval since the last write, at once after it."""
    store, _ = claimed
    ticks = FakeClock(start_s=0.0)
    reporter = reporter_for(store, ticks)
    reporter("train_full", 0.0)
    reporter.metric("train_full", 1, {"loss": 3.0})
    ticks.now = 1.0
    reporter.tick()
    assert "metrics" not in store.get_job(JOB_ID)
    ticks.now = 2.0
    reporter.tick()
    assert store.get_job(JOB_ID)["metrics"] == {"train_full": {"loss": [[1, 3.0]]}}
    assert store.get_job(JOB_ID)["progress"]["step"] == 1
    writes = reporter.writes
    reporter.tick()
    assert reporter.writes == writes  # nothing new: no write


def test_a_flush_writes_what_the_interval_held_back(claimed):
    """Once a stage exited the runner flushes: metrics printed within the interval reach the record."""
    store, _ = claimed
    reporter = reporter_for(store, FakeClock(start_s=0.0))
    reporter("train_full", 0.0)
    reporter.metric("train_full", 7, {"loss": 0.5})
    reporter("train_full", 3.0)
    assert "metrics" not in store.get_job(JOB_ID)
    reporter.flush()
    assert store.get_job(JOB_ID)["metrics"] == {"train_full": {"loss": [[7, 0.5]]}}
    assert store.get_job(JOB_ID)["progress"]["percent"] == 3.0


def test_the_real_trainers_names_feed_the_same_training_metrics(claimed):
    """The Coqui trainer's generator total and validation score are its TrainingLoss and ValidationLoss;
    a stage that prints both a plain loss and the total is read by its plain loss."""
    store, _ = claimed
    out = io.StringIO()
    reporter = reporter_for(store, FakeClock(start_s=0.0), metrics=Metrics(stream=out))
    reporter("train_full", 0.0)
    reporter.metric("train_full", 5, {"loss_gen_total": 31.5, "loss_disc": 2.5, "val_score": 0.8, "lr": 2e-4})
    reporter("train_full", 100.0)
    reporter("train_light", 0.0)
    reporter.metric("train_light", 5, {"loss": 0.25, "loss_gen_total": 9.0})
    reporter("train_light", 100.0)
    docs = [json.loads(line) for line in out.getvalue().splitlines() if "TrainingLoss" in line]
    assert [(d["Stage"], d["TrainingLoss"], d.get("ValidationLoss")) for d in docs] == [
        ("train_full", 31.5, 0.8), ("train_light", 0.25, None)]
    assert all("loss_disc" not in d for d in docs)
