"""``speakers.pth``: the speaker of the job's recordings, as data preparation found it (docs/trainer.md,
"speakers.pth").

A ``torch.save``'d dict of plain types (``torch.load(..., weights_only=True)`` reads it)::

    {"format": "voice-worker-speaker", "version": 2, "encoder": "resemblyzer 0.1.4 GE2E", "dim": 256,
     "centroid": [256 floats, unit length],          # the unit mean of the kept clips' unit d-vectors
     "clips": {"<clip id>": {"cosine": float, "kept": bool}, ...}}   # every clip that was embedded

Data preparation leaves out the clips far below the others in cosine (another speaker); the evaluate
stage scores both models' speech against ``centroid``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from voice_trainers.checkpoints import atomic_write

SPEAKERS_NAME = "speakers.pth"
FORMAT = "voice-worker-speaker"
VERSION = 2
EMBEDDING_DIM = 256


def speaker_file(centroid: np.ndarray, cosines: Mapping[str, float], kept: set[str], encoder: str) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "encoder": encoder, "dim": int(len(centroid)),
            "centroid": [float(x) for x in centroid],
            "clips": {uid: {"cosine": float(value), "kept": uid in kept} for uid, value in cosines.items()}}


def write_speakers(path: Path, content: dict[str, Any]) -> None:
    from voice_trainers.coqui import import_torch

    buffer = io.BytesIO()
    import_torch().save(content, buffer)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()))


def read_centroid(path: Path) -> np.ndarray:
    """The unit centroid of a ``speakers.pth``; a file of another format is a broken earlier stage."""
    from voice_trainers.coqui import import_torch

    content = import_torch().load(str(path), weights_only=True)
    if not isinstance(content, dict) or content.get("format") != FORMAT or content.get("version") != VERSION:
        raise RuntimeError(f"{path} is not a {FORMAT} file of version {VERSION}")
    centroid = np.asarray(content["centroid"], dtype=np.float64)
    if centroid.shape != (EMBEDDING_DIM,) or not np.isfinite(centroid).all():
        raise RuntimeError(f"{path}: the centroid is not {EMBEDDING_DIM} finite numbers")
    return centroid
