"""What the web page shows, as plain JSON-ready dicts of display strings: small pure functions of the
records (read tolerantly, ``worker.voice.records.view``), never of the settings.

The HTML templates and the JSON endpoint draw from the same dicts, so the page a browser first gets
and the values its script later polls agree. Every string that came from a record (another writer,
a stage's output) goes through ``text``: control characters dropped, URLs cut to scheme://host/path,
credential shapes masked (``worker.core.redact``), and bounded in length; escaping for HTML is the
templates' job (``pages``) and the script's (``textContent`` only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from worker.core.redact import redact_text
from worker.ops import workers_view
from worker.ops.commands import format_elapsed, job_files, job_over, moment, score_text
from worker.voice.records.rules import BASE_MODEL, COMPLETED, FINAL_STATUSES, METRICS, QUALITY
from worker.voice.records.training import progress_summary
from worker.voice.records.view import JobView, ProfileView

SHORT_CHARS = 200  # one value in a table cell or a heading
LONG_CHARS = 4000  # an error message
LIST_CHARS = 120  # what a job in the list is doing, or why it stopped
LOG_TAIL_CHARS = 20_000
CHART_W, CHART_H, CHART_PAD = 480, 160, 4  # the SVG's viewBox, in its own units
MAX_CHARTS_PER_STAGE = 8
MAX_LATEST = 16  # metrics shown in "latest"


def text(value: Any, limit: int = SHORT_CHARS) -> str:
    """A record's value as text safe to show: redacted, at most ``limit`` characters (then ``…``)."""
    shown = redact_text(value if isinstance(value, str) else str(value))
    shown = shown.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate is no UTF-8
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def known(value: Any, limit: int = SHORT_CHARS) -> str:
    return "?" if value is None else text(value, limit)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return when if when.tzinfo else when.replace(tzinfo=UTC)
    return None


def metric_value(value: float) -> str:
    """A metric as the page shows it: 4 significant digits, whatever its scale (a loss, an lr)."""
    return f"{value:.4g}"


# ---------------------------------------------------------------- the jobs list

def job_row(job: JobView) -> dict[str, Any]:
    """One line of the jobs list."""
    p = job.progress
    doing = ""
    if p is not None and job.status not in FINAL_STATUSES:
        doing = f"{known(p.stage)} {_percent(p.percent)} %"
    elif job.error is not None:
        doing = f"{known(job.error.type)}: {known(job.error.message)}"
    return {"id": known(job.id), "status": known(job.status), "createdAt": moment(job.created_at),
            "attempts": known(job.attempts), "doing": text(doing, LIST_CHARS)}


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


# ---------------------------------------------------------------- a job

def progress_view(job: JobView, now: datetime) -> dict[str, Any] | None:
    """The progress block (None for a job with no readable progress): ``training.progress_summary``,
    what ``status`` shows too, as display strings. The ETA counts down from the report that estimated
    it; elapsed times and the ETA run only while the job is processing."""
    s = progress_summary(job, now)
    if s is None:
        return None
    index, count = s["stageIndex"], s["stageCount"]
    eta_at = s["etaAt"]
    latest = "  ".join(f"{text(name, 48)} {metric_value(v)}" for name, value in list(s["latest"].items())[:MAX_LATEST]
                       if (v := _number(value)) is not None)
    return {
        "stage": known(s["stage"]),
        "stageOf": f"stage {index} of {count}" if index and count else "",
        "percent": s["percent"],
        "percentText": f"{_percent(s['percent'])} %",
        "overallPercent": s["overallPercent"],
        "overallText": "?" if s["overallPercent"] is None else f"{s['overallPercent']:.0f} %",
        "step": "-" if s["step"] is None else str(s["step"]),
        "elapsed": _duration(s["stageElapsedS"]),
        "attemptElapsed": _duration(s["attemptElapsedS"]),
        "eta": _duration(max(0.0, (eta_at - now).total_seconds())) if eta_at else "-" if job_over(job) else "?",
        "updatedAt": moment(s["updatedAt"]),
        "device": known(s["device"]),
        "latest": latest or "-",
    }


def _duration(seconds: float | None) -> str:
    return "-" if seconds is None else format_elapsed(seconds)


def error_view(job: JobView) -> dict[str, str] | None:
    e = job.error
    if e is None:
        return None
    kind = "?" if e.retryable is None else "retryable" if e.retryable else "permanent"
    return {"type": known(e.type), "kind": kind, "message": known(e.message, LONG_CHARS)}


def _model_row(name: str, figures: Any) -> list[str]:
    if not isinstance(figures, Mapping):
        return [text(name), "?", "?", "?", "?"]
    dnsmos, sanity = figures.get("dnsmos"), figures.get("sanity")
    ovrl = dnsmos.get("ovrl") if isinstance(dnsmos, Mapping) else None if dnsmos is None else "?"
    sane = "?" if not isinstance(sanity, Mapping) or not isinstance(sanity.get("ok"), bool) else (
        "ok" if sanity["ok"] else "NOT ok")
    return [text(name), score_text(figures.get("speakerSimilarity")), score_text(figures.get("cer")),
            score_text(ovrl), sane]


def quality_view(value: Any) -> dict[str, Any] | None:
    """The job's evaluation (``quality`` on its record): one row per model and the gate's word."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return {"rows": [], "gate": "?"}
    models = _mapping(value.get("models"))
    rows = [_model_row(str(name), figures) for name, figures in list(models.items())[:16]]
    if value.get("reference") is not None:
        rows.append(_model_row("reference (the recordings)", value["reference"]))
    gate = _mapping(value.get("gate"))
    failed = gate.get("failed")
    if gate.get("applied") is False:
        word = "none configured (report only)"
    elif gate.get("passed") is True:
        word = "passed"
    elif isinstance(failed, list):
        word = text("below the bar: " + "; ".join(map(str, failed)), LONG_CHARS)
    else:
        word = "?"
    return {"rows": rows, "gate": word}


def base_model_view(value: Any) -> dict[str, str] | None:
    if not isinstance(value, Mapping):
        return None
    return {key: text(value[key]) if isinstance(value.get(key), str) and value[key] else "?"
            for key in ("name", "licence", "digest")}


def attempts_view(job: JobView) -> list[dict[str, str]]:
    rows = []
    for number, h in enumerate(job.history, 1):
        if h is None:
            rows.append({"number": str(number), "start": "?", "end": "?", "outcome": "?", "gpu": "?", "worker": "?"})
            continue
        rows.append({"number": str(number), "start": moment(h.start), "end": moment(h.end) if h.end else "…",
                     "outcome": known(h.outcome), "worker": known(h.worker),
                     "gpu": "" if h.gpu_seconds is None else f"{h.gpu_seconds:.0f} s"})
    return rows


def series_points(series: Any) -> list[tuple[float, float]]:
    """A recorded series (``[[step, value], ...]``) as finite (step, value) pairs, in step order; any
    other entry is skipped."""
    points = []
    for entry in series if isinstance(series, list | tuple) else ():
        if isinstance(entry, list | tuple) and len(entry) == 2:
            step, value = _number(entry[0]), _number(entry[1])
            if step is not None and value is not None:
                points.append((step, value))
    return sorted(points, key=lambda point: point[0])


def polyline(points: list[tuple[float, float]], width: float = CHART_W, height: float = CHART_H,
             pad: float = CHART_PAD) -> str:
    """The SVG ``points`` attribute of a line through ``points``, scaled into the box (steps left to
    right, values bottom to top; a flat series is drawn across the middle)."""
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)

    def scale(v: float, lo: float, hi: float, size: float) -> float:
        return size / 2 if hi == lo else pad + (v - lo) / (hi - lo) * (size - 2 * pad)

    return " ".join(f"{scale(x, x0, x1, width):.1f},{height - scale(y, y0, y1, height):.1f}" for x, y in points)


def charts_view(metrics: Any) -> list[dict[str, Any]]:
    """One chart per loss series of each stage (``metrics``: ``{stage: {name: [[step, value], ...]}}``),
    at most MAX_CHARTS_PER_STAGE a stage: its polyline and the ranges its axes stand for."""
    charts: list[dict[str, Any]] = []
    if not isinstance(metrics, Mapping):
        return charts
    for stage, series_by_name in metrics.items():
        if not isinstance(series_by_name, Mapping):
            continue
        names = [n for n in series_by_name if isinstance(n, str) and "loss" in n.lower()]
        for name in names[:MAX_CHARTS_PER_STAGE]:
            points = series_points(series_by_name[name])
            if not points:
                continue
            values = [v for _, v in points]
            charts.append({"stage": text(stage, 64), "metric": text(name, 48), "count": len(points),
                           "points": polyline(points), "steps": f"steps {points[0][0]:.0f} – {points[-1][0]:.0f}",
                           "min": metric_value(min(values)), "max": metric_value(max(values)),
                           "last": metric_value(points[-1][1])})
    return charts


def other_metrics_view(metrics: Any) -> list[list[str]]:
    """The latest value of each recorded series that is not charted (validation scores, lr, step time)."""
    rows: list[list[str]] = []
    if not isinstance(metrics, Mapping):
        return rows
    for stage, series_by_name in metrics.items():
        if not isinstance(series_by_name, Mapping):
            continue
        for name, series in list(series_by_name.items())[:64]:
            if isinstance(name, str) and "loss" not in name.lower() and (points := series_points(series)):
                rows.append([text(stage, 64), text(name, 48), f"{points[-1][0]:.0f}", metric_value(points[-1][1])])
    return rows


def job_detail(job: JobView, profile: ProfileView | None, now: datetime,
               log_tail: tuple[str | None, str] = (None, "")) -> dict[str, Any]:
    """Everything a job's page shows (and ``/api/jobs/<id>`` answers): display strings, and the
    numbers the page's progress bars take."""
    document = job.document if isinstance(job.document, Mapping) else {}
    files = job_files(job, profile)
    tail, note = log_tail
    return {
        "id": known(job.id),
        "status": known(job.status),
        "final": job_over(job),
        "attempts": known(job.attempts),
        "profileId": known(job.profile_id),
        "createdAt": moment(job.created_at),
        "completedAt": moment(job.completed_at) if job.completed_at else "-",
        "worker": known(job.lease.owner) if job.lease else "-",
        "cancelRequested": "yes" if job.cancel_requested else "no",
        "progress": progress_view(job, now),
        "error": error_view(job),
        "quality": quality_view(document.get(QUALITY)),
        "baseModel": base_model_view(document.get(BASE_MODEL)),
        "history": attempts_view(job),
        "charts": charts_view(document.get(METRICS)),
        "otherMetrics": other_metrics_view(document.get(METRICS)),
        "files": [] if not files or job.status != COMPLETED else
        [[text(k), text(v, LONG_CHARS)] for part in files for k, v in part.items()],
        "logTail": {"text": "" if tail is None else text(tail[-LOG_TAIL_CHARS:], LOG_TAIL_CHARS), "note": text(note)},
        "shownAt": moment(now),
    }


# ---------------------------------------------------------------- workers and the queue

PRESENCE_FIELDS = ("workerId", "host", "version", "state", "jobId", "since", "lastSeen", "device")


def worker_rows(presences: Iterable[Any], now: datetime, default_interval_s: float) -> list[dict[str, str]]:
    """The ``workers`` command's rows (``workers_view.worker_rows``: stale judged on ``now``, the store's
    clock, which stamped ``lastSeen``; live ones first) as display strings."""
    rows = []
    for row in workers_view.worker_rows([dict(_mapping(p)) for p in presences], now, default_interval_s):
        shown = {name: moment(_time(row.get(name))) if name in ("since", "lastSeen") else
                 known(row.get(name)) if row.get(name) is not None else "-" for name in PRESENCE_FIELDS}
        shown["stale"] = "stale" if row["stale"] else ""
        rows.append(shown)
    return rows


def queue_rows(main: Any, dlq: Any) -> dict[str, Any]:
    """The ``queue`` command's view (``worker.ops.queue_view``) as display strings."""
    def count(value: int | None) -> str:
        return "?" if value is None else str(value)

    oldest = main.oldest
    if oldest is not None and oldest.age_s is not None:
        age = f"{format_elapsed(oldest.age_s)} (CloudWatch, measured {text(oldest.reported_at)})"
    else:
        age = text(oldest.unavailable) if oldest is not None else "?"
    return {"url": text(main.url), "visible": count(main.visible), "inFlight": count(main.inFlight),
            "delayed": count(main.delayed), "oldest": age,
            "dlq": None if dlq is None else {"url": text(dlq.url), "visible": count(dlq.visible),
                                             "inFlight": count(dlq.inFlight)}}
