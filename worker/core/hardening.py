"""Process hardening for the daemon: keep its secrets out of reach of the processes it starts.

A stage runs as the worker's own user. Any process of that user may read a *dumpable* process's
``/proc/<pid>/environ`` (and its memory), where the worker's credentials live. ``PR_SET_DUMPABLE``
0 limits that to processes with ``CAP_SYS_PTRACE``, and turns off the worker's core dumps, which
would hold the same secrets. A child re-gains dumpable at ``execve``, so the stage processes
(``pipeline.proctree`` reads their environment to find them) stay readable to the worker.

Standard library only: a test runs it as another user under an interpreter without the project's
dependencies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3


def _prctl():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    return libc.prctl


def make_undumpable() -> str | None:
    """Make this process undumpable; None when done, else why not (the caller logs it and goes on)."""
    if not sys.platform.startswith("linux"):
        return f"PR_SET_DUMPABLE is Linux only (platform {sys.platform})"
    try:
        prctl = _prctl()
        if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            return f"prctl(PR_SET_DUMPABLE, 0) failed: errno {ctypes.get_errno()}"
    except (OSError, AttributeError) as exc:
        return f"prctl unavailable: {exc}"
    return None


def is_dumpable() -> bool | None:
    """This process's dumpable flag, or None where it cannot be read."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _prctl()(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1
    except (OSError, AttributeError):
        return None
