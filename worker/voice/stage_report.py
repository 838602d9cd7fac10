"""A report a stage wrote for the worker (the evaluation's ``eval/quality.json``, the data preparation's
``prep/report.json``), read as untrusted: at most a size, a regular file reached without following a
symlink, UTF-8 JSON, then the caller's pydantic model. Every failure is the caller's permanent error
class in one line (a stage that broke its contract writes the same on a retry)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from worker.core.errors import PermanentError

Model = TypeVar("Model", bound=BaseModel)


def read_report(path: Path, model: type[Model], *, what: str, max_bytes: int,
                error: type[PermanentError]) -> Model | None:
    """The report at ``path`` validated as ``model``; None when there is no file; ``error`` naming
    ``what`` (e.g. ``quality report eval/quality.json``) for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise error(f"{what}: cannot be opened ({exc.strerror or exc}; a symlink is refused)") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise error(f"{what}: not a regular file")
        raw = handle.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise error(f"{what}: larger than {max_bytes} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{what}: not JSON ({exc})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{what}: {first_problem(exc)}") from None


def first_problem(exc: ValidationError) -> str:
    """One line for a failed validation: the first problem's place and message, and how many more."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "(the report)"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}"[:300] + more
