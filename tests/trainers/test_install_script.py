"""scripts/install-trainers.sh refuses clearly when espeak-ng is missing and it cannot install it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-trainers.sh"


def test_without_espeak_ng_and_without_root_it_stops_before_building_anything(tmp_path):
    """Not root (or no apt-get) and no espeak-ng: exit 1, a line naming the package, no virtualenv made."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "sh"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")
    (bin_dir / "id").chmod(0o755)
    venv = tmp_path / "venv"
    result = subprocess.run([str(bin_dir / "sh"), str(SCRIPT), "python3", str(venv), "dev"],
                            capture_output=True, text=True, env={"PATH": str(bin_dir)}, timeout=60)
    assert result.returncode == 1
    assert "espeak-ng is not installed" in result.stderr and "apt-get install espeak-ng" in result.stderr
    assert not venv.exists()
