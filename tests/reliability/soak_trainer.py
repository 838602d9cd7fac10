"""The soak's trainer stand-in: one stage that "trains" for a while, then writes the five artifacts as
random bytes (so two trainings of one job never write the same bytes) and says what it wrote.

Every run appends JSON lines to ``--log`` (O_APPEND, one write per line, so runs in several
processes do not tear each other's lines): ``start``, a ``tick`` every ``TICK_S`` while it runs
(the last tick bounds when a run that was SIGKILLed ended), then ``end`` with the SHA-256 of each
file it wrote, or ``stop`` when it got SIGTERM. The soak's checker reads these lines.

    python soak_trainer.py --out DIR --job JOB_ID --log FILE --train-s S --sizes REL=BYTES,... [--checkpoints DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

TICK_S = 0.1
STATE_BYTES = 32 * 1024


def record(log_path: str, event: str, job: str, **fields) -> None:
    line = json.dumps({"event": event, "job": job, "pid": os.getpid(), "t": time.time(), **fields}) + "\n"
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def parse_sizes(text: str) -> dict[str, int]:
    sizes = {}
    for item in text.split(","):
        rel, _, n = item.partition("=")
        sizes[rel] = int(n)
    return sizes


def resumed_ticks(directory: str | None) -> int:
    """The ticks a checkpoint left by an earlier run records, when its state file is whole too."""
    if directory is None:
        return 0
    try:
        ticks = int((Path(directory) / "ticks").read_text())
        state = (Path(directory) / "state.bin").read_bytes()
    except (OSError, ValueError):
        return 0
    return ticks if len(state) == STATE_BYTES else 0


def save_checkpoint(directory: str | None, ticks: int) -> None:
    if directory is None:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, data in (("state.bin", os.urandom(STATE_BYTES)), ("ticks", str(ticks).encode())):
        temp = Path(directory) / f".{name}.tmp"
        temp.write_bytes(data)
        os.replace(temp, Path(directory) / name)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--train-s", type=float, required=True)
    parser.add_argument("--sizes", required=True)
    # A checkpoint every tick (how far it got, and some state), read back by a resumed run: what the
    # worker's S3 mirror sends and restores when CHECKPOINT_S3_SYNC_SECONDS is set.
    parser.add_argument("--checkpoints")
    args = parser.parse_args(argv)

    def stopped(_signum, _frame):
        record(args.log, "stop", args.job)
        os._exit(143)

    signal.signal(signal.SIGTERM, stopped)
    ticks = resumed_ticks(args.checkpoints)
    record(args.log, "start", args.job, resumed_ticks=ticks)
    deadline = time.monotonic() + max(0.0, args.train_s - ticks * TICK_S)
    while time.monotonic() < deadline:
        time.sleep(TICK_S)
        ticks += 1
        save_checkpoint(args.checkpoints, ticks)
        record(args.log, "tick", args.job)
    digests = {}
    for rel, size in parse_sizes(args.sizes).items():
        data = os.urandom(size)
        path = Path(args.out) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
        record(args.log, "tick", args.job)
    record(args.log, "end", args.job, digests=digests)
    print("PROGRESS 100", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
