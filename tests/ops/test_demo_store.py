"""`python -m worker demo --store mongo`: the whole product on the production store's code path, a local MongoDB server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.server


def test_the_demo_on_a_local_mongodb_server_completes_its_job():
    """demo --store mongo says its records are on MongoDB, exits 0 and lists five S3 objects of the completed job."""
    proc = subprocess.run([sys.executable, "-m", "worker", "demo", "--store", "mongo"], cwd=REPO,
                          capture_output=True, text=True, timeout=180,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MONGO_", "STORE_"))})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MongoDB records (a local SecantusDB server)" in proc.stdout.splitlines()[0]
    assert "status        completed" in proc.stdout
    objects = re.findall(r"^\s+\w+\s+(s3://\S+) \((\d+) bytes\)$", proc.stdout, re.M)
    assert len(objects) == 5 and all(int(size) > 0 for _, size in objects)
