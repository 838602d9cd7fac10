"""The evaluation report a pipeline's evaluate stage writes, read strictly; its figures for the records,
the events and the metrics; and the quality gate.

The pipeline config says where the report lies (``[quality] report``, relative to the output dir, one of
a stage's outputs) and, with ``[quality.gate]``, the bars every trained model (``full`` and ``light``)
must clear. The handler reads the report after the stages, keeps its figures on the job record
(``quality``, fenced), and then either commits (the figures go onto the profile too) or, when a model
is below a bar, ends the job ``refused`` with nothing committed (``worker.voice.errors.QualityBelowBar``).

The report is a stage's output, so it is read as untrusted: at most ``MAX_REPORT_BYTES``, a regular
file reached without a symlink, JSON of exactly the schema below with finite numbers. Anything else is
``BadQualityReport`` (permanent: the stage broke its contract), in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from pipeline.config import QualityGate
from worker.core.metrics import Metrics
from worker.voice import stage_report
from worker.voice.errors import BadQualityReport
from worker.voice.metrics import MODEL_CER, MODEL_DIMENSION, MODEL_DNSMOS, MODEL_SPEAKER_SIMILARITY

MAX_REPORT_BYTES = 1 << 20
# The models the gate judges, each of which the report must score.
GATED_MODELS = ("full", "light")
# CloudWatch's unit for a plain number (a score, a rate).
NO_UNIT = "None"

_Text = Annotated[str, StringConstraints(max_length=500)]
_Score = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Dnsmos(_Strict):
    ovrl: Annotated[float, Field(ge=0, le=5, allow_inf_nan=False)]
    sig: Annotated[float, Field(ge=0, le=5, allow_inf_nan=False)]
    bak: Annotated[float, Field(ge=0, le=5, allow_inf_nan=False)]


class Sanity(_Strict):
    ok: bool
    problems: Annotated[list[_Text], Field(max_length=50)]
    rms_dbfs: _Score | None = None
    peak_dbfs: _Score | None = None
    clipped_fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    seconds_per_char: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


class ModelScores(_Strict):
    speaker_similarity: Annotated[float, Field(ge=-1, le=1, allow_inf_nan=False)]
    cer: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None
    wer: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None
    asr: _Text | None
    asr_unavailable: _Text | None
    dnsmos: Dnsmos | None
    sanity: Sanity

    @model_validator(mode="after")
    def _cer_or_why_not(self) -> ModelScores:
        if self.cer is None and not self.asr_unavailable:
            raise ValueError("cer is null but asr_unavailable gives no reason")
        return self


class Cost(_Strict):
    cpu_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    wall_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    peak_rss_mib: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class QualityReport(_Strict):
    version: Literal[1]
    language: Annotated[str, StringConstraints(max_length=32)]
    sentences: Annotated[list[_Text], Field(max_length=100)]
    models: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")], ModelScores],
                      Field(max_length=8)]
    reference: ModelScores | None = None
    cost: Cost | None = None

    @model_validator(mode="after")
    def _every_gated_model(self) -> QualityReport:
        missing = [name for name in GATED_MODELS if name not in self.models]
        if missing:
            raise ValueError("models: no scores for " + ", ".join(missing))
        return self


def read_report(path: Path, shown_as: str) -> QualityReport:
    """The report at ``path`` (``shown_as`` names it in the error), or ``BadQualityReport``."""
    what = f"quality report {shown_as}"
    report = stage_report.read_report(path, QualityReport, what=what, max_bytes=MAX_REPORT_BYTES,
                                      error=BadQualityReport)
    if report is None:
        raise BadQualityReport(f"{what}: the stages wrote no report")
    return report


def _number(value: float, bar: float) -> str:
    """``value`` as the failed-bar line shows it: two decimals, more where two would equal the bar."""
    return f"{value:.2f}" if f"{value:.2f}" != f"{bar:.2f}" else f"{value:.4f}"


def gate_failures(report: QualityReport, gate: QualityGate | None) -> list[str]:
    """One line per bar a gated model fails (``full.speaker_similarity 0.41 < 0.70``); none without a gate.

    A null CER (no speech recogniser for the language) fails no CER bar."""
    if gate is None:
        return []
    failed = []
    for name in GATED_MODELS:
        scores = report.models[name]
        if (bar := gate.min_speaker_similarity) is not None and not scores.speaker_similarity >= bar:
            failed.append(f"{name}.speaker_similarity {_number(scores.speaker_similarity, bar)} < {bar:.2f}")
        if (bar := gate.max_cer) is not None and scores.cer is not None and not scores.cer <= bar:
            failed.append(f"{name}.cer {_number(scores.cer, bar)} > {bar:.2f}")
        if (bar := gate.min_dnsmos_ovrl) is not None:
            if scores.dnsmos is None:
                failed.append(f"{name}.dnsmos.ovrl missing (bar {bar:.2f})")
            elif not scores.dnsmos.ovrl >= bar:
                failed.append(f"{name}.dnsmos.ovrl {_number(scores.dnsmos.ovrl, bar)} < {bar:.2f}")
        if gate.require_sanity and not scores.sanity.ok:
            why = "; ".join(scores.sanity.problems[:3]) or "no reason given"
            failed.append(f"{name}.sanity not ok ({why})"[:300])
    return failed


def _figures(scores: ModelScores) -> dict:
    """One model's figures as the records keep them (camelCase, like every record field)."""
    dnsmos = scores.dnsmos
    return {
        "speakerSimilarity": scores.speaker_similarity, "cer": scores.cer, "wer": scores.wer,
        "asr": scores.asr, "asrUnavailable": scores.asr_unavailable,
        "dnsmos": None if dnsmos is None else {"ovrl": dnsmos.ovrl, "sig": dnsmos.sig, "bak": dnsmos.bak},
        "sanity": {"ok": scores.sanity.ok, "problems": list(scores.sanity.problems[:10])},
    }


def figures(report: QualityReport, *, report_path: str, gate: QualityGate | None, failed: list[str]) -> dict:
    """The ``quality`` field of the job record, the profile and the events: the scores of every model
    (and of the job's own recordings, ``reference``), where the report lies, and what the gate decided."""
    return {
        "version": report.version,
        "language": report.language,
        "report": report_path,
        "models": {name: _figures(scores) for name, scores in report.models.items()},
        "reference": None if report.reference is None else _figures(report.reference),
        "cost": None if report.cost is None else {"cpuS": report.cost.cpu_s, "wallS": report.cost.wall_s,
                                                  "peakRssMib": report.cost.peak_rss_mib},
        "gate": {"applied": gate is not None, "passed": not failed, "failed": list(failed),
                 "bars": None if gate is None else {
                     "minSpeakerSimilarity": gate.min_speaker_similarity, "maxCer": gate.max_cer,
                     "minDnsmosOvrl": gate.min_dnsmos_ovrl, "requireSanity": gate.require_sanity}},
    }


def emit_metrics(metrics: Metrics, report: QualityReport, *, job_id: str) -> None:
    """ModelSpeakerSimilarity, ModelCer and ModelDnsmos (the overall DNSMOS), one document per gated
    model with its ``Model`` dimension (``full``, ``light``); a null score is left out."""
    for name in GATED_MODELS:
        scores = report.models[name]
        values = {MODEL_SPEAKER_SIMILARITY: (scores.speaker_similarity, NO_UNIT)}
        if scores.cer is not None:  # finite: the report's model refuses inf and nan
            values[MODEL_CER] = (scores.cer, NO_UNIT)
        if scores.dnsmos is not None:
            values[MODEL_DNSMOS] = (scores.dnsmos.ovrl, NO_UNIT)
        metrics.emit(values, dimensions={MODEL_DIMENSION: name}, jobId=job_id)
