"""The container health check: ``python -m worker.core.healthcheck``, exit 0 when the worker is alive.

Run by the orchestrator every 30 s, so it imports nothing of the worker (no settings, no boto3,
no CLI): ``python -m worker health`` costs ~2 s of CPU and ~38 MiB each time; this reads one file.
The worker is alive while its liveness file (``LIVENESS_FILE``) is fresh: the loop and the heartbeat
touch it. How fresh it must be comes from ``LIVENESS_MAX_AGE_SECONDS`` when set, otherwise from
the file itself: the worker writes its limit into it when it starts (``worker.core.health.Liveness``),
computed from its own settings, so the check needs none of them.

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

# When neither the environment nor the file says (a file written by an older release).
FALLBACK_MAX_AGE_S = 120.0
# The longest limit either may give: two days, past the longest the worker computes for itself (three
# 12-hour heartbeats and 30 s, settings.liveness_age_limit_s). A larger one, like nan or inf, would
# call a worker dead for days healthy.
MAX_AGE_LIMIT_S = 2 * 86_400
LIMIT_KEY = "max_age_s="
UNFIT_KEY = "unfit="


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


def written_limit_s(content: str) -> float | None:
    """The limit the worker wrote into its liveness file, or None."""
    for line in content.splitlines():
        if line.startswith(LIMIT_KEY):
            return usable_limit_s(line[len(LIMIT_KEY):])
    return None


def problem(path: str | None, max_age_s: float | None, now_s: float | None = None) -> str | None:
    """Why the worker does not look alive, or None. ``max_age_s`` None: the file's own limit."""
    if max_age_s is not None and not _usable(max_age_s):
        # Refused here too, not only in main(): every comparison with nan is false, so a file could
        # never be "older than the limit".
        return f"the age limit {max_age_s!r} is not a number of seconds above 0 and at most {MAX_AGE_LIMIT_S:.0f}"
    if not path:
        return "LIVENESS_FILE is not set: nothing to check"
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            mtime = os.fstat(handle.fileno()).st_mtime
            content = handle.read(256)
    except OSError:
        return f"liveness file {path} does not exist (yet)"
    for line in content.splitlines():
        if line.startswith(UNFIT_KEY):
            return f"host unfit: {line[len(UNFIT_KEY):]}"
    limit_s = max_age_s if max_age_s is not None else (written_limit_s(content) or FALLBACK_MAX_AGE_S)
    age_s = (time.time() if now_s is None else now_s) - mtime
    if age_s > limit_s:
        return f"liveness file {path} is {age_s:.0f} s old (limit {limit_s:.0f} s)"
    return None


def mark_unfit(path: str, why: str) -> None:
    """Write ``unfit=<why>`` as the liveness file's content (replacing it whole), so the health check
    fails with the reason; a failure to write is ignored: the worker exits non-zero either way."""
    line = " ".join(why.split())[:180]  # one line, within the 256 characters the check reads
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


def main(environ: dict[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    raw_limit = env.get("LIVENESS_MAX_AGE_SECONDS") or None
    max_age_s = usable_limit_s(raw_limit) if raw_limit else None
    if raw_limit and max_age_s is None:
        print(f"unhealthy: LIVENESS_MAX_AGE_SECONDS={raw_limit!r} is not a number of seconds above 0 "
              f"and at most {MAX_AGE_LIMIT_S:.0f}")
        return 1
    why = problem(env.get("LIVENESS_FILE"), max_age_s)
    print(f"unhealthy: {why}" if why else "healthy")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
