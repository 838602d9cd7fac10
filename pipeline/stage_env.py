"""The environment a pipeline stage runs with: built from an allow-list, never the worker's own.

The worker's environment holds its credentials (MONGO_URI with its password, AWS keys, SENTRY_DSN).
A stage is third-party code whose output ends up in job records, DLQ attributes, logs and Sentry, so
it gets only what a process needs to run:

- ``BUILTIN_NAMES``: search path, home, locale, time zone, temp dir, GPU selection and thread counts;
- the names an operator lists in ``STAGE_ENV_PASSTHROUGH``;
- ``FIXED``: ``PYTHONUNBUFFERED=1``, so a Python trainer's ``PROGRESS`` lines arrive as printed.

A name that looks like a secret (``is_secret_name``) is never passed, even when listed: the worker
refuses to start with such a list (``stage_env_problems``) rather than quietly dropping the name, so
an operator learns of it before a job fails on a missing variable. A trainer that truly needs a
credential should read it from a file it is given, not inherit the worker's.

Not on the list, on purpose: ``PYTHONPATH`` (the reference trainer is imported from the installed
package; a trainer that needs it can have it passed through), ``VIRTUAL_ENV`` (``{python}`` is the
worker's interpreter by absolute path), proxy and CA settings (stages need no network), model cache
locations such as ``HF_HOME`` (trainer-specific: pass them through).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

BUILTIN_NAMES: tuple[str, ...] = (
    "PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
    "LD_LIBRARY_PATH",  # CUDA images point it at the driver's libraries
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS",
)
FIXED: Mapping[str, str] = {"PYTHONUNBUFFERED": "1"}

# Prefixes of the worker's own credentials, words that name a secret, and the kinds of value that
# embed one (connection strings and DSNs carry user:password@).
_SECRET_NAME = re.compile(
    r"^(?:AWS_|MONGO|SENTRY_)"
    r"|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|SESSION|COOKIE|AUTH|KEY|DSN"
    r"|CONNECTION_STRING|_URI$|_URL$",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    """Whether ``name`` looks like it holds a credential (and so never reaches a stage)."""
    return bool(_SECRET_NAME.search(name))


def stage_env_problems(names: Iterable[str]) -> list[str]:
    """One line per STAGE_ENV_PASSTHROUGH name the worker refuses to pass (empty when all are fine)."""
    return [
        f"STAGE_ENV_PASSTHROUGH: {name} looks like a secret and is never passed to pipeline stages; "
        "remove it and give the trainer what it needs through its own config or a file"
        for name in names
        if is_secret_name(name)
    ]


def stage_environment(source: Mapping[str, str], extra_names: Iterable[str] = ()) -> dict[str, str]:
    """The variables a stage gets: allow-listed names present in ``source``, never a secret one."""
    env = {
        name: source[name]
        for name in (*BUILTIN_NAMES, *extra_names)
        # Checked here too: a caller that skipped stage_env_problems still leaks nothing.
        if name in source and not is_secret_name(name)
    }
    env.update(FIXED)
    return env
