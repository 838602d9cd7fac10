"""The documentation stays true to the repository: links, setting names, the sample job, commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.config import REQUIRED_ARTIFACTS
from pipeline.stage_env import BUILTIN_NAMES
from tests.support import SHIPPED_CONFIG
from worker.ops.cli import build_parser
from worker.settings import ENV_NAMES
from worker.voice.input_policy import InputPolicy
from worker.voice.submit import prepare

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CHANGELOG = REPO / "CHANGELOG.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
SAMPLE_JOB = REPO / "samples" / "job.json"

# ALL_CAPS names the docs may mention that are not worker settings: variables read by AWS tooling
# (the dev stack's env.sh sets the first two), the stage runner's process token and job mark, the prctl
# option the stage keeper sets, variables a stage does or may get (plus the built-in allow-list
# below), a fragment of the secret-name rule, and the JOB_ID placeholder of command examples.
NOT_SETTINGS = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "VOICE_WORKER_STAGE_RUN", "VOICE_WORKER_JOB", "VOICE_WORKER_ATTEMPT", "PR_SET_PDEATHSIG",
    "HF_HOME", "TORCH_HOME", "PYTORCH_CUDA_ALLOC_CONF", "HF_TOKEN", "VIRTUAL_ENV",
    "CONNECTION_STRING",
    "JOB_ID",
    # The store tests' real MongoDB server (tests/mongo_server.py), not the worker's.
    "MONGO_TEST_URI",
    # Kernel and AWS names in the trainer-isolation notes.
    "PR_SET_DUMPABLE", "CAP_SYS_PTRACE", "ECS_AWSVPC_BLOCK_IMDS", "ECS_ENABLE_SPOT_INSTANCE_DRAINING",
    "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
}) | frozenset(BUILTIN_NAMES)

# Subcommands the docs describe that are being added to worker/ops/cli.py in a parallel change.
KNOWN_PENDING: frozenset[str] = frozenset()

_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
_CAPS_NAME = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")
_COMMAND = re.compile(r"python -m worker\s+([a-z][a-z-]*)(?:\s+([a-z][a-z-]*))?")
_OUTSIDE_PATH = re.compile(r"(?<![\w./-])(?:\.\./|/work/shared\b)[\w./-]*")


def _relative_links(path: Path) -> list[str]:
    """The link targets in a Markdown file that point into the repository (no URLs; anchors included)."""
    return [target for target in _LINK.findall(path.read_text(encoding="utf-8"))
            if not _EXTERNAL.match(target)]


def _anchors(path: Path) -> set[str]:
    """The heading anchors of a Markdown file, slugged the way GitHub slugs them."""
    anchors, in_code = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (heading := re.match(r"#{1,6}\s+(.*?)\s*$", line)):
            text = re.sub(r"[^\w\- ]", "", heading.group(1).lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def _subcommands() -> dict[str, list[str]]:
    """Each subcommand of ``python -m worker`` and the choices of its first positional argument."""
    parser = build_parser()
    commands = {}
    for action in parser._subparsers._group_actions:  # argparse keeps subparsers only here
        for name, sub in action.choices.items():
            choices = [choice for a in sub._actions if not a.option_strings and a.choices
                       for choice in a.choices]
            commands[name] = choices
    return commands


def test_docs_exist():
    """The three design and operations pages this test guards are present."""
    assert {p.name for p in DOCS} >= {"design.md", "trainer.md", "operations.md"}


@pytest.mark.parametrize("doc", [README, CHANGELOG, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repo(doc):
    """Every relative link in README.md, CHANGELOG.md and docs/*.md names an existing file (and heading) in the repo."""
    problems = []
    for target in _relative_links(doc):
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve() if file_part else doc
        if REPO not in (resolved, *resolved.parents):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(f"{target}: no such heading")
    assert not problems, f"{doc.name}: " + "; ".join(problems)


def test_readme_refers_to_nothing_outside_the_repo():
    """README.md neither links nor names a path outside the repository (no ../shared)."""
    text = README.read_text(encoding="utf-8")
    outside = _OUTSIDE_PATH.findall(text)
    assert not outside, f"README.md refers outside the repository: {outside}"


def test_settings_named_in_docs_exist():
    """Every ALL_CAPS variable name in docs/*.md and CHANGELOG.md is a real setting or an allow-listed non-setting."""
    unknown = {}
    for doc in [CHANGELOG, *DOCS]:
        for name in set(_CAPS_NAME.findall(doc.read_text(encoding="utf-8"))):
            if name not in ENV_NAMES and name not in NOT_SETTINGS:
                unknown.setdefault(doc.name, []).append(name)
    assert not unknown, f"not settings (worker.settings.ENV_NAMES) nor allow-listed: {unknown}"


def test_sample_job_is_a_valid_submission():
    """samples/job.json passes submit's validation, also under the dev stack's recordings scope."""
    payload = json.loads(SAMPLE_JOB.read_text(encoding="utf-8"))
    assert "jobId" not in payload and "_doc" not in payload, "submit generates jobId and _doc"
    prepare(payload)
    _body, job, _key = prepare(payload, InputPolicy(recordings_bucket="voice-recordings"))
    assert job.environment == "development"
    for recording in job.recordings:
        name = recording.url.path.rsplit("/", 1)[1]
        assert (REPO / "samples" / name).is_file(), f"{recording.url} names no clip in samples/"


def test_documented_commands_exist():
    """Every `python -m worker <cmd>` in README.md, CHANGELOG.md and docs/*.md names a real subcommand (and dlq action)."""
    commands = _subcommands()
    problems = []
    for doc in [README, CHANGELOG, *DOCS]:
        for command, argument in _COMMAND.findall(doc.read_text(encoding="utf-8")):
            if command not in commands and command not in KNOWN_PENDING:
                problems.append(f"{doc.name}: {command}")
            elif command == "dlq" and argument and argument not in commands["dlq"]:
                problems.append(f"{doc.name}: dlq {argument}")
    assert not problems, f"not subcommands of python -m worker: {problems}"


def _artifact_table(path: Path) -> list[str]:
    """The keys of the first ``| key | what it is |`` table in a Markdown file, in order."""
    keys, inside = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("| key | what it is |"):
            inside = True
        elif inside and (row := re.match(r"\|\s*`([^`]+)`\s*\|", line)):
            keys.append(row.group(1))
        elif inside and not line.startswith("|"):
            break
    return keys


def test_the_artifact_table_is_the_shipped_configs():
    """docs/trainer.md's artifact table lists the shipped config's [artifacts] keys, in its order, and
    every key the config requires: the config is the one declaration, the table follows it."""
    keys = _artifact_table(REPO / "docs" / "trainer.md")
    assert tuple(keys) == SHIPPED_CONFIG.artifact_keys, "docs/trainer.md's table against config/pipeline.toml"
    assert set(REQUIRED_ARTIFACTS) <= set(keys)
