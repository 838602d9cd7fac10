"""Checkpoint files on disk: atomic writes, a bounded number kept, a fingerprint of what they train.

The serialisation itself (``torch.save``) is passed in by the caller, so this module stays torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import IO, Any

_CHECKPOINT = re.compile(r"step-([0-9]{8})\.pt")
_TEMP_PREFIX = ".tmp-"


def checkpoint_path(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step-{step:08d}.pt"


def list_checkpoints(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file, newest first."""
    found = []
    try:
        names = os.listdir(checkpoints)
    except FileNotFoundError:
        return []
    for name in names:
        match = _CHECKPOINT.fullmatch(name)
        if match:
            found.append((int(match.group(1)), checkpoints / name))
    return sorted(found, reverse=True)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write through a temp file in the same directory, fsync, rename, fsync the directory.

    A kill at any moment leaves either the old file or the new one, never half of one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f"{_TEMP_PREFIX}{path.name}.{os.getpid()}"
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: Path) -> None:
    """Temp files a killed run left behind (the rename never happened, so nothing refers to them)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(_TEMP_PREFIX):
            (directory / name).unlink(missing_ok=True)


def prune(checkpoints: Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest checkpoints; returns what was removed."""
    removed = []
    for _, path in list_checkpoints(checkpoints)[keep:]:
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def software_versions() -> dict[str, str]:
    """The versions a checkpoint's meaning depends on besides its data: Coqui's model code and this adapter."""
    import voice_trainers

    return {"coqui-tts": metadata.version("coqui-tts"), "voice-trainers": voice_trainers.__version__}


def run_fingerprint(**parts: Any) -> str:
    """SHA-256 of what a run trains (dataset fingerprint, profile fields, language...), order-independent."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


BEST_NAME = "best.pt"


def best_path(checkpoints: Path) -> Path:
    """The best-scoring generator of the run so far: beside the step checkpoints, never pruned with them."""
    return checkpoints / BEST_NAME


def write_best(checkpoints: Path, fingerprint: str, step: int, score: float, generator: dict[str, Any],
               save: Callable[[dict[str, Any], IO[bytes]], object]) -> None:
    state = {"fingerprint": fingerprint, "step": step, "score": score, "model": generator}
    atomic_write(best_path(checkpoints), lambda handle: save(state, handle))


def read_best(checkpoints: Path, fingerprint: str, load: Callable[[Path], Any]) -> dict[str, Any] | None:
    """This run's best so far (``step``, ``score``, ``model``), or None; another run's or a torn one is removed."""
    path = best_path(checkpoints)
    if not path.exists():
        return None
    try:
        state = load(path)
        usable = isinstance(state, dict) and state.get("fingerprint") == fingerprint and \
            isinstance(state.get("model"), dict) and isinstance(state.get("step"), int) and \
            isinstance(state.get("score"), float)
    except Exception:  # a torn file: as good as none (it is rewritten at the next better validation)
        usable = False
    if not usable:
        path.unlink(missing_ok=True)
        return None
    return state
