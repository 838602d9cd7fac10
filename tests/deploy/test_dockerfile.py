"""The image: lint-clean, installed the way the tests' environment is, non-root, stoppable, checked."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib

import pytest

from tests.deploy.files import (
    REPO,
    VENV_BIN,
    env_instructions,
    read_dockerfile,
    store_connect_worst_s,
)
from worker.settings import ENV_NAMES, load_settings

DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture(scope="module")
def instructions():
    return read_dockerfile(DOCKERFILE)


def _only(instructions, keyword):
    found = [i.args for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


def _run_commands(instructions) -> list[list[str]]:
    """Each RUN split into its &&-joined commands, as argv lists."""
    commands = []
    for ins in instructions:
        if ins.keyword == "RUN":
            commands += [shlex.split(part) for part in ins.args.split("&&")]
    return commands


def test_hadolint_reports_nothing(tmp_path):
    """hadolint finds no problem of any level (style included) with its built-in rules only."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")  # no ignored rules, whatever config a developer keeps around
    result = subprocess.run(
        [str(VENV_BIN / "hadolint"), "--config", str(config), "--failure-threshold", "style",
         "--format", "json", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout) == []


def test_base_image_is_python_311_slim_pinned_by_tag(instructions):
    """The base is the official slim Python 3.11 image pinned to a patch release, never a floating tag."""
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", _only(instructions, "FROM"))


def test_install_step_is_the_makefiles_script_in_prod_mode(instructions):
    """The image installs through scripts/install.sh (prod), the same script the Makefile uses (dev)."""
    installs = [argv for argv in _run_commands(instructions) if argv[0] == "scripts/install.sh"]
    assert installs == [["scripts/install.sh", "python", "prod"]]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^\tscripts/install\.sh \S+ dev$", makefile, re.MULTILINE)
    assert os.access(REPO / "scripts" / "install.sh", os.X_OK)  # both run it directly, not via sh


def test_everything_the_install_reads_is_copied(instructions):
    """COPY brings in every path the install needs (the packages, the pins, the readme) and each exists."""
    copied = set()
    for args in (i.args for i in instructions if i.keyword == "COPY"):
        *sources, _destination = args.split()
        copied |= {s.rstrip("/") for s in sources if not s.startswith("--")}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = {"pyproject.toml", "constraints.txt", "requirements", "scripts", pyproject["project"]["readme"],
              "config", *packages}
    assert needed <= copied
    missing = sorted(s for s in copied if not (REPO / s).exists())
    assert not missing, f"COPY sources missing from the repository: {missing}"


def test_the_production_image_leaves_the_demo_clips_out(instructions):
    """samples/ (the demo's recordings) is not copied into the image."""
    sources = {src.rstrip("/") for i in instructions if i.keyword == "COPY" for src in i.args.split()[:-1]}
    assert "samples" not in sources


def test_the_image_says_its_version_and_revision(instructions):
    """OCI labels name the image's version (pyproject's by default) and its source revision (a build arg)."""
    args = dict(arg.partition("=")[::2] for arg in (i.args for i in instructions if i.keyword == "ARG"))
    labels = " ".join(i.args for i in instructions if i.keyword == "LABEL")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert args["VERSION"] == version and "REVISION" in args
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    assert 'org.opencontainers.image.revision="${REVISION}"' in labels


def _lock() -> dict[str, tuple[str, list[str]]]:
    """requirements/image.lock as name -> (version, hashes)."""
    entries: dict[str, tuple[str, list[str]]] = {}
    text = (REPO / "requirements" / "image.lock").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if not line or line.startswith(("#", " ")):
            continue
        requirement, *rest = line.split()
        name, _, version = requirement.partition("==")
        entries[name.lower()] = (version, [h.split(":", 1)[1] for h in rest if h.startswith("--hash=sha256:")])
    return entries


def test_the_image_lock_pins_and_hashes_every_runtime_dependency_at_the_tested_versions():
    """Every entry of image.lock is pinned with at least one SHA-256, at constraints.txt's version; it
    holds each of pyproject's runtime dependencies, and pip and setuptools, and no dev tool."""
    lock = _lock()
    assert all(version and hashes for version, hashes in lock.values()), lock
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if version:
            pins[name.lower()] = version
    assert {name: lock[name][0] for name in lock if name in pins} == {name: pins[name] for name in lock if name in pins}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=\[ ;]", dep)[0].lower() for dep in pyproject["dependencies"]}
    assert runtime | {"pip", "setuptools"} <= set(lock)
    dev = {re.split(r"[<>=\[ ;]", dep)[0].lower() for dep in pyproject["optional-dependencies"]["dev"]}
    assert not dev & set(lock)


def test_the_prod_install_requires_the_hashes_and_resolves_nothing():
    """scripts/install.sh prod installs image.lock with --require-hashes, then the project with --no-deps."""
    script = (REPO / "scripts" / "install.sh").read_text()
    prod = script[script.index("else"):]
    assert "--require-hashes --no-deps -r requirements/image.lock" in prod
    assert "--no-deps --no-build-isolation ." in prod and "-c constraints.txt" not in prod


def test_runs_as_the_fixed_non_root_user_after_installing(instructions):
    """The last USER is the numeric non-root 10001 and comes after every RUN, so nothing runs as root."""
    keywords = [i.keyword for i in instructions]
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:]
    uid, _, gid = instructions[last_user].args.partition(":")
    assert uid == "10001" and gid in ("", "10001")
    creates = [argv for argv in _run_commands(instructions) if argv[0] == "useradd"]
    assert len(creates) == 1 and "10001" in creates[0]


def test_work_root_is_owned_by_the_worker_user(instructions):
    """WORK_ROOT lies under /var/lib/voice-worker, which the build creates owned by that user."""
    env = env_instructions(instructions)
    assert env["WORK_ROOT"].startswith("/var/lib/voice-worker")
    made = [argv for argv in _run_commands(instructions) if argv[:2] == ["install", "-d"]]
    assert len(made) == 1 and {"-o", "voice-worker"} <= set(made[0])
    assert env["WORK_ROOT"] in made[0]


def test_environment_sets_the_runtime_defaults(instructions):
    """The image sets the liveness file, unbuffered output and JSON logs, and names only known settings."""
    env = env_instructions(instructions)
    assert env["LIVENESS_FILE"] == "/tmp/voice-worker.alive"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["LOG_FORMAT"] == "json"
    ours = {k: v for k, v in env.items() if not k.startswith(("PYTHON", "PIP_"))}
    assert set(ours) <= set(ENV_NAMES)
    load_settings(ours)  # raises ConfigError if the image's own values are invalid


def test_stops_with_sigterm(instructions):
    """STOPSIGNAL is SIGTERM, the signal the worker's graceful shutdown handles."""
    assert _only(instructions, "STOPSIGNAL") == "SIGTERM"


def test_entrypoint_runs_the_worker_module_with_run_by_default(instructions):
    """ENTRYPOINT (exec form) is python -m worker and the default CMD is run."""
    assert json.loads(_only(instructions, "ENTRYPOINT")) == ["python", "-m", "worker"]
    assert json.loads(_only(instructions, "CMD")) == ["run"]


def test_healthcheck_runs_the_health_command_with_bounded_timings(instructions):
    """HEALTHCHECK runs the import-free check python -m worker.core.healthcheck (exec form), its start
    period past the store retries."""
    args = _only(instructions, "HEALTHCHECK")
    options, _, command = args.partition(" CMD ")
    assert json.loads(command) == ["python", "-m", "worker.core.healthcheck"]
    timings = dict(re.findall(r"--([a-z-]+)=(\d+)s", options))
    assert {"interval", "timeout", "start-period"} <= set(timings)
    assert int(timings["timeout"]) < int(timings["interval"])
    # The liveness file first appears when the worker is ready, after the store answered.
    assert int(timings["start-period"]) > store_connect_worst_s(load_settings({}))


def test_healthcheck_command_follows_the_liveness_file(instructions, tmp_path):
    """The HEALTHCHECK command, run with the image's environment, passes on a fresh liveness file and
    fails on a stale one."""
    argv = json.loads(_only(instructions, "HEALTHCHECK").partition(" CMD ")[2])
    argv[0] = sys.executable
    alive = tmp_path / "alive"
    env = {**env_instructions(instructions), "LIVENESS_FILE": str(alive), "PATH": os.environ["PATH"]}

    def health() -> int:
        return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, timeout=30).returncode

    alive.touch()
    assert health() == 0
    stale_s = time.time() - 24 * 3600
    os.utime(alive, (stale_s, stale_s))
    assert health() != 0


def test_dockerignore_keeps_local_state_out_but_not_what_is_copied(instructions):
    """.dockerignore excludes the virtualenv, work dirs, git metadata and caches, and no COPY source."""
    entries = {
        line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", "var", ".git", "**/__pycache__", ".pytest_cache", ".hypothesis"} <= entries
    copied = {
        source.rstrip("/")
        for args in (i.args for i in instructions if i.keyword == "COPY")
        for source in args.split()[:-1]
    }
    assert not copied & entries
