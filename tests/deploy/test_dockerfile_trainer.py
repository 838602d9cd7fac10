"""The trainer image (Dockerfile.trainer): the worker image plus the real trainers, installed the way
`make test-real` installs them, lint-clean, non-root, and pointed at the real pipeline."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from pipeline.config import load_pipeline_config
from tests.deploy.files import REPO, VENV_BIN, env_instructions, read_dockerfile
from worker.settings import ENV_NAMES, load_settings

DOCKERFILE = REPO / "Dockerfile"
TRAINER_DOCKERFILE = REPO / "Dockerfile.trainer"
# Outside the code's directory, where docs/trainer.md installs an image's trainers.
TRAINER_VENV = "/opt/trainers"


@pytest.fixture(scope="module")
def instructions():
    return read_dockerfile(TRAINER_DOCKERFILE)


@pytest.fixture(scope="module")
def worker_image():
    return read_dockerfile(DOCKERFILE)


def _all(instructions, keyword) -> list[str]:
    return [i.args for i in instructions if i.keyword == keyword]


def _run_commands(instructions) -> list[list[str]]:
    return [shlex.split(part) for args in _all(instructions, "RUN") for part in args.split("&&")]


def _copied(instructions) -> set[str]:
    return {s.rstrip("/") for args in _all(instructions, "COPY") for s in args.split()[:-1] if not s.startswith("--")}


def test_hadolint_reports_nothing_on_the_trainer_image(tmp_path):
    """hadolint finds no problem of any level (style included) in Dockerfile.trainer, with its built-in rules only."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")
    result = subprocess.run(
        [str(VENV_BIN / "hadolint"), "--config", str(config), "--failure-threshold", "style",
         "--format", "json", str(TRAINER_DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout) == []


def test_same_base_user_signal_health_and_entrypoint_as_the_worker_image(instructions, worker_image):
    """Base image, USER, STOPSIGNAL, HEALTHCHECK, ENTRYPOINT and CMD are the worker image's, word for word."""
    for keyword in ("FROM", "WORKDIR", "USER", "STOPSIGNAL", "HEALTHCHECK", "ENTRYPOINT", "CMD"):
        assert _all(instructions, keyword) == _all(worker_image, keyword), keyword


def test_installs_the_worker_and_the_trainers_with_the_makefiles_scripts(instructions):
    """RUN installs the worker through scripts/install.sh (prod) and the trainers through the script the
    Makefile's trainer target runs, once each."""
    scripts = [argv for argv in _run_commands(instructions) if argv[0].startswith("scripts/")]
    assert [argv[0] for argv in scripts] == ["scripts/install.sh", "scripts/install-trainers.sh"]
    assert scripts[0] == ["scripts/install.sh", "python", "prod"]
    # prod: the trainers without the test-only extra (piper-tts is GPL-3.0 and only proves the light pair).
    assert scripts[1] == ["scripts/install-trainers.sh", "python", TRAINER_VENV, "prod"]
    assert env_instructions(instructions)["TRAINER_PYTHON"] == f"{TRAINER_VENV}/bin/python"
    # The Makefile runs the same script in dev mode (the test-only extra, editable) for trainers/.venv.
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^\tscripts/install-trainers\.sh \S+ \$\(TRAINER_VENV\) dev$", makefile, re.MULTILINE)
    assert os.access(REPO / "scripts" / "install-trainers.sh", os.X_OK)


def test_espeak_ng_comes_from_debian_pinned_without_recommends(instructions):
    """espeak-ng is installed with apt-get, version-pinned, without recommended packages, lists removed."""
    commands = _run_commands(instructions)
    installs = [argv for argv in commands if argv[:2] == ["apt-get", "install"]]
    assert len(installs) == 1 and "--no-install-recommends" in installs[0]
    packages = [word for word in installs[0][2:] if not word.startswith("-")]
    assert [p.partition("=")[0] for p in packages] == ["espeak-ng"] and all("=" in p for p in packages)
    assert ["rm", "-rf", "/var/lib/apt/lists/*"] in commands


def test_points_the_worker_at_the_real_pipeline_and_the_trainer_interpreter(instructions, worker_image):
    """The image's settings are the worker image's plus PIPELINE_CONFIG (the shipped real pipeline) and
    TRAINER_PYTHON (the trainer virtualenv the install builds), and all of them load."""
    env, worker_env = env_instructions(instructions), env_instructions(worker_image)
    assert {k: env[k] for k in worker_env} == worker_env
    assert env["PIPELINE_CONFIG"] == "config/pipeline.real.toml"
    assert env["TRAINER_PYTHON"] == f"{TRAINER_VENV}/bin/python"
    ours = {k: v for k, v in env.items() if not k.startswith(("PYTHON", "PIP_"))}
    assert set(ours) <= set(ENV_NAMES)
    load_settings(ours)
    # Checked here with this interpreter standing in for the image's trainer one.
    load_pipeline_config(REPO / env["PIPELINE_CONFIG"], trainer_python=sys.executable)


def test_copies_the_trainers_and_everything_the_worker_image_copies(instructions, worker_image):
    """COPY brings in trainers/ and every path the worker image copies, and each exists in the repository."""
    copied = _copied(instructions)
    assert _copied(worker_image) | {"trainers"} <= copied
    assert not sorted(s for s in copied if not (REPO / s).exists())


def test_dockerignore_keeps_the_trainer_virtualenv_out(instructions):
    """.dockerignore excludes a local trainers/.venv (gigabytes, and built for another machine)."""
    entries = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert "trainers/.venv" in entries
    assert not _copied(instructions) & entries


def test_the_real_pipeline_runs_every_stage_with_the_trainer_interpreter():
    """Every stage of config/pipeline.real.toml starts with {trainer_python}: none runs in the worker's interpreter."""
    config = load_pipeline_config(REPO / "config" / "pipeline.real.toml", trainer_python=sys.executable)
    assert config.stages and all(stage.argv[0] == "{trainer_python}" for stage in config.stages)


def test_labels_say_the_version_and_revision_like_the_worker_image(instructions, worker_image):
    """The trainer image takes the worker image's VERSION and REVISION build args and labels itself with
    them, under a title of its own."""
    assert _all(instructions, "ARG") == _all(worker_image, "ARG")
    labels = " ".join(_all(instructions, "LABEL"))
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    assert 'org.opencontainers.image.revision="${REVISION}"' in labels
    assert 'org.opencontainers.image.title="voice-worker-trainer"' in labels


def test_the_trainer_image_leaves_the_demo_clips_out(instructions):
    """samples/ (the demos' recordings) is not copied, as in the worker image."""
    assert "samples" not in _copied(instructions)
