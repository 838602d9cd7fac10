"""The command line: ``python -m worker [run]`` starts the daemon."""

from __future__ import annotations

import argparse
import sys

import structlog

from worker.daemon import EXIT_CONFIG, EXIT_CRASHED, run_worker
from worker.errors import ConfigError, WorkerError
from worker.logs import configure_logging
from worker.settings import Settings, daemon_problems, load_settings

log = structlog.get_logger(__name__)

DESCRIPTION = """\
voice-worker: trains voice-cloning models from jobs on an SQS queue.
Configured by environment variables (see config/worker.env.example)."""


def _fail(problems: list[str]) -> int:
    for line in problems:
        print(line, file=sys.stderr)
    return EXIT_CONFIG


def cmd_run(settings: Settings, _args: argparse.Namespace) -> int:
    problems = daemon_problems(settings)
    if problems:
        return _fail(problems)
    from worker.app import build_app  # the heavy wiring, only for the daemon

    try:
        app = build_app(settings)
    except ConfigError as exc:
        return _fail(exc.problems)
    except WorkerError as exc:
        log.error("worker.startup_failed", error=str(exc), error_type=exc.error_type)
        return EXIT_CRASHED
    return run_worker(app.worker, close=app.close)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run the worker daemon (the default)",
                         description="Take jobs from SQS_QUEUE_URL until SIGTERM/SIGINT.\n\n"
                         "example:\n  SQS_QUEUE_URL=https://sqs.eu-west-1.amazonaws.com/123/jobs \\\n"
                         "  MONGO_URI=mongodb://db/voice S3_BUCKET=voice-models python -m worker run",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.set_defaults(func=cmd_run, needs_settings=True)
    demo = sub.add_parser("demo", help="run one sample job end to end on a local SQS/S3 server",
                          description="Start a local SQS/S3 server (moto), use the SQLite store, submit a\n"
                          "sample job from the shipped recordings and run the real worker and\n"
                          "pipeline until it completes. Needs no configuration and no network.\n\n"
                          "example:\n  python -m worker demo",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.set_defaults(func=cmd_demo, needs_settings=False)
    return parser


def cmd_demo(_settings: None, _args: argparse.Namespace) -> int:
    from worker.demo import run_demo

    return run_demo()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *(argv or [])])
    if not args.needs_settings:
        return args.func(None, args)
    try:
        settings = load_settings()
    except ConfigError as exc:
        return _fail(exc.problems)
    configure_logging(settings.log_level, settings.log_format)
    return args.func(settings, args)
