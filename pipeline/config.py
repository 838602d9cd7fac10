"""The pipeline's stage list (``PIPELINE_CONFIG``, TOML), validated once at worker start-up.

A config that cannot work must stop the worker before it takes a job, so ``load_pipeline_config``
collects every problem it finds and raises one ``ConfigError`` with a line per problem rather than
failing on the first. Stage commands are argv arrays whose elements may hold placeholders; they are
substituted element by element (``render_argv``), so a value never becomes shell syntax or splits
into two arguments.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.base_model import BaseModelSpec, parse_base_model
from worker.core.errors import ConfigError

# The artifact keys every pipeline config must declare: the product's profile schema names them
# (``modelPaths``/``s3Paths``). A config may declare more; what a job produces, uploads, publishes and
# commits is its config's whole ``[artifacts]`` table (``PipelineConfig.artifact_keys``), and the
# records judge a completed job against the set it committed (worker.voice.records.rules.is_complete).
REQUIRED_ARTIFACTS = ("fullModel", "fullConfig", "speakerEmbeddings", "lightModel", "lightConfig")
# An artifact key becomes a field name in the profile's path maps: plain letters and digits only.
ARTIFACT_KEY = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")

PLACEHOLDERS = frozenset(
    {"python", "trainer_python", "dataset_dir", "output_dir", "checkpoint_dir", "log_dir", "job_id",
     "language", "base_model_dir", "device"}
)
# What a stage's ``device`` may say; ``{device}`` in its argv stands for it. "cuda" also makes the
# worker probe the trainer for a GPU at start (pipeline/host.py).
DEVICES = frozenset({"cpu", "cuda"})
# The signals a stage may ask for as its "write a checkpoint now" notice. SIGTERM is the stop itself
# and SIGKILL/SIGSTOP cannot be handled; the rest have defaults a trainer would not want by surprise.
CHECKPOINT_SIGNALS = frozenset({"SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT"})
# Manifests live under the output dir; no stage may declare (and so delete) anything in there.
MANIFEST_DIR_NAME = ".manifests"

_STAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_STAGE_KEYS = frozenset(
    {"name", "argv", "outputs", "resumable", "permanent_exit_codes", "timeout_seconds",
     "checkpoint_signal", "device", "weight"}
)
_TOP_KEYS = frozenset({"artifacts", "stages", "quality", "pipeline", "base_model"})
# [quality]: where the evaluation stage writes its report, and the gate the worker holds it to.
_QUALITY_KEYS = frozenset({"report", "gate"})
_GATE_KEYS = frozenset({"min_speaker_similarity", "max_cer", "min_dnsmos_ovrl", "require_sanity"})
_PIPELINE_KEYS = frozenset({"stand_in"})
_FORMATTER = string.Formatter()


@dataclass(frozen=True)
class StageSpec:
    name: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...]  # normalised, relative to the output dir
    resumable: bool = False
    permanent_exit_codes: frozenset[int] = frozenset()
    timeout_s: float | None = None
    # Sent to the stage's own process (never its children) when a shutdown starts: a trainer that
    # handles it writes a checkpoint inside the grace instead of losing the work since its last one.
    checkpoint_signal: signal.Signals | None = None
    # ``device = "cpu" | "cuda"``: what ``{device}`` stands for; None when the stage declares none.
    device: str | None = None
    # The base model's digest when the stage reads ``{base_model_dir}``: another base voids its manifests.
    base_digest: str | None = None
    # ``weight``: the stage's share of a job's time, for the overall percent and the ETA that ``status``
    # shows (``worker.voice.records.training``). Not in the fingerprint: it changes nothing a stage does.
    weight: float = 1.0

    @property
    def fingerprint(self) -> str:
        """Identifies what the stage does, so a manifest from a differently configured stage is void."""
        described: dict[str, object] = {"argv": list(self.argv), "outputs": list(self.outputs)}
        # Added only when set, so the manifests of stages that use neither keep their fingerprints.
        if self.device is not None:
            described["device"] = self.device
        if self.base_digest is not None:
            described["base"] = self.base_digest
        return hashlib.sha256(json.dumps(described).encode()).hexdigest()


@dataclass(frozen=True)
class QualityGate:
    """``[quality.gate]``: the bars each trained model (full and light) must clear to be committed.

    A bar left out is not applied. A CER the report leaves null (no speech recogniser for the
    language) fails no ``max_cer`` bar."""

    min_speaker_similarity: float | None = None
    max_cer: float | None = None
    min_dnsmos_ovrl: float | None = None
    require_sanity: bool = False


@dataclass(frozen=True)
class QualityConfig:
    """``[quality]``: the evaluation report a stage writes (``report``, relative to the output dir) and,
    when ``gate`` is set, the bars it must clear; without a gate the report is recorded only."""

    report: str
    gate: QualityGate | None = None


@dataclass(frozen=True)
class PipelineConfig:
    artifacts: Mapping[str, str]  # artifact key -> normalised path relative to the output dir
    stages: tuple[StageSpec, ...]
    # ``{trainer_python}``: the interpreter of the trainers' own virtualenv (``TRAINER_PYTHON``).
    trainer_python: str = ""
    # [quality]: None when the pipeline writes no evaluation report.
    quality: QualityConfig | None = None
    # [pipeline] stand_in: the stages are the reference stand-in, not a real trainer (a job for staging
    # or production is then refused unless ALLOW_STAND_IN_TRAINER says otherwise).
    stand_in: bool = False
    # [base_model]: the pinned base the stages start from (pipeline/base_model.py); None without one.
    base_model: BaseModelSpec | None = None
    # ``{base_model_dir}``: the verified cache entry, set by the worker once the host check passed.
    base_model_dir: str = ""

    @property
    def artifact_keys(self) -> tuple[str, ...]:
        """The configured artifacts' keys, in the config's order: the set a job produces and commits."""
        return tuple(self.artifacts)


def load_pipeline_config(path: str | Path, trainer_python: str = "") -> PipelineConfig:
    """Read and validate the TOML file; raises ``ConfigError`` with one line per problem.

    ``trainer_python`` is what ``{trainer_python}`` stands for (the ``TRAINER_PYTHON`` setting).
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"pipeline config {path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"pipeline config {path}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"pipeline config {path}: not valid TOML ({exc})") from None
    return parse_pipeline_config(data, source=str(path), trainer_python=trainer_python)


def parse_pipeline_config(data: Mapping[str, Any], source: str = "pipeline config",
                          trainer_python: str = "") -> PipelineConfig:
    """Validate an already-parsed config mapping; raises ``ConfigError`` with one line per problem."""
    problems: list[str] = []
    for key in sorted(set(data) - _TOP_KEYS):
        problems.append(f"unknown top-level key {key!r}")
    artifacts = _parse_artifacts(data.get("artifacts"), problems)
    # Outputs of stages with other problems count too, so one mistake is reported once.
    produced: set[str] = set()
    stages = _parse_stages(data.get("stages"), problems, produced)
    for key, rel in artifacts.items():
        if rel not in produced:
            problems.append(f"artifacts.{key}: {rel!r} is not among any stage's outputs")
    users = [stage.name for stage in stages if any(uses_placeholder(a, "trainer_python") for a in stage.argv)]
    if users and (why := trainer_python_problem(trainer_python)):
        problems.append(f"stages {', '.join(users)} use {{trainer_python}}, but TRAINER_PYTHON {why}")
    quality = _parse_quality(data.get("quality"), problems, produced)
    stand_in = _parse_pipeline_table(data.get("pipeline"), problems)
    base_model = parse_base_model(data.get("base_model"), problems)
    stages = _check_base_and_devices(stages, data.get("base_model") is not None, base_model, trainer_python,
                                     problems)
    if problems:
        raise ConfigError([f"{source}: {line}" for line in problems])
    return PipelineConfig(artifacts=dict(artifacts), stages=tuple(stages), trainer_python=trainer_python,
                          quality=quality, stand_in=stand_in, base_model=base_model)


def _check_base_and_devices(stages: list[StageSpec], declared: bool, base_model: BaseModelSpec | None,
                            trainer_python: str, problems: list[str]) -> list[StageSpec]:
    """The stages that read ``{base_model_dir}`` need a ``[base_model]`` (and are fingerprinted with its
    digest); ``{device}`` needs the stage's ``device``; a cuda stage needs ``TRAINER_PYTHON`` for the probe."""
    checked = []
    for stage in stages:
        if any(uses_placeholder(a, "device") for a in stage.argv) and stage.device is None:
            problems.append(f"stage {stage.name!r}: argv uses {{device}}, but the stage declares no device "
                            f"({' or '.join(sorted(DEVICES))})")
        if any(uses_placeholder(a, "base_model_dir") for a in stage.argv):
            if not declared:
                problems.append(f"stage {stage.name!r}: argv uses {{base_model_dir}}, but the config has no "
                                "[base_model] table")
            elif base_model is not None:
                stage = replace(stage, base_digest=base_model.digest_hex)
        checked.append(stage)
    cuda = [stage.name for stage in stages if stage.device == "cuda"]
    if cuda and (why := trainer_python_problem(trainer_python)):
        problems.append(f"stages {', '.join(cuda)} declare device = \"cuda\": the start-up probe runs "
                        f"{{trainer_python}} -m voice_trainers probe, but TRAINER_PYTHON {why}")
    return checked


def _parse_pipeline_table(raw: Any, problems: list[str]) -> bool:
    """``[pipeline]``: ``stand_in`` (default false)."""
    if raw is None:
        return False
    if not isinstance(raw, Mapping):
        problems.append("pipeline must be a table")
        return False
    for key in sorted(set(raw) - _PIPELINE_KEYS):
        problems.append(f"pipeline: unknown key {key!r}")
    stand_in = raw.get("stand_in", False)
    if not isinstance(stand_in, bool):
        problems.append("pipeline.stand_in must be true or false")
        return False
    return stand_in


def _parse_quality(raw: Any, problems: list[str], produced: set[str]) -> QualityConfig | None:
    """``[quality]`` with its ``report`` path (one of a stage's outputs) and optional ``[quality.gate]``."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        problems.append("quality must be a table")
        return None
    before = len(problems)
    for key in sorted(set(raw) - _QUALITY_KEYS):
        problems.append(f"quality: unknown key {key!r}")
    report = raw.get("report")
    normalised = None
    if not isinstance(report, str):
        problems.append("quality.report: must be a string path relative to the output dir "
                        "(e.g. \"eval/quality.json\")")
    else:
        normalised, why = normalise_output_path(report)
        if normalised is None:
            problems.append(f"quality.report: {report!r} {why}")
        elif normalised not in produced:
            problems.append(f"quality.report: {normalised!r} is not among any stage's outputs")
    gate = _parse_gate(raw.get("gate"), problems)
    if len(problems) > before or normalised is None:
        return None
    return QualityConfig(report=normalised, gate=gate)


def _parse_gate(raw: Any, problems: list[str]) -> QualityGate | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        problems.append("quality.gate must be a table")
        return None
    for key in sorted(set(raw) - _GATE_KEYS):
        problems.append(f"quality.gate: unknown key {key!r}")
    bars: dict[str, Any] = {}
    for key, low, high in (("min_speaker_similarity", -1.0, 1.0), ("max_cer", 0.0, None),
                           ("min_dnsmos_ovrl", 1.0, 5.0)):
        value = raw.get(key)
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                or value < low or (high is not None and value > high)):
            limits = f"{low:g}..{high:g}" if high is not None else f"at least {low:g}"
            problems.append(f"quality.gate.{key}: must be a number {limits}, got {value!r}")
            continue
        bars[key] = float(value)
    require_sanity = raw.get("require_sanity", False)
    if not isinstance(require_sanity, bool):
        problems.append("quality.gate.require_sanity must be true or false")
        require_sanity = False
    return QualityGate(**bars, require_sanity=require_sanity)


def uses_placeholder(element: str, name: str) -> bool:
    try:
        return any(field == name for _literal, field, _spec, _conv in _FORMATTER.parse(element))
    except ValueError:
        return False  # malformed braces are reported by placeholder_problems


def trainer_python_problem(path: str) -> str | None:
    """Why ``path`` cannot be the trainers' interpreter, or None. Checked at start, so a missing
    trainer environment stops the worker before it takes a job, not at the job's first stage."""
    if not path:
        return "is not set (the trainers' virtualenv interpreter, e.g. /opt/trainers/bin/python)"
    if not os.path.isabs(path):
        return f"{path!r} is not an absolute path"
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return f"{path!r} is not an executable file (is the trainer environment installed?)"
    return None


def placeholder_problems(element: str) -> list[str]:
    """What is wrong with one argv element's placeholders (empty when it renders safely)."""
    try:
        fields = list(_FORMATTER.parse(element))
    except ValueError as exc:
        return [f"malformed braces ({exc}); write a literal brace as {{{{ or }}}}"]
    problems = []
    for _literal, field, spec, conversion in fields:
        if field is None:
            continue
        if field not in PLACEHOLDERS:
            problems.append(f"unknown placeholder {{{field}}}")
        elif spec or conversion:
            problems.append(f"placeholder {{{field}}} takes no format spec or conversion")
    return problems


def render_argv(argv: tuple[str, ...] | list[str], values: Mapping[str, str]) -> list[str]:
    """Substitute placeholders in each element separately; the result is always an argv list."""
    rendered = []
    for element in argv:
        parts = []
        # Our own join instead of str.format: format would also honour {x.attr} and {x[i]}.
        for literal, field, _spec, _conversion in _FORMATTER.parse(element):
            parts.append(literal)
            if field is not None:
                parts.append(str(values[field]))
        rendered.append("".join(parts))
    return rendered


def normalise_output_path(raw: str) -> tuple[str | None, str | None]:
    """(normalised relative path, None) or (None, why it is not a path inside the output dir)."""
    if not raw or not raw.strip():
        return None, "is empty"
    if "\\" in raw or "\x00" in raw:
        return None, "contains a backslash or NUL"
    if "{" in raw or "}" in raw:
        return None, "contains a placeholder; outputs are plain paths relative to {output_dir}"
    path = PurePosixPath(raw)
    if path.is_absolute():
        return None, "is absolute; it must be relative to the output dir"
    if any(part == ".." for part in path.parts):
        return None, "escapes the output dir"
    if not path.parts or str(path) == ".":
        return None, "names the output dir itself"
    if path.parts[0] == MANIFEST_DIR_NAME:
        return None, f"is inside the reserved {MANIFEST_DIR_NAME}/ directory"
    return str(path), None


def _parse_artifacts(raw: Any, problems: list[str]) -> dict[str, str]:
    """The ``[artifacts]`` table in its own order: every required key, plus any others it declares."""
    if raw is None:
        problems.append("missing [artifacts] table (needs at least " + ", ".join(REQUIRED_ARTIFACTS) + ")")
        return {}
    if not isinstance(raw, Mapping):
        problems.append("artifacts must be a table")
        return {}
    for key in REQUIRED_ARTIFACTS:
        if key not in raw:
            problems.append(f"artifacts: missing required key {key!r} (the profile's paths name "
                            f"{', '.join(REQUIRED_ARTIFACTS)}; a config may add more)")
    artifacts: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not ARTIFACT_KEY.fullmatch(key):
            problems.append(f"artifacts: key {key!r} is not a plain name (a letter, then letters and "
                            "digits; at most 64)")
            continue
        if not isinstance(value, str):
            problems.append(f"artifacts.{key}: must be a string path")
            continue
        normalised, why = normalise_output_path(value)
        if normalised is None:
            problems.append(f"artifacts.{key}: {value!r} {why}")
        else:
            artifacts[key] = normalised
    return artifacts


def _parse_stages(raw: Any, problems: list[str], produced: set[str]) -> list[StageSpec]:
    if raw is None:
        problems.append("missing [[stages]]: at least one stage is needed")
        return []
    if not isinstance(raw, list) or not raw:
        problems.append("stages must be a non-empty array of tables ([[stages]])")
        return []
    stages: list[StageSpec] = []
    seen_names: set[str] = set()
    owner_of: dict[str, str] = {}
    for index, table in enumerate(raw):
        label = f"stages[{index}]"
        if not isinstance(table, Mapping):
            problems.append(f"{label}: must be a table")
            continue
        name = table.get("name")
        if isinstance(name, str) and _STAGE_NAME.fullmatch(name):
            label = f"stage {name!r}"
            if name in seen_names:
                problems.append(f"{label}: duplicate stage name")
            seen_names.add(name)
        elif name is None:
            problems.append(f"{label}: missing name")
        else:
            problems.append(
                f"{label}: name {name!r} is not a safe path component "
                "(letters, digits, '.', '_', '-'; starting with a letter or digit; at most 64)"
            )
        stage = _parse_stage_body(table, label, problems, produced)
        if stage is None or not isinstance(name, str):
            continue
        for out in stage["outputs"]:
            if out in owner_of:
                problems.append(f"{label}: output {out!r} is already declared by {owner_of[out]}")
            owner_of.setdefault(out, label)
        stages.append(StageSpec(name=name, **stage))
    return stages


def _parse_stage_body(
    table: Mapping[str, Any], label: str, problems: list[str], produced: set[str]
) -> dict | None:
    before = len(problems)
    for key in sorted(set(table) - _STAGE_KEYS):
        problems.append(f"{label}: unknown key {key!r}")
    argv = table.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        problems.append(f"{label}: argv must be an array of strings")
        argv = []
    elif not argv or not argv[0].strip():
        problems.append(f"{label}: argv is empty; it needs at least a program")
    for position, element in enumerate(argv):
        for why in placeholder_problems(element):
            problems.append(f"{label}: argv[{position}]: {why}")
    outputs_raw = table.get("outputs")
    outputs: list[str] = []
    if not isinstance(outputs_raw, list) or not outputs_raw:
        problems.append(f"{label}: outputs must be a non-empty array of paths")
    else:
        for raw in outputs_raw:
            if not isinstance(raw, str):
                problems.append(f"{label}: outputs entries must be strings, got {raw!r}")
                continue
            normalised, why_not = normalise_output_path(raw)
            if normalised is None:
                problems.append(f"{label}: output {raw!r} {why_not}")
            elif normalised in outputs:
                problems.append(f"{label}: output {raw!r} is listed twice")
            else:
                outputs.append(normalised)
                produced.add(normalised)
    resumable = table.get("resumable", False)
    if not isinstance(resumable, bool):
        problems.append(f"{label}: resumable must be true or false")
    codes = table.get("permanent_exit_codes", [])
    if not isinstance(codes, list) or not all(_is_exit_code(c) for c in codes):
        problems.append(f"{label}: permanent_exit_codes must be an array of integers 1..255")
        codes = []
    timeout = table.get("timeout_seconds")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        problems.append(f"{label}: timeout_seconds must be a positive number")
    checkpoint_signal = table.get("checkpoint_signal")
    if checkpoint_signal is not None and (not isinstance(checkpoint_signal, str)
                                          or checkpoint_signal not in CHECKPOINT_SIGNALS):
        problems.append(f"{label}: checkpoint_signal must be one of {', '.join(sorted(CHECKPOINT_SIGNALS))}")
    device = table.get("device")
    if device is not None and device not in DEVICES:
        problems.append(f"{label}: device must be one of {', '.join(sorted(DEVICES))}")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < 1e6:
        problems.append(f"{label}: weight must be a number above 0 (a share of the job's time; default 1)")
    if len(problems) > before:
        return None
    return {
        "weight": float(weight),
        "device": device,
        "argv": tuple(argv),
        "outputs": tuple(outputs),
        "resumable": resumable,
        "permanent_exit_codes": frozenset(codes),
        "timeout_s": float(timeout) if timeout is not None else None,
        "checkpoint_signal": signal.Signals[checkpoint_signal] if checkpoint_signal else None,
    }


def _is_exit_code(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 255
