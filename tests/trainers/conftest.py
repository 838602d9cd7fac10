"""The trainer package's torch-free modules, imported from the source tree by the worker's venv."""

from __future__ import annotations

import sys
from pathlib import Path

TRAINERS_DIR = Path(__file__).resolve().parents[2] / "trainers"
if str(TRAINERS_DIR) not in sys.path:
    sys.path.insert(0, str(TRAINERS_DIR))
