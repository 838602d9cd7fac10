"""`python -m worker dev-stack`: a persistent local stack for the everyday dev loop.

It starts the same local SQS/S3 server (moto) the demo uses, on a fixed loopback port, creates the
queue with its dead-letter queue and redrive policy, the model and recordings buckets, uploads the
shipped clips under the recordings prefix of the profile in ``samples/job.json``, and writes every
setting the other commands need to ``<dir>/env.sh``. Then it waits until Ctrl-C (or SIGTERM), so a
worker in one terminal and ``submit``/``status``/``cancel``/``dlq list`` in another share one stack.

The records live in ``<dir>/records.db`` and survive a restart of the stack; the queue and buckets
live in the server's memory and do not (a restart provisions them afresh). With ``--store mongo`` the
records are on a local MongoDB server instead (SecantusDB, worker/ops/localmongo.py, on the port after
moto's), the production store's code path; its data is kept in ``<dir>/mongo`` across restarts too.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
from pathlib import Path

from worker.core.daemon import SignalRelay
from worker.ops.demo import REPO, LocalAws, dev_session, local_stack_env, provision
from worker.ops.localmongo import LocalMongo

DEFAULT_PORT = 4566
DEFAULT_DIR = REPO / "var" / "dev"
ENV_FILE = "env.sh"
STORES = ("sqlite", "mongo")
MONGO_DATABASE = "voice"


def dev_environment(endpoint: str, queue_url: str, state_dir: Path, mongo_uri: str | None = None) -> dict[str, str]:
    """Every setting a worker or an operator command needs to use the local stack, by name."""
    return {
        **local_stack_env(endpoint, queue_url, state_dir.resolve(), mongo_uri),
        # moto takes any credentials; fixed ones keep the dev loop away from a real AWS profile.
        "AWS_ACCESS_KEY_ID": "dev",
        "AWS_SECRET_ACCESS_KEY": "dev",
        "SQS_WAIT_TIME_SECONDS": "5",
        # Stage logs reach the local S3 within 2 s, so `logs --follow` keeps up with a short dev job.
        "LOG_SHIP_INTERVAL_SECONDS": "2",
        # No WORKER_ID: each dev worker takes its own default, <hostname>:<pid>, so two of them are
        # told apart in the records, the logs and `workers`.
        # The worker touches it and `python -m worker health` (or worker.core.healthcheck) reads it,
        # in any terminal that sourced env.sh.
        "LIVENESS_FILE": str(state_dir.resolve() / "alive"),
    }


def env_script(env: dict[str, str], shown_path: str = "var/dev/env.sh") -> str:
    """The environment as a POSIX shell file to source: one quoted ``export`` per setting."""
    lines = [f"# written by `python -m worker dev-stack`; source it: . {shlex.quote(shown_path)}"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    return "\n".join(lines) + "\n"


def run_dev_stack(port: int = DEFAULT_PORT, state_dir: Path = DEFAULT_DIR, out=None,
                  until: threading.Event | None = None, store: str = "sqlite") -> int:
    """Start and provision the stack, write env.sh, then wait for Ctrl-C/SIGTERM (or ``until``).

    ``store="mongo"`` also starts the local MongoDB server on ``port + 1`` and points MONGO_URI at it."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    out = out or sys.stdout
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    stop = until or _signal_event()
    with contextlib.ExitStack() as servers:
        aws = servers.enter_context(LocalAws(port=port))
        mongo_uri, records = None, str(state_dir / "records.db")
        if store == "mongo":
            mongo = servers.enter_context(LocalMongo(port=port + 1, storage_path=state_dir.resolve() / "mongo",
                                                     log_path=state_dir / "mongo.log"))
            mongo_uri = mongo.uri + MONGO_DATABASE
            records = f"MongoDB (SecantusDB) at {mongo_uri}, data in {state_dir / 'mongo'}"
        queue_url = provision(dev_session(), aws.url)
        env = dev_environment(aws.url, queue_url, state_dir, mongo_uri)
        env_path = state_dir / ENV_FILE
        env_path.write_text(env_script(env, _shown(env_path)))
        print(f"local SQS/S3 (moto) on {aws.url}; records in {records}", file=out)
        print(f"the environment is in {env_path}; in each other terminal:\n", file=out)
        print(f"  . {_shown(env_path)}", file=out)
        print("  .venv/bin/python -m worker run                # terminal 2: the worker", file=out)
        print("  .venv/bin/python -m worker submit samples/job.json   # terminal 3", file=out)
        print("\nCtrl-C stops the stack.", file=out, flush=True)
        stop.wait()
        print("stopping the local stack", file=out, flush=True)
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _signal_event() -> threading.Event:
    """An event set by SIGINT/SIGTERM, through the daemon's lock-free signal relay."""
    stop = threading.Event()
    SignalRelay(stop.set).install()
    return stop
