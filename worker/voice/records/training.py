"""How far a job's training has got: its stage plan, the overall percent and ETA drawn from it, and
the bounded series of each metric a stage printed (``METRIC`` lines, ``pipeline.stages.parse_metric``).

Pure functions, so the reporter that writes them (``attempt.ProgressReporter``), the record rules and
the commands that read them agree without sharing state.

Why the series are shaped this way: a record is rewritten whole at each progress write, and a run may
print a million steps, so each metric keeps at most ``SERIES_MAX_POINTS`` points however long the run.
The points kept are spread evenly over the steps (one per bucket of ``width`` steps, the width a power
of two that doubles as the run grows), with the first point and the latest always kept. The width is
derived from the points themselves (the first and the latest step), so a series read back from the
record (a retry's) goes on being thinned the same way with no state of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pipeline.config import StageSpec
from pipeline.stages import METRIC_NAME
from worker.voice.records.models import JobRecord

SERIES_MAX_POINTS = 200
# Distinct metric names kept per stage: a trainer that prints ever new names cannot grow the record.
SERIES_MAX_NAMES = 32
_MAX_STEP = 10**12


@dataclass(frozen=True)
class PlannedStage:
    """One step of a job as its progress reports it: the worker's own (download, dataset) or a trainer
    stage of the pipeline config, with its share of the job's time and the device it declares."""

    name: str
    weight: float = 1.0
    trainer: bool = True
    device: str | None = None


def plan_of(stages: Sequence[StageSpec], own_steps: Sequence[str] = ()) -> tuple[PlannedStage, ...]:
    """The worker's own steps first (they weigh nothing: minutes beside hours of training), then the
    config's stages with their declared ``weight`` (default 1) and device."""
    return (*(PlannedStage(name, 0.0, trainer=False) for name in own_steps),
            *(PlannedStage(s.name, s.weight, device=s.device) for s in stages))


def overall_percent(plan: Sequence[PlannedStage], index: int, percent: float) -> float | None:
    """The job's percent with stage ``index`` at ``percent``: the stages before it whole, each by its
    weight; None when the plan weighs nothing."""
    total = sum(stage.weight for stage in plan)
    if total <= 0 or not 0 <= index < len(plan):
        return None
    done = sum(stage.weight for stage in plan[:index]) + plan[index].weight * min(100.0, percent) / 100
    return round(min(100.0, 100 * done / total), 2)


def eta_s(plan: Sequence[PlannedStage], index: int, percent: float, rate_per_s: float | None) -> float | None:
    """Seconds until the job's last stage ends: the current stage at its observed rate (percent per
    second), each later stage taking what its weight says at that same rate per unit of weight. None
    without a rate, or when the current stage weighs nothing and later stages would need its rate."""
    if rate_per_s is None or not rate_per_s > 0 or not math.isfinite(rate_per_s) or not 0 <= index < len(plan):
        return None
    remaining = max(0.0, 100.0 - percent) / rate_per_s
    later = sum(stage.weight for stage in plan[index + 1:])
    if later > 0:
        if plan[index].weight <= 0:
            return None
        remaining += later / plan[index].weight * 100.0 / rate_per_s
    return round(remaining, 1)


def _width(first_step: int, last_step: int, max_points: int) -> int:
    """The bucket width (a power of two) that fits the steps from first to last in ``max_points - 3``
    buckets: with the first and the latest point kept besides one point per bucket, at most
    ``max_points`` in all."""
    need = -(-(last_step - first_step) // (max_points - 3))
    return 1 if need <= 1 else 1 << (need - 1).bit_length()


def thin(points: list[list], max_points: int = SERIES_MAX_POINTS) -> list[list]:
    """``points`` (sorted by step) with the first, the latest and the first point of each bucket
    after the first's kept."""
    if len(points) <= 2:
        return points
    width = _width(points[0][0], points[-1][0], max_points)
    kept, bucket = [points[0]], points[0][0] // width
    for point in points[1:-1]:
        if point[0] // width != bucket:
            kept.append(point)
            bucket = point[0] // width
    kept.append(points[-1])
    return kept


def add_point(points: list[list], step: int, value: float, max_points: int = SERIES_MAX_POINTS) -> None:
    """Append ``[step, value]`` to the series in place, keeping it within ``max_points``.

    A step at or before the latest one means the stage went back (it resumed from an earlier
    checkpoint, or started over): the points from that step on are the old run's and are dropped."""
    while points and points[-1][0] >= step:
        points.pop()
    if not points:
        points.append([step, value])
        return
    before = _width(points[0][0], points[-1][0], max_points)
    width = _width(points[0][0], step, max_points)
    # The latest point becomes an inner one: kept only as the first of its bucket.
    if len(points) >= 2 and points[-1][0] // width == points[-2][0] // width:
        points.pop()
    points.append([step, value])
    if width != before:
        points[:] = thin(points, max_points)


def _point(value: object) -> list | None:
    if (isinstance(value, list | tuple) and len(value) == 2 and type(value[0]) is int
            and 0 <= value[0] < _MAX_STEP and isinstance(value[1], int | float) and not isinstance(value[1], bool)
            and math.isfinite(value[1])):
        return [value[0], float(value[1])]
    return None


def read_series(value: object, max_points: int = SERIES_MAX_POINTS) -> dict[str, dict[str, list[list]]]:
    """A record's ``metrics`` ({stage: {name: [[step, value], ...]}}) as the reporter continues it:
    what is not a well-formed point, name or stage is left out, each series sorted by step (one point
    per step) and thinned to ``max_points``. Never raises: another writer may have stored anything."""
    read: dict[str, dict[str, list[list]]] = {}
    if not isinstance(value, Mapping):
        return read
    for stage, series in value.items():
        if not isinstance(stage, str) or not isinstance(series, Mapping):
            continue
        names: dict[str, list[list]] = {}
        for name, raw in series.items():
            if len(names) >= SERIES_MAX_NAMES:
                break
            if not isinstance(name, str) or not METRIC_NAME.fullmatch(name) or not isinstance(raw, list):
                continue
            by_step = {p[0]: p for p in map(_point, raw) if p is not None}
            if by_step:
                names[name] = thin([by_step[step] for step in sorted(by_step)], max_points)
        read[stage] = names
    return read



def progress_summary(job: JobRecord, now: datetime) -> dict[str, Any] | None:
    """How far, how long, how well, as ``status`` (text and --json) and the web page show it; None when
    the record holds no readable progress. Elapsed times and the ETA's moment run to ``now`` only while
    the job is processing (a final job's progress is where it stopped); the ETA counts from the report
    that estimated it (``updatedAt``)."""
    p = job.progress
    if p is None:
        return None
    running = job.status == "processing"
    entry = job.history[-1] if job.history else None
    attempt_start = entry.start if entry is not None and entry.end is None else None
    eta_at = p.updated_at + timedelta(seconds=p.eta_s) if p.eta_s is not None and p.updated_at else None
    return {
        "stage": p.stage, "stageIndex": p.stage_index, "stageCount": p.stage_count, "percent": p.percent,
        # The commit's own progress write names no stage of the plan; a committed job is all done.
        "overallPercent": 100.0 if job.status == "completed" else p.overall_percent,
        "step": p.step, "latest": dict(p.latest),
        "updatedAt": p.updated_at, "stageStartedAt": p.stage_started_at,
        "stageElapsedS": _since(p.stage_started_at, now) if running else None,
        "attemptElapsedS": _since(attempt_start, now) if running else None,
        "etaS": p.eta_s, "etaAt": eta_at if running else None,
        "worker": job.lease.owner if running and job.lease is not None else None,
        "device": job.trainer_device(),
    }


def _since(moment: datetime | None, now: datetime) -> float | None:
    return None if moment is None else round(max(0.0, (now - moment).total_seconds()), 3)
