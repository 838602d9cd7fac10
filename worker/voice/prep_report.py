"""The data-preparation report the real trainers' embed stage writes (``prep/report.json`` under the
output dir; docs/trainer.md, "Data preparation"), read strictly, and what of it the job record keeps.

The path is fixed: it is where the trainers write it, and config/pipeline.real.toml declares it an output
of the embed stage, so the worker's output check has verified it by the time the stages are done. A
pipeline whose stages write no such file (the reference stand-in) records nothing. The report is a
stage's output, read as untrusted like the evaluation report (worker.voice.quality): at most
``MAX_REPORT_BYTES``, a regular file reached without a symlink, exactly the schema below. Anything else is
``BadPrepReport`` (permanent: the stage broke its contract), in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from worker.voice import stage_report
from worker.voice.errors import BadPrepReport

REPORT_PATH = "prep/report.json"
# A report of thousands of clips is about 100 bytes a clip.
MAX_REPORT_BYTES = 4 << 20
MAX_CLIPS = 20_000
# What the job record keeps of the lists: the first clips, and how many more there were.
RECORD_KEPT = 200
RECORD_LEFT_OUT = 200

_Id = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,140}$")]
_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Count = Annotated[int, Field(ge=0)]
_Reason = Literal["blank_text", "no_speech", "not_segmentable", "too_short", "too_long", "clipped", "noisy",
                  "phoneme_rate", "transcript_mismatch", "another_speaker"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Minimum(_Strict):
    speechS: _Seconds
    clips: _Count


class Totals(_Strict):
    recordings: _Count
    recordingsS: _Seconds
    keptClips: _Count
    keptS: _Seconds
    leftOutClips: _Count
    leftOutByReason: Annotated[dict[_Reason, _Count], Field(max_length=16)]


class Kept(_Strict):
    id: _Id
    source: _Count
    seconds: _Seconds


class LeftOut(_Strict):
    id: _Id
    source: _Count
    reason: _Reason
    detail: Annotated[str, StringConstraints(max_length=300)]
    seconds: _Seconds


class PrepReport(_Strict):
    version: Literal[1]
    profile: Annotated[str, StringConstraints(max_length=32)]
    minimum: Minimum
    totals: Totals
    kept: Annotated[list[Kept], Field(max_length=MAX_CLIPS)]
    leftOut: Annotated[list[LeftOut], Field(max_length=MAX_CLIPS)]
    refused: Annotated[str, StringConstraints(max_length=500)] | None


def read_prep_report(output_dir: Path) -> PrepReport | None:
    """The report under ``output_dir``, None when the stages wrote none, or ``BadPrepReport``."""
    return stage_report.read_report(output_dir / REPORT_PATH, PrepReport, what=f"preparation report {REPORT_PATH}",
                                    max_bytes=MAX_REPORT_BYTES, error=BadPrepReport)


def dataset_record(report: PrepReport) -> dict:
    """The job record's ``dataset``: the totals, the minimum, and the clips kept and left out (the first
    ``RECORD_KEPT`` / ``RECORD_LEFT_OUT`` of each, with how many more the report lists)."""
    return {
        "profile": report.profile,
        "minimum": report.minimum.model_dump(),
        "totals": report.totals.model_dump(),
        "kept": [clip.model_dump() for clip in report.kept[:RECORD_KEPT]],
        "keptNotListed": max(0, len(report.kept) - RECORD_KEPT),
        "leftOut": [clip.model_dump() for clip in report.leftOut[:RECORD_LEFT_OUT]],
        "leftOutNotListed": max(0, len(report.leftOut) - RECORD_LEFT_OUT),
        "refused": report.refused,
    }


def summary_line(dataset: dict) -> str:
    """One line for ``status``: ``kept 11 clips (44.3 s of 65.3 s), left out 5: another_speaker 1, ...``."""
    totals = dataset.get("totals") if isinstance(dataset, dict) else None
    if not isinstance(totals, dict):
        return "?"
    reasons = totals.get("leftOutByReason") or {}
    why = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()) if isinstance(reason, str))
    left = f", left out {totals.get('leftOutClips', '?')}" + (f": {why}" if why else "")
    return (f"kept {totals.get('keptClips', '?')} clips ({_seconds(totals.get('keptS'))} of"
            f" {_seconds(totals.get('recordingsS'))} recorded){left}")


def _seconds(value: object) -> str:
    return f"{value:.1f} s" if isinstance(value, int | float) else "?"
