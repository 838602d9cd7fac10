"""The operator's commands: submit, status, cancel, health, dlq list/redrive.

Each takes its clients, prints, and returns an exit code (the table is in worker/ops/cli.py's help texts).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from worker.core.errors import InvalidMessage, WorkerError
from worker.core.healthcheck import main as healthcheck_main
from worker.core.logs import scrub
from worker.core.redact import strip_control
from worker.ops.dlq import MOVE_TASK, RECEIVE_SEND_DELETE, DeadLetterQueue
from worker.settings import Settings
from worker.voice.errors import QUALITY_BAR_PREFIX, IdempotencyMismatch
from worker.voice.input_policy import SHAPE_ONLY, InputPolicy
from worker.voice.prep_report import summary_line as dataset_summary
from worker.voice.records import Store
from worker.voice.records.rules import (
    BASE_MODEL,
    CANCELLED,
    COMPLETED,
    DATASET,
    ERROR,
    FINAL_STATUSES,
    PENDING,
    PROCESSING,
    QUALITY,
    REFUSED,
    committing,
    lease_live,
)
from worker.voice.records.training import progress_summary
from worker.voice.records.view import JobView, Problem, ProfileView, job_view, shown
from worker.voice.submit import SUBMISSION_HASH, prepare, submit_prepared

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_NOTHING_TO_DO, EXIT_TOO_LATE = 0, 1, 2, 3, 4, 5
# submit: the idempotencyKey is known, with a different submission (nothing created or sent).
EXIT_MISMATCH = 6
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


_JSON_DEPTH = 64  # deeper than any record the worker writes; what lies below is not printed


def _jsonable(value: Any, depth: int = 0) -> Any:
    """A record as JSON can carry it, whatever another writer stored: times as ISO text; a number JSON
    has no word for (NaN, infinity, thousands of digits) and any other value as text."""
    if depth > _JSON_DEPTH:
        return "…"
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, int):
        return value if value.bit_length() <= 1000 else shown(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, depth + 1) for v in value]
    try:
        return str(value)  # Decimal128, Binary, ...: their text
    except Exception:  # noqa: BLE001 - a value without a text still must not stop the output
        return shown(value)


def cmd_submit(open_store: Callable[[], AbstractContextManager[Store]], sqs, queue_url: str, source: TextIO, *,
               as_json: bool, policy: InputPolicy = SHAPE_ONLY, out: TextIO | None = None,
               err: TextIO | None = None) -> int:
    """Refuses (exit 2) what the worker's ``policy`` would refuse before the store is even opened, so a
    refused submission leaves no record and no new STORE_URL file behind."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        payload = json.loads(source.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        print(f"submission is not valid JSON: {exc}", file=err)
        return EXIT_USAGE
    try:
        prepared = prepare(payload, policy)
        with open_store() as store:
            job_id, created = submit_prepared(store, sqs, queue_url, prepared)
            unverified = (not created and prepared[2] is not None
                          and _stored(store.get_job(job_id), SUBMISSION_HASH) is None)
    except InvalidMessage as exc:
        for line in exc.problems:
            print(line, file=err)
        return EXIT_USAGE
    except IdempotencyMismatch as exc:
        print(f"submit refused: {one_line(exc)}", file=err)
        return EXIT_MISMATCH
    except WorkerError as exc:
        print(f"submit failed: {error_line(exc)}", file=err)
        return EXIT_FAILED
    if unverified:
        print(f"note: job {job_id} was recorded before submissions were hashed: this submission was not "
              "compared with it", file=err)
    if as_json:
        print(json.dumps({"jobId": job_id, "created": created}), file=out)
    else:
        # Without an idempotency key the job was found by its jobId (a body sent again, as the
        # re-enqueue recipe does), and its message went out again: say that, not a key.
        again = ("already submitted with this idempotency key" if prepared[2] is not None
                 else "a job with this jobId exists: its message was sent again")
        print(job_id if created else f"{job_id} ({again})", file=out)
    return EXIT_OK


def _stored(record: JobView | None, field: str) -> Any:
    """A field of the stored document that the models do not name (None for no record)."""
    return None if record is None else record.document.get(field)


def job_files(job: JobView, profile: ProfileView | None) -> tuple[dict[str, str], dict[str, str]] | None:
    """(modelPaths, s3Paths) that this job committed, or None: the profile's paths are its latest
    committed job's, so they are this job's only when it completed and no later job claimed the profile."""
    if profile is None or job.status != COMPLETED or job.id is None or profile.job_id != job.id:
        return None
    return dict(profile.model_paths), dict(profile.s3_paths)


@dataclass(frozen=True)
class JobStatus:
    """One job as `status` shows it: the typed records, read tolerantly (the text is drawn from their
    fields, the problems found in them are the warnings; --json prints the documents as stored)."""

    job: JobView
    profile: ProfileView | None
    # Where the job's stage logs are shipped (worker/voice/stage_logs.py), when the deployment ships them.
    logs: str | None = None

    @property
    def files(self) -> tuple[dict[str, str], dict[str, str]] | None:
        return job_files(self.job, self.profile)

    def problems(self) -> list[dict[str, str]]:
        found = [("job", p) for p in self.job.problems]
        found += [("profile", p) for p in self.profile.problems] if self.profile else []
        return [{"record": record, "field": p.field, "problem": p.what} for record, p in found]

    def warnings(self) -> list[str]:
        return warning_lines(self.job, self.profile)

    def as_json(self, now: datetime | None = None) -> dict:
        """The documents as stored, with what `status` draws from them: ``progress`` (how far, how long:
        ``progress_summary``), the cost and its ``costUnit``, the quality, the files, the problems."""
        files = self.files
        document = self.job.document
        quality = document.get(QUALITY) if isinstance(document, dict) else None
        summary = progress_summary(self.job, datetime.now(UTC) if now is None else now)
        return {"job": _jsonable(document), "progress": _jsonable(summary),
                "costUnit": cost_unit(self.job.trainer_device()),
                "profile": None if self.profile is None else _jsonable(self.profile.document), "cost": self.job.cost(),
                "quality": _jsonable(quality),
                "files": None if files is None else {"modelPaths": files[0], "s3Paths": files[1]},
                "logs": None if self.logs is None else {"location": self.logs, "command": self.logs_command},
                "problems": self.problems()}

    @property
    def logs_command(self) -> str:
        return f"python -m worker logs {one_line(self.job.id)}"


def job_over(job: Any) -> bool:
    """Whether nothing more will happen to the job (no progress, no logs, no retry): a final status, or
    an error no retry follows. What `status --watch`, `logs --follow` and the web page stop on."""
    error = job.error
    return job.status in FINAL_STATUSES or (job.status == ERROR and not (error is not None and error.retryable))


def status_document(store: Store, job_id: str, logs_at: Callable[[str], str] | None = None) -> JobStatus | None:
    """``logs_at(job_id)``: where the job's stage logs are shipped, when they are."""
    job = store.get_job(job_id)
    if job is None:
        return None
    return JobStatus(job, store.get_profile(job.profile_id) if job.profile_id else None,
                     logs=logs_at(job_id) if logs_at is not None else None)


def warning_lines(job: JobView, profile: ProfileView | None = None) -> list[str]:
    """One line per field of the records that is not what the worker writes, shown as ``?``."""
    lines = [_warning("job", job.id, p) for p in job.problems]
    return lines + [_warning("profile", profile.id, p) for p in profile.problems] if profile else lines


def _warning(kind: str, record_id: str | None, problem: Problem) -> str:
    return one_line(f"warning: {kind} {record_id or '?'}: {problem}")


def error_line(value: Any) -> str:
    """An error's text for one line on a terminal: its first line only, and an HTML page (what a
    proxy or an emulator may answer) never shown, only named."""
    text = strip_control(str(value))
    lower = text.lower()
    cut = min((i for i in (lower.find("<!doctype html"), lower.find("<html")) if i >= 0), default=-1)
    if cut >= 0:
        return one_line(text[:cut]).rstrip() + f" (an HTML page of {len(text) - cut} characters, not shown)"
    first, *rest = text.strip().split("\n") or [""]
    return one_line(first) + (f" (and {len(rest)} more line{'s' if len(rest) > 1 else ''}, not shown)" if rest else "")


def one_line(value: Any) -> str:
    """A record value as one line of terminal text: whoever wrote it cannot clear, retitle or add lines."""
    return printable(strip_control(str(value), keep_lines=False))


def printable(text: str) -> str:
    """``text`` that any UTF-8 output takes: a lone surrogate (JSON may hold one) becomes ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def known(value: Any) -> str:
    """A view's value as one line, or ``?`` where the record held none that is valid."""
    return "?" if value is None else one_line(value)


def indented_lines(value: Any, indent: str) -> str:
    """A multi-line record value (a stage's log tail) with every line after the first indented, so
    none of its lines can pass for one of ours at the start of a line."""
    return f"\n{indent}".join(printable(strip_control(str(value))).split("\n"))


# The human layouts fit a terminal of this many columns for the usual values (24-character ids,
# short worker ids); a long value (an error, a path) goes on its own indented line instead.
WIDTH = 80
LABEL = 10  # "  label      value": values start in column 13
VALUE_INDENT = " " * (LABEL + 3)


def base_model_lines(base: dict) -> list[str]:
    """The base model the job's stages started from: its name, then the digest and licence (anyone able
    to write the record chose these strings: each is one line of printable text)."""
    def part(key: str) -> str:
        value = base.get(key)
        return one_line(value) if isinstance(value, str) and value else "?"

    return fitted("base", part("name"), f"licence {part('licence')}", part("digest"))


def fitted(label: str, text: str, *tails: str) -> list[str]:
    """``  label      text``, then each of ``tails`` on the same line while it fits in WIDTH, else on
    a line of its own under the value."""
    lines = [f"  {label:<{LABEL}} {text}".rstrip()]
    for tail in tails:
        if len(lines[-1]) + 2 + len(tail) <= WIDTH:
            lines[-1] += "  " + tail
        else:
            lines.append(VALUE_INDENT + tail)
    return lines


def wrapped(text: Any, indent: str) -> list[str]:
    """A record's free text (an error message, a log tail), each of its lines wrapped to WIDTH under
    ``indent``: no line of it starts where ours do."""
    width = max(20, WIDTH - len(indent))
    lines: list[str] = []
    for line in printable(strip_control(str(text))).split("\n"):
        # At spaces only: a URL or a path longer than the width stays whole (copyable), on a line of its own.
        lines += [indent + part for part in textwrap.wrap(line, width, break_on_hyphens=False,
                                                          break_long_words=False)] or [indent.rstrip()]
    return lines


def moment(when: datetime | None, same_day_as: datetime | None = None) -> str:
    """A view's time (UTC) as ``YYYY-MM-DD HH:MM:SSZ``, only ``HH:MM:SSZ`` when on the day of
    ``same_day_as``; ``?`` for none."""
    if when is None:
        return "?"
    same_day = same_day_as is not None and when.date() == same_day_as.date()
    return when.strftime("%H:%M:%SZ" if same_day else "%Y-%m-%d %H:%M:%SZ")


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def _kind(retryable: bool | None, retries_spent: bool | None = None) -> str:
    if retries_spent:
        return "dead-lettered: retries spent"
    return "?" if retryable is None else "retryable" if retryable else "permanent"


def _path_lines(paths: dict) -> list[str]:
    o, lines = one_line, []
    for key, path in paths.items():
        line = f"    {o(key):<18} {o(path)}"
        lines += [line] if len(line) <= WIDTH else [f"    {o(key)}", f"      {o(path)}"]
    return lines


# The latest metrics `status` shows (in the order the stage printed them); the record keeps them all.
LATEST_SHOWN = 8


def progress_lines(job: JobView, now: datetime) -> list[str]:
    """How far (stage k of n, percent, overall percent), how well (step, latest metrics) and how long
    (elapsed in the stage and the attempt, the ETA) from the record's progress (``progress_summary``)."""
    summary = progress_summary(job, now)
    if summary is None:
        return []
    where = f"{known(summary['stage'])} {_percent(summary['percent'])} %"
    if summary["stageIndex"] and summary["stageCount"]:
        where = f"stage {summary['stageIndex']} of {summary['stageCount']}: {where}"
    tails = [f"overall {_percent(summary['overallPercent'])} %"] if summary["overallPercent"] is not None else []
    lines = fitted("progress", where, *tails, f"at {moment(summary['updatedAt'], same_day_as=now)}")
    shown = [f"step {summary['step']}"] if summary["step"] is not None else []
    shown += [f"{one_line(name)[:48]} {value:.4g}" for name, value in list(summary["latest"].items())[:LATEST_SHOWN]]
    if shown:
        lines += fitted("latest", shown[0], *shown[1:])
    times = [f"{format_elapsed(summary[key])} {where_}" for key, where_ in
             (("stageElapsedS", "in this stage"), ("attemptElapsedS", "in this attempt")) if summary[key] is not None]
    if summary["etaAt"] is not None:
        left_s = max(0.0, (summary["etaAt"] - now).total_seconds())
        times.append(f"ETA {moment(summary['etaAt'], same_day_as=now)} (in {format_elapsed(left_s)})")
    if times:
        lines += fitted("elapsed", times[0], *times[1:])
    return lines


def cost_unit(device: str | None) -> str:
    """Trainer seconds are GPU-seconds only where the trainer ran on cuda."""
    return "GPU-s" if device == "cuda" else "CPU-s"


def render_status(status: JobStatus, now: datetime | None = None) -> str:
    """The job as a block of lines, drawn from the views only: a field that is not valid shows ``?``.
    ``now`` (default: this host's clock) is what elapsed times and the ETA are counted to."""
    job, profile = status.job, status.profile
    now = datetime.now(UTC) if now is None else now
    lines = [f"job {known(job.id)}: {known(job.status)}  (attempts: {known(job.attempts)})"]
    if job.progress:
        lines += progress_lines(job, now)
    elif job.invalid("progress"):
        lines += fitted("progress", "?")
    if held := job.lease:
        lines += fitted("lease", f"until {moment(held.expires_at)}", f"held by {known(held.owner)}")
    elif job.invalid("lease"):
        lines += fitted("lease", "?")
    spent = job.cost()
    unit = cost_unit(job.trainer_device())
    lines += fitted("cost", f"{spent['gpuSeconds']:.0f} {unit}, of which {spent['wastedGpuSeconds']:.0f} wasted",
                    f"failed attempts: {known(spent['failedAttempts'])}")
    if job.cancel_requested is None:
        lines += fitted("cancel", "?")
    elif job.cancel_requested and job.status != CANCELLED:
        lines += fitted("cancel", "requested")
    if e := job.error:
        lines += fitted("error", f"{known(e.type)} ({_kind(e.retryable, e.retries_spent)})")
        if e.message is not None or job.invalid("error.message"):
            lines += wrapped("?" if e.message is None else e.message, VALUE_INDENT + "| ")
    elif job.invalid("error"):
        lines += fitted("error", "?")
    if isinstance(job.document, dict) and DATASET in job.document:
        lines += fitted("dataset", one_line(dataset_summary(job.document[DATASET])))
    if isinstance(job.document, dict) and QUALITY in job.document:
        lines += quality_lines(job.document[QUALITY])
    if isinstance(job.document, dict) and isinstance(base := job.document.get(BASE_MODEL), dict):
        lines += base_model_lines(base)
    for number, h in enumerate(job.history, 1):
        if h is None:
            lines += fitted(f"attempt {number}", "?")
            continue
        gpu = "" if h.gpu_seconds is None else f"{h.gpu_seconds:.0f} {cost_unit(h.device or job.trainer_device())}"
        end = moment(h.end, same_day_as=h.start) if h.end or job.invalid(f"history[{number - 1}].end") else "…"
        lines += fitted(f"attempt {number}", f"{moment(h.start)} -> {end}  {known(h.outcome)}",
                        *filter(None, [gpu, f"on {known(h.worker)}"]))
        for note in h.notes:  # what its stages left out of the data, say: the user's to act on
            lines += wrapped(f"note from {note.stage or '?'}: {note.text or '?'}", VALUE_INDENT + "| ")
    if job.invalid("history") and not job.history:
        lines += fitted("history", "?")
    if status.logs is not None and job.history:
        lines += fitted("logs", status.logs_command, one_line(status.logs))
    if job.completed_at or job.invalid("completedAt"):
        lines += fitted("completed", moment(job.completed_at))
    if profile is None:
        lines.append(f"profile {known(job.profile_id)}: missing")
    else:
        lines.append(f"profile {known(profile.id)}: {known(profile.status)}")
    files = status.files
    if files and (files[0] or files[1]):
        lines += fitted("files", "committed by this job:")
        lines += _path_lines(files[0]) + _path_lines(files[1])
    elif profile is not None and (profile.model_paths or profile.s3_paths):
        # The profile's paths are another job's (a later claim, or the one before a cancelled or failed job).
        lines += fitted("files", "none committed by this job", "(the profile's paths are another job's)")
    return "\n".join(lines)


def score_text(value: Any) -> str:
    """A score as `status` (and the demo) shows it: two decimals, ``-`` for none (null), ``?`` for what is no number."""
    if value is None:
        return "-"
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.2f}"
    return "?"


def _model_quality(figures: Any) -> str:
    if not isinstance(figures, dict):
        return "?"
    dnsmos, sanity = figures.get("dnsmos"), figures.get("sanity")
    ovrl = dnsmos.get("ovrl") if isinstance(dnsmos, dict) else None if dnsmos is None else "?"
    cer = score_text(figures.get("cer"))
    if figures.get("cer") is None and figures.get("asrUnavailable"):
        cer = f"- ({one_line(figures['asrUnavailable'])[:40]})"
    sane = "?" if not isinstance(sanity, dict) or not isinstance(sanity.get("ok"), bool) else (
        "ok" if sanity["ok"] else "NOT ok")
    return (f"similarity {score_text(figures.get('speakerSimilarity'))}  CER {cer}  "
            f"DNSMOS {score_text(ovrl)}  sanity {sane}")


def quality_lines(value: Any) -> list[str]:
    """The job's evaluation (its record's ``quality``, worker.voice.quality.figures): a line per model,
    the gate's decision and where the report lies; ``?`` for what is not as the worker writes it."""
    if not isinstance(value, dict):
        return fitted("quality", "?")
    models: dict = value["models"] if isinstance(value.get("models"), dict) else {}
    named = [*(f"{one_line(name)}: {_model_quality(figures)}" for name, figures in models.items())]
    if value.get("reference") is not None:
        named.append(f"reference (the recordings): {_model_quality(value['reference'])}")
    lines = fitted("quality", named[0] if named else "?")
    lines += [VALUE_INDENT + line for line in named[1:]]
    gate: dict = value["gate"] if isinstance(value.get("gate"), dict) else {}
    if gate.get("applied") is False:
        lines.append(VALUE_INDENT + "gate: none configured (report only)")
    elif gate.get("passed") is True:
        lines.append(VALUE_INDENT + "gate: passed")
    elif isinstance(gate.get("failed"), list):
        lines += wrapped("gate: below the bar: " + "; ".join(map(str, gate["failed"])), VALUE_INDENT)
    else:
        lines.append(VALUE_INDENT + "gate: ?")
    if isinstance(value.get("report"), str):
        lines += wrapped(f"report: {value['report']}", VALUE_INDENT)
    return lines


def format_elapsed(elapsed_s: float) -> str:
    minutes, seconds = divmod(int(elapsed_s), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{seconds:02d}s"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Watch:
    """How ``status --watch`` shows each poll: on a terminal it redraws the block in place (cursor up,
    clear to the end of the screen) under a line with the time since the watch began; elsewhere (a
    pipe, a file) it prints a block only when it changed, headed by that time."""

    def __init__(self, out: TextIO, every_s: float, *, tty: bool, clock: Callable[[], float] = time.monotonic,
                 columns: Callable[[], int] = lambda: shutil.get_terminal_size().columns):
        self._out, self._every_s, self._tty, self._clock, self._columns = out, every_s, tty, clock, columns
        self._started_s = clock()
        self._last: str | None = None
        self._drawn_rows = 0

    def show(self, block: str) -> None:
        elapsed = format_elapsed(self._clock() - self._started_s)
        if self._tty:
            header = f"every {self._every_s:g} s, {elapsed} since the watch began (Ctrl-C stops)"
            text = f"{header}\n{block}"
            # Back over what the last draw took (a line longer than the terminal took several rows).
            up = f"\x1b[{self._drawn_rows}F\x1b[J" if self._drawn_rows else ""
            width = max(1, self._columns())
            self._drawn_rows = sum(max(1, -(-len(line) // width)) for line in text.split("\n"))
            print(up + text, file=self._out, flush=True)
        elif block != self._last:
            print(block if self._last is None else f"\n[{elapsed} later]\n{block}", file=self._out, flush=True)
        self._last = block


def cmd_status(store: Store, job_id: str, *, as_json: bool, watch_s: float | None = None,
               out: TextIO | None = None, err: TextIO | None = None, sleep=time.sleep,
               clock: Callable[[], float] = time.monotonic, tty: bool | None = None,
               logs_at: Callable[[str], str] | None = None,
               wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> int:
    """With ``watch_s``, polls until the job ends: --json prints one line per poll, the text layout
    goes through ``Watch``. ``logs_at``: where stage logs are shipped (``status_document``). Elapsed
    times and the ETA count to ``wall_clock``."""
    out, err = out or sys.stdout, err or sys.stderr
    watch = None
    if watch_s and not as_json:
        watch = Watch(out, watch_s, tty=out.isatty() if tty is None else tty, clock=clock)
    while True:
        status = status_document(store, job_id, logs_at)
        if status is None:
            print(f"no job {job_id}", file=err)
            return EXIT_NOT_FOUND
        now = wall_clock()
        if as_json:
            print(json.dumps(status.as_json(now)), file=out, flush=True)
        elif watch:
            # Under the block, not on stderr: a line written between two draws would spoil the redraw.
            watch.show("\n".join([render_status(status, now), *status.warnings()]))
        else:
            print(render_status(status, now), file=out, flush=True)
            for line in status.warnings():
                print(line, file=err, flush=True)
        if not watch_s or job_over(status.job):
            return EXIT_OK
        sleep(watch_s)


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([smhdw])", re.ASCII)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_since(text: str) -> datetime | timedelta:
    """``jobs --since``: an ISO 8601 time (UTC when it has no offset), or a duration back from now
    (``90s``, ``30m``, ``2h``, ``7d``, ``1w``) as a timedelta, resolved on the store's clock."""
    if match := _DURATION.fullmatch(text.strip().lower()):
        return timedelta(seconds=float(match[1]) * _UNIT_S[match[2]])
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"must be an ISO 8601 time (2026-12-01T09:00Z) or a duration (30m, 2h, 7d), "
                         f"got {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def render_job_line(job: JobView) -> list[str]:
    """A job in `jobs`: id, status, created, attempts on one line; what it is doing (progress) or
    why it stopped (error) on an indented second line; ``?`` for a field that is not valid."""
    lines = [f"{known(job.id):<24}  {known(job.status):<10}  created {moment(job.created_at):<20}  "
             f"attempts {known(job.attempts)}"]
    if job.status == PROCESSING and (job.progress or job.invalid("progress")):
        p = job.progress
        text = f"  {known(p.stage)} {_percent(p.percent)} % at {moment(p.updated_at)}" if p else "  progress ?"
        lines += [text + (f", lease until {moment(job.lease.expires_at)}" if job.lease
                          else ", lease ?" if job.invalid("lease") else ", no lease")]
    elif job.status in (ERROR, REFUSED) and (job.error or job.invalid("error")):
        e = job.error
        first = printable(strip_control(e.message or "")).split("\n")[0] if e else ""
        if job.status == REFUSED:  # final, not a failure: which bars, first
            text = f"  {known(e.type)}: {first.removeprefix(QUALITY_BAR_PREFIX)}" if e else "  error ?"
        else:
            text = f"  {known(e.type)} ({_kind(e.retryable, e.retries_spent)}): {first}" if e else "  error ?"
        lines += [text if len(text) <= WIDTH else text[:WIDTH - 1] + "…"]
    if job.cancel_requested and job.status not in FINAL_STATUSES:
        lines += ["  cancel requested"]
    return lines


def _job_lines(job: JobView) -> list[str]:
    try:
        return render_job_line(job)
    except Exception as exc:  # noqa: BLE001 - the view is total; a bug in drawing one still must not hide the rest
        return [f"{known(job.id):<24}  (cannot be shown: {type(exc).__name__})"]


def cmd_jobs(store: Store, *, status: str | None = None, since: datetime | timedelta | None = None,
             limit: int = 50, as_json: bool = False, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Each job is read through its own view and drawn on its own: one odd record shows ``?`` and a
    warning on stderr, and every other job is listed as usual."""
    out, err = out or sys.stdout, err or sys.stderr
    if isinstance(since, timedelta):
        since = store.now() - since  # "2h" is two hours on the store's clock, which stamped createdAt
    records = store.list_jobs(status=status, since=since, limit=limit)
    jobs = [job_view(record) for record in records]
    if as_json:
        print(json.dumps([_jsonable(record) for record in records]), file=out)
        for job in jobs:
            for line in warning_lines(job):
                print(line, file=err)
        return EXIT_OK
    kind = f"{status} " if status else ""
    created_since = f" created since {moment(since.astimezone(UTC))}" if since else ""
    if not jobs:
        print(f"no {kind}jobs{created_since}", file=out)
        return EXIT_OK
    more = f" (the newest {limit}: --limit N for more)" if len(jobs) == limit else ""
    print(f"{len(jobs)} {kind}job(s){created_since}, newest first{more}:", file=out)
    for job in jobs:
        for line in _job_lines(job):
            print(line, file=out)
        for line in warning_lines(job):
            print(line, file=err)
    return EXIT_OK


def cancel_outcome(job: JobView | dict, heartbeat_s: float, now: datetime) -> tuple[int, str]:
    """(EXIT_OK when a cancel request can still change anything, else why not as an exit code; what
    happens next) for this job (a record, or a stored document): decided by the store's rules, on the
    stored document as the store's own swap decides, worded from the typed record."""
    view = job_view(job)
    job = view.document
    job_id, status, owner = known(view.id), view.status, known(view.lease.owner if view.lease else None)
    if status in FINAL_STATUSES:
        return EXIT_NOTHING_TO_DO, f"job {job_id} is already {status}: nothing to cancel"
    error = view.error
    if status == ERROR and not (error and error.retryable):
        return EXIT_NOTHING_TO_DO, (f"job {job_id} already failed permanently ({known(error and error.type)}): "
                                    "nothing to cancel")
    if committing(job, now):
        since = moment(view.progress.updated_at if view.progress else None)
        return EXIT_TOO_LATE, (f"job {job_id} is committing on {owner} (since {since}): too late to cancel; "
                               "it ends completed unless the commit fails")
    if status == PROCESSING and lease_live(job, now):
        return EXIT_OK, (f"cancel requested for job {job_id}: the running attempt on {owner} "
                      f"stops at its next heartbeat, within ~{math.ceil(heartbeat_s)} s "
                      "(SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS), and the job ends cancelled")
    if status == PENDING:
        return EXIT_OK, (f"job {job_id} is pending: it will be cancelled when a worker picks it up "
                      "(no training will start)")
    # A retryable error, or processing with a lapsed lease: SQS delivers the message again.
    return EXIT_OK, (f"job {job_id} has no running attempt ({known(status)}, waiting to be retried): it will be "
                  "cancelled when a worker next receives it (no training will start)")


def cmd_cancel(store: Store, job_id: str, *, heartbeat_s: float, out: TextIO | None = None,
               err: TextIO | None = None, now: Callable[[], datetime] | None = None) -> int:
    # Resolved per call, not at import: pytest and wrappers replace sys.stdout after that.
    out, err = out or sys.stdout, err or sys.stderr
    job = store.get_job(job_id)
    if job is None:
        print(f"no job {job_id}", file=err)
        return EXIT_NOT_FOUND
    for line in warning_lines(job_view(job)):
        print(line, file=err)
    # The store's clock by default: it stamped the lease this decides on.
    clock = now or store.now
    code, text = cancel_outcome(job, heartbeat_s, clock())
    # request_cancel re-checks inside the store: a job that finished, or began committing, since the
    # read is not touched. Read it again to say which.
    if code == EXIT_OK and not store.request_cancel(job_id):
        code, text = cancel_outcome(store.get_job(job_id) or job, heartbeat_s, clock())
        if code == EXIT_OK:
            code, text = EXIT_NOTHING_TO_DO, f"job {job_id}: the store refused the request: nothing to cancel"
    if code != EXIT_OK:
        print(text, file=err)
        return code
    print(text, file=out)
    return EXIT_OK


def cmd_health(_settings: Settings | None = None, out: TextIO | None = None,
               environ: Mapping[str, str] | None = None) -> int:
    """``python -m worker.core.healthcheck``'s very answer (the worker's settings are not read: see there)."""
    return healthcheck_main(environ, out=out)


# ------------------------------------------------------------ the dead-letter queue

def format_age(age_s: float | None) -> str:
    if age_s is None:
        return "?"
    minutes, _ = divmod(int(age_s), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days else (f"{hours}h{minutes:02d}m" if hours else f"{minutes}m")


def render_letter(summary: dict) -> str:
    """One message as a block: job, receives and age on its first line, the message id and the error
    on indented lines below, whatever the attributes hold (anyone who can send to the queue set them)."""
    o = one_line
    error = (f"{o(summary['errorType'])}: {o(summary['errorMessage'] or '-')}" if summary["errorType"]
             else "(moved by SQS's redrive policy: no error attributes)")
    lines = [f"job {o(summary['jobId'] or '-')}  receives {o(summary['receiveCount'])}  "
             f"age {format_age(summary['ageSeconds'])}",
             f"  message  {o(summary['messageId'])}"]
    first, *rest = textwrap.wrap(error, WIDTH - 11, break_on_hyphens=False, break_long_words=False) or ["-"]
    return "\n".join([*lines, f"  error    {first}", *(" " * 11 + part for part in rest)])


def cmd_dlq_list(dlq: DeadLetterQueue, *, as_json: bool, max_messages: int = 1000,
                 out: TextIO | None = None) -> int:
    out = out or sys.stdout
    letters = dlq.peek(max_messages)
    dlq.release(letters)
    now_s = dlq.now_s()
    summaries = sorted((letter.summary(now_s) for letter in letters),
                       key=lambda s: -(s["ageSeconds"] or 0))
    if as_json:
        print(json.dumps(summaries), file=out)
    elif not summaries:
        print(f"the dead-letter queue is empty:\n  {dlq.url}", file=out)
    else:
        head = f"{len(summaries)} message(s), oldest first, in"
        print(f"{head} {dlq.url}:" if len(head) + len(dlq.url) < WIDTH else f"{head}\n  {dlq.url}:", file=out)
        for summary in summaries:
            print(render_letter(summary), file=out)
    return EXIT_OK


@contextmanager
def first_interrupt_stops() -> Iterator[Callable[[], bool]]:
    """Yields "was Ctrl-C pressed?": the first Ctrl-C only asks to stop between messages, a second one
    interrupts at once (KeyboardInterrupt). Outside the main thread signals cannot be caught: never set."""
    # A plain flag, not a threading.Event: the handler runs between any two bytecodes of the main
    # thread, also while that thread holds the Event's lock, and taking it again there deadlocks.
    pressed = [False]
    if threading.current_thread() is not threading.main_thread():
        yield lambda: pressed[0]
        return

    def on_sigint(_signum, _frame):
        # No printing here: the handler can run in the middle of another write to stderr.
        if pressed[0]:
            raise KeyboardInterrupt
        pressed[0] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: pressed[0]
    finally:
        signal.signal(signal.SIGINT, previous)


class Progress:
    """ "moved 10 of ~42" on stderr every ``every`` messages and at least every ``interval_s``."""

    def __init__(self, err: TextIO, *, every: int = 10, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self._err, self._every, self._interval_s, self._clock = err, every, interval_s, clock
        self._last = clock()

    def __call__(self, moved: int, expected: int) -> None:
        now = self._clock()
        if moved % self._every == 0 or now - self._last >= self._interval_s:
            print(f"moved {moved} of ~{expected}", file=self._err, flush=True)
            self._last = now


def cmd_dlq_redrive(dlq: DeadLetterQueue, *, max_messages: int | None, fallback: bool,
                    out: TextIO | None = None, err: TextIO | None = None,
                    clock: Callable[[], float] = time.monotonic) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    with first_interrupt_stops() as stop:
        result = dlq.redrive(max_messages=max_messages, fallback=fallback,
                             progress=Progress(err, clock=clock), stop=stop)
    if result.method == MOVE_TASK and result.error is None:
        print(f"started a message move task ({result.task_handle}): the dead-letter queue's messages "
              f"go back to {dlq.source_url} in the background; `dlq list` shows what is left", file=out)
        return EXIT_OK
    if result.method == RECEIVE_SEND_DELETE:
        print(f"moved {result.moved} message(s) back by receive, send, delete to\n  {dlq.source_url}\n"
              f"  because: {result.fallback_reason}\n"
              f"  ~{'?' if result.expected is None else result.expected} were in the dead-letter queue "
              "at the start", file=out)
    if result.came_back:
        print(f"  {result.came_back} message(s) this run had moved came back to the dead-letter queue "
              "(dead-lettered again): left there, not moved twice; see `dlq list`", file=out)
    for message_id in result.not_deleted:
        print(f"  {message_id}: sent, but its delete from the dead-letter queue failed: it is in both "
              "queues (the worker acknowledges the duplicate without work)", file=out)
    if result.unsettled:
        print(f"  {result.unsettled}: interrupted between its send and its delete: it may be in both "
              "queues (the worker acknowledges the duplicate without work)", file=out)
    if result.interrupted:
        print(f"redrive interrupted after moving {result.moved} message(s); the rest stay in the "
              "dead-letter queue", file=err)
        return EXIT_INTERRUPTED
    if result.error:
        print(f"redrive stopped: {error_line(scrub(result.error))}", file=err)
        return EXIT_FAILED
    return EXIT_OK
