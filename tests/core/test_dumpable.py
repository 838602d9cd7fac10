"""The worker makes itself undumpable, so a process of its own user cannot read its environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import run_unprivileged

REPO = Path(__file__).resolve().parents[2]

# Makes itself undumpable or not (argv[1]), then has a child of the same user read its environ.
READ_PARENT = """
import os, subprocess
from worker.core.hardening import make_undumpable
if sys.argv[1] == "undumpable":
    assert make_undumpable() is None
read = f"open('/proc/{os.getpid()}/environ', 'rb').read(); print('read')"
child = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True)
print("PermissionError" if "PermissionError" in child.stderr else child.stdout.strip() or child.stderr)
"""


def test_a_child_of_the_same_user_cannot_read_an_undumpable_processs_environment():
    """Once undumpable, a same-user child gets PermissionError on /proc/<parent>/environ; before, it reads it."""
    assert run_unprivileged(READ_PARENT, "dumpable") == "read"  # the probe itself can tell the difference
    assert run_unprivileged(READ_PARENT, "undumpable") == "PermissionError"


def test_run_makes_the_worker_undumpable_before_anything_else():
    """`run` clears the dumpable flag first, even when it then refuses its settings (exit 2)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SQS_", "STORE_", "MONGO_", "S3_"))}
    code = ("from worker.ops import cli\nfrom worker.core.hardening import is_dumpable\n"
            "code = cli.main(['run'])\nprint(code, is_dumpable())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split()[-2:] == ["2", "False"], proc.stdout + proc.stderr
