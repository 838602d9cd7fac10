"""The page's HTML, drawn on the server from the view dicts (``views``): every value goes through
``html.escape`` (``_e``) and nothing else reaches the markup, so a record holding HTML or a script
shows as text. No inline script or style (the Content-Security-Policy forbids both): the behaviour
is /static/ui.js, the look /static/ui.css.

The job page marks each value its script refreshes with ``data-field="path.in.the.api.answer"``;
the script sets only ``textContent`` (and a <progress>'s value, an SVG's attributes).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from worker.ops.ui.views import CHART_H, CHART_W
from worker.voice.records.view import JOB_STATUSES

POLL_MS = 3000  # how often a job's page asks /api/jobs/<id> while the job runs
# The progress section of a job with none yet: drawn hidden, for the script to fill once there is.
NO_PROGRESS = {"stage": "", "stageOf": "", "percent": None, "percentText": "", "overallPercent": None,
               "overallText": "", "step": "", "elapsed": "", "attemptElapsed": "", "eta": "", "updatedAt": "",
               "device": "", "latest": ""}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _field(path: str, value: Any, tag: str = "span", cls: str = "") -> str:
    klass = f' class="{_e(cls)}"' if cls else ""
    return f'<{tag} data-field="{_e(path)}"{klass}>{_e(value)}</{tag}>'


def layout(title: str, body: str, *, active: str, body_data: Mapping[str, str] | None = None) -> str:
    data = "".join(f' data-{_e(k)}="{_e(v)}"' for k, v in (body_data or {}).items())
    links = "".join(f'<a href="{href}"{" aria-current=page" if name == active else ""}>{name}</a>'
                    for name, href in (("jobs", "/"), ("workers", "/workers"), ("queue", "/queue")))
    return ("<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)} · voice-worker</title>"
            '<link rel=stylesheet href="/static/ui.css"><script src="/static/ui.js" defer></script>'
            f"</head><body{data}><header><strong>voice-worker</strong> <nav>{links}</nav>"
            '<span class=muted>read-only</span></header>'
            f"<main>{body}</main></body></html>\n")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{_e(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def job_href(job_id: str) -> str:
    return "/jobs/" + quote(job_id, safe="")


def jobs_page(rows: list[dict[str, str]], *, status: str, since: str, id_text: str, problem: str = "") -> str:
    options = "".join(f'<option value="{_e(s)}"{" selected" if s == status else ""}>{_e(s or "any")}</option>'
                      for s in ("", *JOB_STATUSES))
    form = ('<form method=get action="/" class=filters>'
            f'<label>status <select name=status>{options}</select></label>'
            f'<label>since <input name=since value="{_e(since)}" placeholder="2h, 7d, 2026-12-01T09:00Z"></label>'
            f'<label>id contains <input name=q value="{_e(id_text)}" maxlength=128></label>'
            "<button type=submit>show</button></form>")
    warn = f'<p class=problem>{_e(problem)}</p>' if problem else ""
    cells = ([f'<a href="{_e(job_href(r["id"]))}">{_e(r["id"])}</a>', _e(r["status"]), _e(r["createdAt"]),
              _e(r["attempts"]), _e(r["doing"])] for r in rows)
    listing = table(("job", "status", "created", "attempts", "progress or error"), cells, cls="jobs") if rows \
        else "<p class=muted>no jobs match</p>"
    return layout("jobs", f"<h1>Jobs</h1>{form}{warn}<p class=muted>{len(rows)} shown, newest first</p>{listing}",
                  active="jobs")


def chart_svg(chart: Mapping[str, Any]) -> str:
    """A loss curve: one polyline in a fixed viewBox, its ranges as text beside it."""
    label = f"{chart['stage']} · {chart['metric']}"
    return (f'<figure class=chart data-points="{_e(chart["count"])}"><figcaption>{_e(label)}</figcaption>'
            f'<svg viewBox="0 0 {CHART_W} {CHART_H}" width="{CHART_W}" height="{CHART_H}" role=img '
            f'aria-label="{_e(label)}"><rect class=frame x=0 y=0 width="{CHART_W}" height="{CHART_H}"></rect>'
            f'<polyline class=curve points="{_e(chart["points"])}"></polyline></svg>'
            f'<p class=muted>{_e(chart["steps"])} · min {_e(chart["min"])} · max {_e(chart["max"])} · '
            f'latest {_e(chart["last"])}</p></figure>')


def _section(title: str, body: str, *, show: str = "", present: bool = True) -> str:
    attrs = f' data-show="{_e(show)}"' if show else ""
    return f'<section{attrs}{"" if present else " hidden"}><h2>{_e(title)}</h2>{body}</section>'


def _pairs(pairs: Sequence[tuple[str, str]]) -> str:
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in pairs) + "</dl>"


def job_page(d: Mapping[str, Any]) -> str:
    err, quality, base = d["error"], d["quality"], d["baseModel"]
    p = d["progress"] or NO_PROGRESS
    head = _pairs([
        ("status", _field("status", d["status"], cls="status")),
        ("attempts", _field("attempts", d["attempts"])),
        ("worker", _field("worker", d["worker"])),
        ("profile", _e(d["profileId"])),
        ("created", _e(d["createdAt"])),
        ("completed", _field("completedAt", d["completedAt"])),
        ("cancel requested", _field("cancelRequested", d["cancelRequested"])),
    ])
    bar_value = "" if p["percent"] is None else f' value="{p["percent"]:.1f}"'
    overall_value = "" if p["overallPercent"] is None else f' value="{p["overallPercent"]:.1f}"'
    progress = _pairs([
        ("stage", _field("progress.stage", p["stage"]) + " " + _field("progress.stageOf", p["stageOf"], cls="muted")),
        ("stage done", f'<progress max=100{bar_value} data-value="progress.percent"></progress> '
                       + _field("progress.percentText", p["percentText"])),
        ("overall", f'<progress max=100{overall_value} data-value="progress.overallPercent"></progress> '
                    + _field("progress.overallText", p["overallText"])),
        ("step", _field("progress.step", p["step"])),
        ("elapsed", _field("progress.elapsed", p["elapsed"]) + " in the stage, "
                    + _field("progress.attemptElapsed", p["attemptElapsed"]) + " in the attempt"),
        ("ETA", _field("progress.eta", p["eta"])),
        ("latest", _field("progress.latest", p["latest"], cls="wrap")),
        ("device", _field("progress.device", p["device"])),
        ("updated", _field("progress.updatedAt", p["updatedAt"])),
    ])
    error = _pairs([
        ("type", _field("error.type", err["type"] if err else "")),
        ("kind", _field("error.kind", err["kind"] if err else "")),
    ]) + _field("error.message", err["message"] if err else "", tag="pre", cls="message")
    charts = "".join(chart_svg(c) for c in d["charts"]) or "<p class=muted>no loss series recorded</p>"
    others = table(("stage", "metric", "step", "latest"), ([_e(c) for c in row] for row in d["otherMetrics"]),
                   cls="metrics") if d["otherMetrics"] else ""
    quality_body = ""
    if quality:
        quality_body = table(("model", "similarity", "CER", "DNSMOS", "sanity"),
                             ([_e(c) for c in row] for row in quality["rows"]), cls="quality")
        quality_body += f"<p>gate: {_e(quality['gate'])}</p>"
    base_body = _pairs([(k, _e(base[k])) for k in ("name", "licence", "digest")]) if base else ""
    history = table(("attempt", "start", "end", "outcome", "trainer time", "worker"),
                    ([_e(h[k]) for k in ("number", "start", "end", "outcome", "gpu", "worker")] for h in d["history"]),
                    cls="history") if d["history"] else "<p class=muted>no attempt yet</p>"
    files = table(("artifact", "path"), ([_e(k), _e(v)] for k, v in d["files"]), cls="files") if d["files"] else ""
    log = (_field("logTail.note", d["logTail"]["note"], tag="p", cls="muted")
           + _field("logTail.text", d["logTail"]["text"], tag="pre", cls="log"))
    body = (f'<h1>Job <span class=ident>{_e(d["id"])}</span></h1>'
            f'<p class=muted>shown at {_field("shownAt", d["shownAt"])}; '
            f'<span data-live>updates every {POLL_MS // 1000} s while the job runs</span></p>'
            + _section("Job", head)
            + _section("Progress", progress, show="progress", present=d["progress"] is not None)
            + _section("Error", error, show="error", present=err is not None)
            + _section("Loss", f'<div class=charts data-charts>{charts}</div>{others}')
            + _section("Quality", quality_body, present=quality is not None)
            + _section("Base model", base_body, present=base is not None)
            + _section("Attempts", history)
            + (_section("Files", files) if files else "")
            + _section("Stage log", log))
    return layout(f"job {d['id']}", body, active="jobs",
                  body_data={"job-id": d["id"], "poll-ms": str(POLL_MS), "final": "1" if d["final"] else "0"})


def workers_page(rows: list[dict[str, str]], note: str) -> str:
    cells = ([_e(r["workerId"]) + (' <span class=stale>stale</span>' if r["stale"] else ""), _e(r["host"]),
              _e(r["version"]), _e(r["state"]),
              f'<a href="{_e(job_href(r["jobId"]))}">{_e(r["jobId"])}</a>' if r["jobId"] != "-" else "-",
              _e(r["since"]), _e(r["lastSeen"]), _e(r["device"])] for r in rows)
    listing = table(("worker", "host", "version", "state", "job", "since", "last seen", "device"), cells,
                    cls="workers") if rows else f"<p class=muted>{_e(note)}</p>"
    return layout("workers", f"<h1>Workers</h1>{listing}", active="workers")


def queue_page(view: Mapping[str, Any] | None, note: str) -> str:
    if view is None:
        return layout("queue", f"<h1>Queue</h1><p class=problem>{_e(note)}</p>", active="queue")
    main = _pairs([("queue", _e(view["url"])), ("visible", _e(view["visible"])),
                   ("in flight", _e(view["inFlight"])), ("delayed", _e(view["delayed"])),
                   ("oldest", _e(view["oldest"]))])
    dlq = view["dlq"]
    dead = _pairs([("queue", _e(dlq["url"])), ("visible", _e(dlq["visible"])), ("in flight", _e(dlq["inFlight"]))]) \
        if dlq else "<p class=muted>none: the queue has no RedrivePolicy</p>"
    return layout("queue", f"<h1>Queue</h1>{main}<h2>Dead letters</h2>{dead}", active="queue")


def error_page(status: int, title: str, detail: str) -> str:
    return layout(title, f"<h1>{_e(status)} {_e(title)}</h1><p class=problem>{_e(detail)}</p>", active="")
