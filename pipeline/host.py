"""Host readiness: what this host must offer before its worker takes a job, checked once at start-up.

The checks run in order, each cheap before the next one that costs more, and the first that fails
stops the start-up with ``HostUnfit`` (one line: the check and why), before the first receive, so no
job's attempt or retry is spent on a host problem. ``doctor`` runs the same list and reports each.

1. **work file system**: ``WORK_ROOT`` exists (or can be made), takes a written and synced file, and
   has ``WORK_MIN_FREE_BYTES`` free.
2. **base model** (when the config has ``[base_model]``): fetched into the host's cache when absent,
   every file verified (``pipeline.base_model``).
3. **trainer probe** (when a stage declares ``device = "cuda"``): ``{trainer_python} -m voice_trainers
   probe`` prints one JSON line describing torch and the GPU it sees; it is logged as one line, and a
   probe that fails, times out, prints no such line, or reports ``cuda_available`` false makes the
   host unfit.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from pipeline.base_model_cache import BaseModelCache, source_for
from pipeline.config import PipelineConfig
from pipeline.errors import HostUnfit

log = structlog.get_logger(__name__)

WORK_CHECK, BASE_CHECK, PROBE_CHECK = "work file system", "base model", "trainer probe"
# Importing torch and initialising CUDA takes seconds to a minute on a cold host; past this the
# trainer environment is broken, not slow.
PROBE_TIMEOUT_S = 180.0
PROBE_OUTPUT_MAX_BYTES = 64 * 1024
# What the probe's JSON line must carry (``voice_trainers probe``); more keys are kept as they are.
PROBE_KEYS = ("cuda_available", "torch", "cuda", "device_name", "total_memory_bytes", "driver")


@dataclass(frozen=True)
class HostCheck:
    """One readiness check: ``run()`` returns a one-line detail when the host passes, raises ``HostUnfit``."""

    name: str
    run: Callable[[], str]


def readiness_checks(config: PipelineConfig, *, work_root: Path, min_free_bytes: int, cache: BaseModelCache,
                     s3: Any = None, env: Mapping[str, str] | None = None,
                     probe_timeout_s: float = PROBE_TIMEOUT_S) -> list[HostCheck]:
    """This config's checks, in the order they run."""
    checks = [HostCheck(WORK_CHECK, lambda: work_root_check(work_root, min_free_bytes))]
    spec = config.base_model
    if spec is not None:
        def base() -> str:
            ensured = cache.ensure(spec, source_for(spec, s3))
            how = "fetched and verified" if ensured.fetched else "cached, verified"
            return f"{spec.name} ({spec.identity.digest}, {len(spec.files)} files) {how} in {ensured.directory}"

        checks.append(HostCheck(BASE_CHECK, base))
    if needs := [stage.name for stage in config.stages if stage.device == "cuda"]:
        def probe() -> str:
            found = run_probe(config.trainer_python, env=env, timeout_s=probe_timeout_s)
            if found.get("cuda_available") is not True:
                raise HostUnfit(PROBE_CHECK, f"stages {', '.join(needs)} need cuda, but the trainer sees none "
                                             f"({_shown(found)})")
            return _shown(found)

        checks.append(HostCheck(PROBE_CHECK, probe))
    return checks


def check_host(checks: list[HostCheck]) -> None:
    """Run the checks in order; the first that fails raises its ``HostUnfit``."""
    for check in checks:
        detail = check.run()
        log.info("host.ready", check=check.name, detail=detail)


def work_root_check(work_root: Path, min_free_bytes: int) -> str:
    """``WORK_ROOT`` exists or can be made, takes a synced write, and has ``min_free_bytes`` free.

    A job that meets a full or read-only disk mid-way is released to another host as a host fault
    (``pipeline.host_faults``); this check keeps a host whose disk is already unusable from taking jobs."""
    try:
        work_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HostUnfit(WORK_CHECK, f"WORK_ROOT {work_root} cannot be made: {exc.strerror or exc}") from None
    probe = work_root / f".host-check-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"voice-worker host check\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
        usage = os.statvfs(work_root)
    except OSError as exc:
        raise HostUnfit(WORK_CHECK, f"WORK_ROOT {work_root} is not writable: {exc.strerror or exc}") from None
    free = usage.f_bavail * usage.f_frsize
    if free < min_free_bytes:
        raise HostUnfit(WORK_CHECK, f"WORK_ROOT {work_root} has {free} bytes free, below "
                                    f"WORK_MIN_FREE_BYTES={min_free_bytes}")
    return f"{work_root}: writable, {free} bytes free (WORK_MIN_FREE_BYTES={min_free_bytes})"


def run_probe(trainer_python: str, *, env: Mapping[str, str] | None = None,
              timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The trainer's own description of torch and its device: the last JSON line of
    ``{trainer_python} -m voice_trainers probe``, logged as one line; ``HostUnfit`` when there is none."""
    argv = [trainer_python, "-m", "voice_trainers", "probe"]
    try:
        done = subprocess.run(argv, env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise HostUnfit(PROBE_CHECK, f"{' '.join(argv)} did not answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise HostUnfit(PROBE_CHECK, f"{trainer_python} cannot be run: {exc.strerror or exc}") from None
    if done.returncode != 0:
        tail = done.stderr[-300:].decode("utf-8", "replace").strip().splitlines()
        raise HostUnfit(PROBE_CHECK, f"exited with code {done.returncode}" + (f": {tail[-1]}" if tail else ""))
    found = _last_json_line(done.stdout[-PROBE_OUTPUT_MAX_BYTES:])
    if found is None or not isinstance(found.get("cuda_available"), bool):
        raise HostUnfit(PROBE_CHECK, "printed no JSON line with a true/false cuda_available")
    log.info("host.trainer_probe", **{key: found.get(key) for key in PROBE_KEYS})
    return found


def _last_json_line(output: bytes) -> dict[str, Any] | None:
    for line in reversed(output.decode("utf-8", "replace").splitlines()):
        if line.strip():
            try:
                value = json.loads(line)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def _shown(found: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={found.get(key)}" for key in PROBE_KEYS)
