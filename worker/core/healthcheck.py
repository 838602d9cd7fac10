"""The container health check: ``python -m worker.core.healthcheck``, exit 0 when the worker is alive.

Run by the orchestrator every 30 s, so it imports nothing of the worker (no settings, no boto3,
no CLI): ``python -m worker health`` costs ~2 s of CPU and ~38 MiB each time; this reads one file.
The worker is alive while its liveness file (``LIVENESS_FILE``) is fresh: the loop and the heartbeat
touch it. How fresh it must be comes from ``LIVENESS_MAX_AGE_SECONDS`` when set, otherwise from
the file itself: the worker writes its limit into it when it starts (``worker.core.health.Liveness``),
computed from its own settings, so the check needs none of them.

The check also fails once the queue or the store has not answered for too long: the loop stamps
``reached_queue=<epoch s>`` after each successful receive or renewal, the presence writer
``reached_store=<epoch s>`` after each successful write, and the worker writes its limit
(``HEALTH_UNREACHABLE_AFTER_SECONDS``, ``unreachable_after_s=``) beside them; the environment's
``HEALTH_UNREACHABLE_AFTER_SECONDS`` wins when set. A file without the limit or the stamps (an older
worker's) is judged on its age alone.

``python -m worker health`` runs this very ``main``: the two give one answer in every case, also when
some other setting is invalid (neither reads the worker's settings; the worker validated its own).

A worker that refused to start because its host is unfit (``EXIT_HOST_UNFIT``) writes ``unfit=<why>``
into the file (``mark_unfit``): the check then fails at once with that line, however fresh the file,
until a worker starts on the host again and rewrites it.

Exit codes: 0 healthy, 1 unhealthy (with the reason on stdout, which Docker keeps in its health log).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import TextIO

# When neither the environment nor the file says (a file written by an older release).
FALLBACK_MAX_AGE_S = 120.0
# The longest limit either may give: two days, past the longest the worker computes for itself (three
# 12-hour heartbeats and 30 s, settings.liveness_age_limit_s). A larger one, like nan or inf, would
# call a worker dead for days healthy.
MAX_AGE_LIMIT_S = 2 * 86_400
LIMIT_KEY = "max_age_s="
UNFIT_KEY = "unfit="
UNREACHABLE_KEY = "unreachable_after_s="
# What the worker must reach; each has a ``reached_<part>=`` stamp.
CONTACT_PARTS = ("queue", "store")
REACHED_PREFIX = "reached_"
# Read from the file: the limit and stamp lines stay well inside it.
READ_CHARS = 512


def usable_limit_s(text: str) -> float | None:
    """``text`` as a limit in seconds: a finite number above 0 and at most ``MAX_AGE_LIMIT_S``; else None."""
    if not text.isascii():  # float() also reads other scripts' digits
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if _usable(value) else None


def _usable(limit_s: float) -> bool:
    return math.isfinite(limit_s) and 0 < limit_s <= MAX_AGE_LIMIT_S


def written_limit_s(content: str, key: str = LIMIT_KEY) -> float | None:
    """The limit the worker wrote into its liveness file under ``key``, or None."""
    for line in content.splitlines():
        if line.startswith(key):
            return usable_limit_s(line[len(key):])
    return None


def reached_at_s(content: str) -> dict[str, float]:
    """The ``reached_<part>=<epoch s>`` stamps of the file; one that does not read as a finite time is left out."""
    stamps = {}
    for line in content.splitlines():
        part, sep, value = line.partition("=")
        if sep and part.startswith(REACHED_PREFIX) and value.isascii():
            try:
                stamp = float(value)
            except ValueError:
                continue
            if math.isfinite(stamp):
                stamps[part[len(REACHED_PREFIX):]] = stamp
    return stamps


def unreachable_problem(content: str, limit_s: float | None, now_s: float) -> str | None:
    """Which of the queue and the store has not answered for longer than ``limit_s``, or None."""
    if limit_s is None:
        return None
    stamps = reached_at_s(content)
    silent = [(part, now_s - stamps[part]) for part in CONTACT_PARTS
              if part in stamps and now_s - stamps[part] > limit_s]
    if not silent:
        return None
    return "; ".join(f"the {part} has not answered for {age_s:.0f} s" for part, age_s in silent) + \
        f" (limit {limit_s:.0f} s)"


def contact_lines(limit_s: float, reached: dict[str, float]) -> str:
    """The file's lines for the unreachable limit and the stamps (``Liveness`` writes them)."""
    return f"{UNREACHABLE_KEY}{limit_s:g}\n" + "".join(
        f"{REACHED_PREFIX}{part}={reached[part]:.3f}\n" for part in CONTACT_PARTS if part in reached)


def problem(path: str | None, max_age_s: float | None, now_s: float | None = None,
            unreachable_after_s: float | None = None) -> str | None:
    """Why the worker does not look alive, or None. ``max_age_s``, ``unreachable_after_s`` None: the
    file's own limits."""
    for limit in (max_age_s, unreachable_after_s):
        if limit is not None and not _usable(limit):
            # Refused here too, not only in main(): every comparison with nan is false, so a file could
            # never be "older than the limit".
            return f"the age limit {limit!r} is not a number of seconds above 0 and at most {MAX_AGE_LIMIT_S:.0f}"
    if not path:
        return "LIVENESS_FILE is not set: nothing to check"
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            mtime = os.fstat(handle.fileno()).st_mtime
            content = handle.read(READ_CHARS)
    except OSError:
        return f"liveness file {path} does not exist (yet)"
    for line in content.splitlines():
        if line.startswith(UNFIT_KEY):
            return f"host unfit: {line[len(UNFIT_KEY):]}"
    limit_s = max_age_s if max_age_s is not None else (written_limit_s(content) or FALLBACK_MAX_AGE_S)
    now_s = time.time() if now_s is None else now_s
    age_s = now_s - mtime
    if age_s > limit_s:
        return f"liveness file {path} is {age_s:.0f} s old (limit {limit_s:.0f} s)"
    unreachable_s = unreachable_after_s if unreachable_after_s is not None else written_limit_s(
        content, UNREACHABLE_KEY)
    return unreachable_problem(content, unreachable_s, now_s)


def mark_unfit(path: str, why: str) -> None:
    """Write ``unfit=<why>`` as the liveness file's content (replacing it whole), so the health check
    fails with the reason; a failure to write is ignored: the worker exits non-zero either way."""
    line = " ".join(why.split())[:180]  # one line, well within the characters the check reads
    temp = f"{path}.unfit.{os.getpid()}"
    try:
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write(f"{UNFIT_KEY}{line}\n")
        os.replace(temp, path)
    except OSError:
        try:
            os.unlink(temp)
        except OSError:
            pass


def answer(environ: Mapping[str, str]) -> str | None:
    """The one answer both health commands give: why the worker is unhealthy, or None."""
    limits: dict[str, float | None] = {}
    for name in ("LIVENESS_MAX_AGE_SECONDS", "HEALTH_UNREACHABLE_AFTER_SECONDS"):
        raw = environ.get(name) or None
        limits[name] = usable_limit_s(raw) if raw else None
        if raw and limits[name] is None:
            return f"{name}={raw!r} is not a number of seconds above 0 and at most {MAX_AGE_LIMIT_S:.0f}"
    return problem(environ.get("LIVENESS_FILE"), limits["LIVENESS_MAX_AGE_SECONDS"],
                   unreachable_after_s=limits["HEALTH_UNREACHABLE_AFTER_SECONDS"])


def main(environ: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    why = answer(os.environ if environ is None else environ)
    print(f"unhealthy: {why}" if why else "healthy", file=out or sys.stdout)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
