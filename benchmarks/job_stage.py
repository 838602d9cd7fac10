"""One stage of benchmarks/job.py's pipeline: writes its outputs, then sleeps out the rest of its time.

    python job_stage.py --name NAME --out DIR --seconds S --sizes REL=BYTES,... --timings FILE

The stage's clock starts when this script starts (the interpreter's start-up is the worker's cost, as
it would be for any trainer); writing the outputs counts as the stage's own work, inside S. One JSON
line goes to FILE (O_APPEND): the stage's name, how long it took and how long the writing took, so
the benchmark can subtract what the stage itself used. Only the standard library: a trainer stand-in
must not be slowed by imports the worker does not cause.
"""

import time

STARTED_S = time.monotonic()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

BLOCK_BYTES = 8 * 1024 * 1024


def write_output(path: Path, size: int, block: bytes) -> None:
    """``size`` bytes of random-looking data, each block made distinct by its number (no two files or
    blocks are the same bytes, so nothing downstream can skip work by content)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        written = 0
        number = 0
        while written < size:
            chunk = (number.to_bytes(8, "little") + path.name.encode()[:8].ljust(8, b"\0") + block[16:])
            chunk = chunk[:size - written]
            handle.write(chunk)
            written += len(chunk)
            number += 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--timings", required=True)
    args = parser.parse_args()
    block = os.urandom(BLOCK_BYTES)
    for item in args.sizes.split(","):
        rel, _, size = item.partition("=")
        write_output(Path(args.out) / rel, int(size), block)
    wrote_s = time.monotonic() - STARTED_S
    remaining_s = STARTED_S + args.seconds - time.monotonic()
    if remaining_s > 0:
        time.sleep(remaining_s)
    line = json.dumps({"stage": args.name, "elapsed_s": time.monotonic() - STARTED_S, "write_s": wrote_s}) + "\n"
    fd = os.open(args.timings, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    print("PROGRESS 100", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
