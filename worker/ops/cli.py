"""The command line: ``python -m worker [COMMAND]``; ``run`` (the daemon) is the default."""

from __future__ import annotations

import os
import sys
import textwrap
from typing import TYPE_CHECKING

import structlog

from worker import __version__
from worker.core.daemon import (
    EXIT_CONFIG,
    EXIT_CRASHED,
    EXIT_HOST_UNFIT,
    EXIT_OK,
    Requests,
    StartUpStopped,
    relay_signals,
    run_worker,
)
from worker.core.errors import ConfigError, WorkerError
from worker.core.hardening import make_undumpable
from worker.core.logs import configure_logging
from worker.settings import Settings, daemon_problems, load_settings, missing

if TYPE_CHECKING:
    import argparse

    from pipeline.errors import HostUnfit

log = structlog.get_logger(__name__)

WORK_FILES_UMASK = 0o027

DESCRIPTION = """\
voice-worker: trains voice-cloning models from jobs on an SQS queue.
Configured by environment variables (see config/worker.env.example)."""


def _fail(problems: list[str]) -> int:
    for line in problems:
        print(line, file=sys.stderr)
    return EXIT_CONFIG


def _queue_url(settings: Settings, *also: str) -> str:
    """SQS_QUEUE_URL, or ConfigError (exit 2) naming it and whichever of ``also`` is missing too."""
    problems = missing(settings, "queue", *also)
    if problems or not settings.sqs_queue_url:
        raise ConfigError(problems)
    return settings.sqs_queue_url


def _store(settings: Settings, access: str = "create"):
    from worker.voice.records import open_store

    return open_store(settings.store_config(), access=access)


def _client(service: str, settings: Settings):
    from worker.core.aws import make_client

    return make_client(service, settings.aws_config())


def cmd_run(settings: Settings, _args) -> int:
    # First of all: a stage runs as our user, and must not read our credentials from /proc/<pid>/environ.
    if why_not := make_undumpable():
        log.warning("worker.dumpable", reason=why_not,
                    note="processes of this user can read the worker's environment")
    # Then, before anything slow: a signal during the start-up is heard, not met by its default action
    # (SIGUSR1 and SIGUSR2 end a process), and a drain then is not undone by Restart=on-failure.
    requests = Requests()
    relay = relay_signals(requests, json_stacks=settings.log_format == "json")
    try:
        return _run_daemon(settings, requests)
    finally:
        relay.uninstall()


def _run_daemon(settings: Settings, requests: Requests) -> int:
    problems = daemon_problems(settings)
    if problems:
        return _fail(problems)
    from pipeline.errors import HostUnfit
    from worker.app import build_app  # the heavy wiring, only for the daemon

    # Models, datasets and logs are the user's voice data: not world-readable, also in a container
    # whose runtime hands the process umask 022.
    os.umask(WORK_FILES_UMASK)

    try:
        app = build_app(settings, wait=requests.wait)
    except StartUpStopped as stopped:
        return _stopped_at_start_up(stopped.reason)
    except HostUnfit as exc:
        return _host_unfit(settings, exc, requests)
    except ConfigError as exc:
        return _fail(exc.problems)
    except WorkerError as exc:
        log.error("worker.startup_failed", error=str(exc), error_type=exc.error_type)
        # A stop or drain asked for while the step failed still stands: exit 1 would have systemd start
        # the worker again, and take jobs.
        return _stopped_at_start_up(reason) if (reason := requests.reason) else EXIT_CRASHED
    app.start()
    return run_worker(app.worker, close=app.close, pulse=app.pulse, requests=requests)


def _host_unfit(settings: Settings, exc: HostUnfit, requests: Requests) -> int:
    """A host check failed: one line, the health check told, no job taken, exit 7."""
    from worker.core.healthcheck import mark_unfit

    log.error("worker.host_unfit", check=exc.check, problem=exc.problem)
    if settings.liveness_file:
        mark_unfit(settings.liveness_file, str(exc))
    # A stop or drain asked for meanwhile still stands, as for a failed start-up (exit 0: not restarted).
    return _stopped_at_start_up(reason) if (reason := requests.reason) else EXIT_HOST_UNFIT


def _stopped_at_start_up(reason: str) -> int:
    log.info("worker.stopped", reason=reason, during="start-up")
    return EXIT_OK


def cmd_demo(_settings, args) -> int:
    from worker.ops.demo import run_demo

    return run_demo(real=args.real, store=args.store)


def cmd_dev_stack(_settings, args) -> int:
    from worker.ops.devstack import run_dev_stack

    try:
        return run_dev_stack(port=args.port, store=args.store, **({"state_dir": args.dir} if args.dir else {}))
    except RuntimeError as exc:
        print(f"dev-stack failed: {exc}", file=sys.stderr)
        return EXIT_CRASHED


def cmd_submit(settings: Settings, args) -> int:
    from worker.ops.commands import cmd_submit as submit

    queue_url = _queue_url(settings, "store")
    sqs = _client("sqs", settings)  # first: a settings problem must not leave a new store file behind
    source = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
    with source:
        return submit(lambda: _store(settings), sqs, queue_url, source, as_json=args.json,
                      policy=settings.input_policy())


def cmd_jobs(settings: Settings, args) -> int:
    from worker.ops.commands import cmd_jobs as jobs

    if problems := missing(settings, "store"):
        return _fail(problems)
    with _store(settings, "read") as store:
        return jobs(store, status=args.status, since=args.since, limit=args.limit, as_json=args.json)


def cmd_status(settings: Settings, args) -> int:
    from worker.ops.commands import cmd_status as status

    if problems := missing(settings, "store"):
        return _fail(problems)
    with _store(settings, "read") as store:
        return status(store, args.job_id, as_json=args.json, watch_s=args.watch, logs_at=_logs_at(settings))


def _logs_at(settings: Settings):
    """Where a job's stage logs are shipped (for `status`), or None when this deployment ships none."""
    import functools

    from worker.voice.stage_logs import logs_location

    if not settings.s3_bucket or settings.log_ship_interval_s <= 0:
        return None
    return functools.partial(logs_location, settings.s3_bucket, settings.s3_prefix)


def cmd_logs(settings: Settings, args) -> int:
    from worker.ops.logs import cmd_logs as logs
    from worker.ops.logs import shipped_logs

    if problems := missing(settings, "store", "bucket"):
        return _fail(problems)
    shipped = shipped_logs(settings, _client("s3", settings))
    assert shipped is not None  # the bucket was checked above
    with _store(settings, "read") as store:
        return logs(shipped, store, args.job_id, stage=args.stage, attempt=args.attempt, follow=args.follow)


def cmd_cancel(settings: Settings, args) -> int:
    from worker.ops.commands import cmd_cancel as cancel

    if problems := missing(settings, "store"):
        return _fail(problems)
    with _store(settings, "existing") as store:
        return cancel(store, args.job_id, heartbeat_s=settings.heartbeat_interval_s)


def cmd_doctor(settings: Settings, _args) -> int:
    from pipeline.config import load_pipeline_config
    from worker.ops.doctor import report, run_checks

    if problems := missing(settings, "queue", "store", "bucket"):
        return _fail(problems)
    checks = run_checks(settings, sqs=_client("sqs", settings), s3=_client("s3", settings),
                        sts=_client("sts", settings), open_store=lambda s: _store(s, "read"),
                        load_pipeline=load_pipeline_config)
    return report(checks)


def cmd_health(settings: Settings | None, _args) -> int:
    from worker.ops.commands import cmd_health as health

    return health(settings)


def cmd_workers(settings: Settings, args) -> int:
    from worker.ops.workers_view import cmd_workers as workers

    if problems := missing(settings, "store"):
        return _fail(problems)
    with _store(settings, "read") as store:
        return workers(store, as_json=args.json, default_interval_s=settings.presence_interval_s)


def cmd_reconcile(settings: Settings, _args) -> int:
    from worker.core.metrics import Metrics
    from worker.ops.reconcile import Reconciler
    from worker.ops.reconcile import cmd_reconcile as reconcile

    queue_url = _queue_url(settings, "store")
    sqs = _client("sqs", settings)  # a settings problem first, before any store connection
    try:
        with _store(settings, "existing") as store:
            reconciler = Reconciler(store, sqs, queue_url,
                                    stale_after_s=settings.reconcile_stale_s,
                                    pending_after_s=settings.reconcile_pending_after_s,
                                    metrics=Metrics.from_config(settings.metrics_config()))
            return reconcile(reconciler)
    except ConfigError:
        raise  # a settings problem: main prints its line and exits 2
    except WorkerError as exc:
        print(f"reconcile failed: {exc}", file=sys.stderr)
        return 1


def cmd_dlq(settings: Settings, args) -> int:
    from worker.ops.commands import cmd_dlq_list, cmd_dlq_redrive
    from worker.ops.dlq import DeadLetterQueue

    queue_url = _queue_url(settings)
    max_messages, fallback = getattr(args, "max", None), getattr(args, "fallback", False)  # redrive's only
    if max_messages is not None and max_messages < 1:
        return _fail([f"--max must be at least 1, got {max_messages}"])
    try:
        dlq = DeadLetterQueue.of(_client("sqs", settings), queue_url)
        if dlq is None:
            return _fail([f"{queue_url} has no RedrivePolicy: there is no dead-letter queue"])
        if args.action == "list":
            return cmd_dlq_list(dlq, as_json=args.json)
        return cmd_dlq_redrive(dlq, max_messages=max_messages, fallback=fallback)
    except ConfigError:
        raise  # a settings problem: main prints its line and exits 2
    except WorkerError as exc:
        from worker.ops.commands import error_line

        print(f"dlq {args.action} failed: {error_line(exc)}", file=sys.stderr)
        return 1


def cmd_queue(settings: Settings, args) -> int:
    from worker.ops.queue_view import cmd_queue as queue

    queue_url = _queue_url(settings)
    return queue(_client("sqs", settings), queue_url, _client("cloudwatch", settings), as_json_output=args.json)


def cmd_ui(settings: Settings, args) -> int:
    from worker.ops.ui.wiring import serve_ui

    if problems := missing(settings, "store"):
        return _fail(problems)
    with _store(settings, "read") as store:
        return serve_ui(settings, store, host=args.host, port=args.port,
                        clients=lambda service: _client(service, settings))


def cmd_schema(_settings, _args) -> int:
    from worker.voice.message import message_schema_text

    try:
        sys.stdout.write(message_schema_text())
        sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()
    return EXIT_OK


def _exits(specific: str, store_file: bool = False, usage: str = "") -> str:
    """The exit-code paragraph of an operator command's help: its own codes, then the shared ones."""
    settings = f"2 settings{usage}, one line each on stderr" + (
        " (also a STORE_URL file that does not exist)" if store_file else "")
    return textwrap.fill(f"exit codes: {specific}; {settings}; 130 Ctrl-C; 141 quietly, when the reader of "
                         "stdout went away (`| head`)", 96)

DLQ_LIST_TEXT = (
    "Id, job id, receive count, error attributes and age of each message in the dead-letter queue.\n"
    "Looking has to receive (SQS has no other way): each message is hidden for a few seconds while\n"
    "the list is made, then visible again; nothing is deleted. --json prints a JSON array.\n\n"
    + _exits("0 listed (also none); 1 an SQS call failed", usage=" or no dead-letter queue")
    + "\n\nexample:\n  python -m worker dlq list --json")
DLQ_REDRIVE_TEXT = (
    "StartMessageMoveTask back to SQS_QUEUE_URL (everything, in the background). With --max N or\n"
    "--fallback (or where the service lacks the move task): receive -> send -> delete, never deleting\n"
    "before the send succeeded, moving at most the messages there at the start, each once, with\n"
    "progress on stderr. The first Ctrl-C stops after the current message; a second one at once.\n\n"
    + _exits("0 moved, or move task started; 1 an SQS call failed (it says how far it got)",
             usage=", no dead-letter queue, or --max below 1")
    + "\n\nexample:\n  python -m worker dlq redrive --max 10")

COMMANDS = {
    "run": (cmd_run, True, "run the worker daemon (the default)",
            "Take jobs from SQS_QUEUE_URL until SIGTERM/SIGINT, or until drained by SIGUSR2 (the job in\n"
            "flight runs to its end, no other is taken). SIGUSR1 prints every thread's stack. All three\n"
            "are heard from the start of the start-up on.\n\n"
            "exit codes: 0 stopped on SIGTERM/SIGINT or drained (SIGUSR2), also during the start-up, even\n"
            "one that was failing; 1 crashed, or could not start (store or queue\n"
            "unreachable after retries); 2 settings: one line each on stderr (missing region, a queue that\n"
            "does not exist, a bad pipeline config, a clock off from the store's, ...); 7 host unfit: a\n"
            "host check failed before any job was received (the base model cannot be fetched or does not\n"
            "verify, a stage needs a GPU the trainer does not see, WORK_ROOT gone, read-only or below\n"
            "WORK_MIN_FREE_BYTES), logged as one worker.host_unfit line",
            "SQS_QUEUE_URL=https://sqs.eu-west-1.amazonaws.com/123/jobs MONGO_URI=mongodb://db/voice \\\n"
            "    S3_BUCKET=voice-models python -m worker run"),
    "demo": (cmd_demo, False, "run one sample job end to end on a local SQS/S3 server",
             "Start a local SQS/S3 server (moto), use the SQLite store, submit a sample job from the\n"
             "shipped recordings and run the real worker and pipeline until it completes.\n"
             "Needs no configuration and no network.\n\n"
             "--real runs the real trainers instead (config/pipeline.real.toml, trainers/.venv) and\n"
             "writes a WAV of a sentence spoken by the cloned voice (make demo-real).\n\n"
             "exit codes: 0 the job completed (with --real: and the WAV was written); 1 it did not",
             "python -m worker demo\n  python -m worker demo --real"),
    "dev-stack": (cmd_dev_stack, False, "start a persistent local SQS/S3 stack for the dev loop",
                  "Start a local SQS/S3 server (moto) on 127.0.0.1:PORT with the queue, its dead-letter\n"
                  "queue and redrive policy, the model and recordings buckets and the sample recordings;\n"
                  "write every setting to DIR/env.sh and wait until Ctrl-C. Records (SQLite) persist in DIR;\n"
                  "queues and buckets live in the server's memory. See docs/operations.md, \"The local dev loop\".\n\n"
                  "exit codes: 0 stopped on Ctrl-C/SIGTERM; 1 the server did not start (port in use)",
                  "python -m worker dev-stack\n  . var/dev/env.sh && python -m worker run"),
    "submit": (cmd_submit, True, "create a job's records and enqueue it",
               "FILE (or - for stdin) holds a JSON object with the message's fields. jobId and _doc are\n"
               "generated when absent; an optional idempotencyKey makes a repeated submit return the\n"
               "same job id without enqueuing again, and refuses (exit 6) one whose other fields differ.\n"
               "Prints the job id; --json prints {\"jobId\": \"...\", \"created\": true|false}. Creates a\n"
               "missing STORE_URL file (never for a refused submission).\n\n"
               + _exits("0 submitted (or already submitted with this key); 1 store, queue or file failure; "
                        "6 the idempotencyKey was used for a different submission (nothing created or sent)",
                        usage=" or a submission that is not valid JSON or not a valid job"),
               "python -m worker submit job.json\n  echo '{...}' | python -m worker submit - --json"),
    "jobs": (cmd_jobs, True, "list jobs, newest first: status, created, attempts, progress or error",
             "List up to --limit jobs (default 50), newest first, optionally only those in --status and\n"
             "those created since --since (ISO 8601, e.g. 2026-12-01T09:00Z, or a duration back from now:\n"
             "90s, 30m, 2h, 7d). --json prints a JSON array of the job records. Opens a STORE_URL file\n"
             "read-only and never creates one.\n\n"
             + _exits("0 listed (also none); 1 store failure", store_file=True,
                      usage=", or an unknown --status, a bad --since or --limit"),
             "python -m worker jobs --status processing --since 2h"),
    "status": (cmd_status, True, "show a job: status, attempts, progress, error, its files",
               "Print the job and profile records, and the files the job committed (a job that did not\n"
               "complete has none: the profile's belong to another job). A running job shows stage k of n,\n"
               "its percent and the overall percent, the step and latest metrics, the time elapsed in the\n"
               "stage and the attempt, the ETA, and the worker holding it; the cost is GPU-s when the\n"
               "trainer ran on cuda, CPU-s otherwise. --json prints {\"job\": {...}, \"progress\": {...},\n"
               "\"costUnit\": ..., \"profile\": {...}, \"cost\": {...}, \"files\": {...} or null,\n"
               "\"problems\": [...]}. A field another writer left malformed shows ?, with a warning line\n"
               "naming it on stderr (in \"problems\" with --json). --watch polls until the job ends: on a\n"
               "terminal the block is redrawn in place, elsewhere printed again only when it changed,\n"
               "with the time since the watch began. Opens a STORE_URL file read-only and never creates one.\n\n"
               + _exits("0 shown; 1 store failure; 3 no such job", store_file=True,
                        usage=" or a --watch that is not a positive number"),
               "python -m worker status 665f1c2e9b1e8a0012ab34cd\n"
               "  python -m worker status 665f1c2e9b1e8a0012ab34cd --watch 2"),
    "logs": (cmd_logs, True, "print a job's stage logs, shipped to S3 while they were written",
             "Every attempt's step logs (download, dataset, each stage), oldest first, each under a header\n"
             "naming its attempt and step, read from S3_BUCKET under S3_PREFIX/.logs/JOB_ID/: no access to\n"
             "the worker's disk is needed, and they outlive its host. Workers ship them every\n"
             "LOG_SHIP_INTERVAL_SECONDS while a step writes, and once more when the attempt ends. --stage and\n"
             "--attempt narrow the output; --follow keeps printing what is shipped next until the job ends\n"
             "(as `status --watch`), or Ctrl-C. Opens a STORE_URL file read-only and never creates one.\n\n"
             + _exits("0 shown (also none shipped yet, said on stderr); 1 an S3 or store failure; 3 no such job",
                      store_file=True),
             "python -m worker logs 665f1c2e9b1e8a0012ab34cd --stage train_full --follow"),
    "cancel": (cmd_cancel, True, "request a job's cancellation",
               "A running attempt stops at its next heartbeat (SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS) and the\n"
               "job ends cancelled; a pending job ends cancelled when a worker receives it, before any\n"
               "training. Says which applies; once the running attempt has begun committing its results\n"
               "it is too late, and nothing is requested. Never creates a STORE_URL file.\n\n"
               + _exits("0 cancel requested; 1 store failure; 3 no such job; 4 nothing to cancel (completed, "
                        "cancelled, or failed permanently); 5 too late: the job is committing",
                        store_file=True),
               "python -m worker cancel 665f1c2e9b1e8a0012ab34cd"),
    "doctor": (cmd_doctor, True, "check credentials, queue, DLQ, bucket, store and pipeline config",
               "One PASS/FAIL/WARN line per check (a WARN leaves the exit code alone). Opens a STORE_URL\n"
               "file read-only and never creates one.\n\n"
               + _exits("0 every check passed; 1 a check failed (a missing STORE_URL file is a FAIL)"),
               "python -m worker doctor"),
    "health": (cmd_health, False, "exit 0 while the running worker's liveness file is fresh",
               "For container health checks: LIVENESS_FILE must be set for the worker and this command.\n"
               "Unhealthy too once the queue or the store has not answered the worker for\n"
               "HEALTH_UNREACHABLE_AFTER_SECONDS. The same check as python -m worker.core.healthcheck: it\n"
               "reads only LIVENESS_FILE, LIVENESS_MAX_AGE_SECONDS and HEALTH_UNREACHABLE_AFTER_SECONDS (the\n"
               "worker writes its limits into the file), so no other setting changes its answer.\n\n"
               "exit codes: 0 healthy; 1 unhealthy (file stale or missing, LIVENESS_FILE unset, a limit that\n"
               "is not a number of seconds, the queue or the store unreachable, the host unfit); 130 Ctrl-C",
               "LIVENESS_FILE=/tmp/voice-worker.alive python -m worker health"),
    "reconcile": (cmd_reconcile, True, "one pass over stranded jobs: lost workers, lost messages, dead letters",
                  "A processing job whose lease ended RECONCILE_STALE_AFTER_SECONDS ago -> error (worker lost);\n"
                  "a pending job never enqueued after RECONCILE_PENDING_AFTER_SECONDS -> enqueued again, once;\n"
                  "a job whose message is in the DLQ -> error \"dead-lettered after N receives\".\n"
                  "Idempotent; run it on a schedule (config/voice-worker-reconcile.timer). Never creates a\n"
                  "STORE_URL file.\n\n"
                  + _exits("0 every rule ran; 1 a rule, the store or the queue failed", store_file=True),
                  "python -m worker reconcile"),
    "dlq": (cmd_dlq, True, "list the dead-letter queue, or move its messages back",
            "list: id, job id, receive count, error attributes and age of each message (it stays there).\n"
            "redrive: move them back to SQS_QUEUE_URL. `dlq list --help` and `dlq redrive --help` say more.\n\n"
            + _exits("0 listed, moved, or move task started; 1 an SQS call failed (redrive says how far it got)",
                     usage=", no dead-letter queue, or --max below 1"),
            "python -m worker dlq list --json\n  python -m worker dlq redrive --max 10"),
    "queue": (cmd_queue, True, "show the job queue's depth and age, and its dead-letter queue's depth",
              "Visible, in flight and delayed messages (SQS's approximate counts: nothing is received, so\n"
              "looking changes no message), the age of the oldest message (CloudWatch's\n"
              "ApproximateAgeOfOldestMessage, the newest datapoint of 15 minutes, or why there is none), and\n"
              "the dead-letter queue's depth. --json prints {\"queue\": {...}, \"deadLetters\": {...} or null}.\n\n"
              + _exits("0 shown; 1 an SQS call failed"),
              "python -m worker queue --json"),
    "ui": (cmd_ui, True, "serve a read-only web page: jobs, a job's progress and loss curve, workers, queue",
           "Serve the jobs list (filters: status, since, id text), each job's page (stages, progress and ETA\n"
           "updating without a reload, loss curves, quality scores, base model, the stage log's tail), the\n"
           "workers and the queue, on http://HOST:PORT/ until Ctrl-C. GET only (anything else is 405),\n"
           "no settings or credentials shown; loopback by default. Opens a STORE_URL file read-only and\n"
           "never creates one; without SQS_QUEUE_URL the queue page says so.\n\n"
           + _exits("0 stopped by Ctrl-C; 1 store failure, or the port is taken", store_file=True),
           "python -m worker ui --port 8765"),
    "workers": (cmd_workers, True, "list the workers: state, job, for how long, last seen; stale ones marked",
                "Every worker that wrote a presence record (each does on its heartbeat tick, idle or busy,\n"
                "and deletes it on a clean exit): its id, state (idle, working, stopping, unfit), the job\n"
                "it runs, how long it has been in that state, when it was last seen, its device, version\n"
                "and host. A worker silent for over 3 of its ticks and 30 s is marked STALE (crashed,\n"
                "killed, or cut off from the store); records unseen for a day are dropped. --json prints\n"
                "{\"now\": ..., \"workers\": [...]} with stale, forS and seenAgoS on each. Opens a STORE_URL\n"
                "file read-only and never creates one.\n\n"
                + _exits("0 shown; 1 store failure", store_file=True),
                "python -m worker workers --json"),
    "schema": (cmd_schema, False, "print the job message's JSON Schema, for the teams that send jobs",
               "Print the JSON Schema (draft 2020-12) of the SQS message body, generated from the model the\n"
               "worker validates every message with (worker/voice/message.py); docs/job-message.schema.json is\n"
               "this output. Needs no configuration. The deployment's input policy (the s3:// scope,\n"
               "MAX_RECORDINGS_PER_JOB, MAX_TEXT_CHARS) is a setting: the schema describes it, not its values.\n\n"
               "exit codes: 0 printed; 141 quietly, when the reader of stdout went away (`| head`)",
               "python -m worker schema > docs/job-message.schema.json"),
}


def watch_seconds(text: str) -> float:
    """--watch SECONDS: a finite number above zero (argparse exits 2 with the message otherwise)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def positive_count(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def since_argument(text: str):
    """--since: an ISO 8601 time (UTC when it names no offset) or a duration back from now (30m, 2h)."""
    import argparse

    from worker.ops.commands import parse_since

    try:
        return parse_since(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m worker", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"voice-worker {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (func, needs_settings, summary, text, example) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=f"{text}\n\nexample:\n  {example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func, needs_settings=needs_settings)
        if name == "dev-stack":
            from pathlib import Path

            p.add_argument("--port", type=int, default=4566, help="loopback port (default 4566)")
            p.add_argument("--dir", type=Path, default=None,
                           help="where env.sh and records.db go (default var/dev in the checkout)")
        if name in ("dev-stack", "demo"):
            p.add_argument("--store", choices=("sqlite", "mongo"), default="sqlite",
                           help="where the records live: a SQLite file (default) or a local MongoDB server")
        if name == "demo":
            p.add_argument("--real", action="store_true",
                           help="the real trainers (trainers/.venv) and a WAV spoken by the cloned voice")
        if name == "submit":
            p.add_argument("file", help="JSON file with the message's fields, or - for stdin")
            p.add_argument("--json", action="store_true", help='print {"jobId": "...", "created": true|false}')
        elif name in ("status", "cancel", "logs"):
            p.add_argument("job_id")
        if name == "dlq":
            # Each action its own parser: its own help, and an option of the other one is an error.
            actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
            listing = actions.add_parser(
                "list", help="show the DLQ's messages; they stay there",
                description=DLQ_LIST_TEXT, formatter_class=argparse.RawDescriptionHelpFormatter)
            listing.add_argument("--json", action="store_true", help="print a JSON array")
            redrive = actions.add_parser(
                "redrive", help="move the DLQ's messages back to SQS_QUEUE_URL",
                description=DLQ_REDRIVE_TEXT, formatter_class=argparse.RawDescriptionHelpFormatter)
            redrive.add_argument("--max", type=int, default=None, metavar="N",
                                 help="move at most N messages (receive -> send -> delete)")
            redrive.add_argument("--fallback", action="store_true",
                                 help="receive -> send -> delete even where StartMessageMoveTask exists")
        if name == "ui":
            p.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default 127.0.0.1: this machine only)")
            p.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
        if name == "logs":
            p.add_argument("--stage", default=None, metavar="NAME", help="only this step's logs (train_full, dataset)")
            p.add_argument("--attempt", type=positive_count, default=None, metavar="N", help="only attempt N's logs")
            p.add_argument("--follow", action="store_true", help="keep printing what is shipped until the job ends")
        if name in ("queue", "workers"):
            p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print one JSON object")
            p.add_argument("--watch", type=watch_seconds, nargs="?", const=2.0, default=None, metavar="SECONDS",
                           help="repeat every SECONDS (default 2) until the job ends")
        if name == "jobs":
            from worker.voice.records.rules import CANCELLED, COMPLETED, ERROR, PENDING, PROCESSING, REFUSED

            p.add_argument("--status", choices=(PENDING, PROCESSING, ERROR, COMPLETED, CANCELLED, REFUSED),
                           default=None, help="only jobs in this status")
            p.add_argument("--since", type=since_argument, default=None, metavar="TIME",
                           help="only jobs created at or after TIME: ISO 8601, or a duration back (2h, 30m)")
            p.add_argument("--limit", type=positive_count, default=50, metavar="N",
                           help="at most N jobs (default 50)")
            p.add_argument("--json", action="store_true", help="print a JSON array of the job records")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in ([], ["run"]):
        # The daemon has no options to parse: argparse and the other commands' help stay unloaded.
        return _run_command(cmd_run, "run", None)
    args = build_parser().parse_args(argv)
    if args.command is None:  # no command after all: the daemon, as before
        return _run_command(cmd_run, "run", None)
    if args.command == "health":
        # No settings: the answer must be the container check's, whatever else the environment holds.
        return _guarded(args.func, args.command, None, args)
    if not args.needs_settings:
        return args.func(None, args)
    return _run_command(args.func, args.command, args)


def _run_command(func, command: str, args) -> int:
    try:
        settings = load_settings()
    except ConfigError as exc:
        return _fail(exc.problems)
    configure_logging(settings.log_level, settings.log_format,
                      fields={"worker_id": settings.worker_id, "version": __version__})
    if settings.tracing_enabled:
        from worker.core import tracing  # OpenTelemetry only when asked for

        try:
            tracing.enable()
        except ConfigError as exc:
            return _fail(exc.problems)
    if command == "run":
        return func(settings, args)  # the daemon reports its own failures
    return _guarded(func, command, settings, args)


def _guarded(func, command: str, settings: Settings | None, args) -> int:
    """An operator command's run: every way it can end is one line and an exit code."""
    try:
        code = func(settings, args)
        sys.stdout.flush()  # a reader that has gone is found here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except ConfigError as exc:
        return _fail(exc.problems)
    except KeyboardInterrupt:
        from worker.ops.commands import EXIT_INTERRUPTED  # not at the top: the daemon never needs the commands

        print(f"{command} interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (WorkerError, OSError) as exc:
        from worker.ops.commands import error_line

        # An operator command: one readable line, not a traceback.
        print(f"{command} failed: {error_line(exc)}", file=sys.stderr)
        return EXIT_CRASHED
    except Exception as exc:  # noqa: BLE001 - e.g. a store's decoder refusing another writer's record
        from worker.ops.commands import error_line

        # Still one line, as docs/operations.md promises for any failure; its type says where to look.
        print(f"{command} failed: {type(exc).__name__}: {error_line(exc)}", file=sys.stderr)
        return EXIT_CRASHED


# What a shell reports for a command killed by SIGPIPE (128 + 13), as for `git log | head`.
EXIT_READER_GONE = 141


def _reader_gone() -> int:
    """stdout's reader (``head``, ``less``) has gone: stop quietly, as git does, exit 141."""
    # What is still buffered for stdout would fail again at exit, with a message: stdout goes to
    # /dev/null from here on.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # no file descriptor behind sys.stdout (a wrapper): nothing is flushed to a pipe at exit
    return EXIT_READER_GONE
