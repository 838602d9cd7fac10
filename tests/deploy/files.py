"""Readers for the deployment files, small enough to trust: systemd units, Dockerfile, env example.

Each returns plain Python values so the tests state facts about them in one line.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

_TIMESPAN_UNITS_S = {"": 1, "s": 1, "sec": 1, "ms": 0.001, "min": 60, "m": 60, "h": 3600}


# --- systemd


@dataclass(frozen=True)
class Unit:
    """A unit file as (section, key, value) entries, in file order; keys may repeat."""

    entries: tuple[tuple[str, str, str], ...]

    def values(self, section: str, key: str) -> list[str]:
        return [v for s, k, v in self.entries if s == section and k == key]

    def value(self, section: str, key: str) -> str:
        found = self.values(section, key)
        if len(found) != 1:
            raise AssertionError(f"[{section}] {key}= appears {len(found)} times, expected once")
        return found[0]

    def keys(self, section: str) -> set[str]:
        return {k for s, k, _ in self.entries if s == section}

    def environment(self) -> dict[str, str]:
        """Every Environment= assignment, later ones winning as systemd does."""
        env: dict[str, str] = {}
        for line in self.values("Service", "Environment"):
            for word in shlex.split(line):
                name, _, value = word.partition("=")
                env[name] = value
        return env


def read_unit(path: Path) -> Unit:
    """Parse a unit the way systemd reads it: sections, comments, backslash continuations."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise AssertionError(f"{path.name}: not a key=value line: {line!r}")
        entries.append((section, key.strip(), value.strip()))
    return Unit(tuple(entries))


def timespan_s(text: str) -> float:
    """A systemd time span such as ``150``, ``150s``, ``5min`` or ``1h 30min``, in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise AssertionError(f"not a systemd time span: {text!r}")
    return sum(float(number) * _TIMESPAN_UNITS_S[unit] for number, unit in parts)


# --- Dockerfile


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def read_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line = (pending + stripped).strip()
        pending = ""
        if line:
            keyword, _, args = line.partition(" ")
            instructions.append(Instruction(keyword.upper(), " ".join(args.split())))
    return instructions


def env_instructions(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for word in shlex.split(ins.args):
                name, _, value = word.partition("=")
                env[name] = value
    return env


# --- env example

_ASSIGNMENT = re.compile(r"^(#?)([A-Z][A-Z0-9_]*)=(.*)$")
_GROUP = re.compile(r"^# --- (.+)$")


@dataclass(frozen=True)
class EnvLine:
    name: str
    value: str
    active: bool  # uncommented: a value the operator must set
    comment: str  # the comment line right above it


def read_env_example(path: Path) -> tuple[list[EnvLine], list[str]]:
    """(the assignments, the ``# --- group`` headings), both in file order."""
    lines: list[EnvLine] = []
    groups: list[str] = []
    previous = ""
    for raw in path.read_text().splitlines():
        if group := _GROUP.match(raw):
            groups.append(group.group(1).strip())
        elif match := _ASSIGNMENT.match(raw):
            commented, name, value = match.groups()
            above = previous[1:].strip() if previous.startswith("# ") else ""
            lines.append(EnvLine(name, value, active=not commented, comment=above))
        previous = raw
    return lines, groups


def settings_groups() -> list[str]:
    """The ``# --- group`` headings of worker/settings.py, in order, each up to any ``:`` remark."""
    source = (REPO / "worker" / "settings.py").read_text()
    headings = re.finditer(r"^\s*# --- (.+)$", source, re.MULTILINE)
    return [m.group(1).partition(":")[0].strip() for m in headings]


# --- start-up budget

# connect_mongo's serverSelectionTimeoutMS (worker/voice/records/mongo.py): the longest one ping may take.
MONGO_PING_TIMEOUT_S = 5.0


def store_connect_worst_s(settings) -> float:
    """Longest the worker can spend reaching MongoDB before it is ready (every ping times out)."""
    attempts = settings.mongo_connect_max_attempts
    delays_s = settings.mongo_connect_retry_delay_s * sum(range(1, attempts))
    return attempts * MONGO_PING_TIMEOUT_S + delays_s
