"""The voice worker's metric names, next to the core's (``worker.core.metrics``: the loop's outcomes,
JobDuration, ReceiveCountAtCompletion, HeartbeatFailures), and its METRICS_DIMENSIONS rule.

``METRIC_NAMES`` is every name the voice worker and its reconciler emit: the names
config/cloudwatch-dashboard.json graphs and config/cloudwatch-alarms.yaml may watch.
"""

from __future__ import annotations

from worker.core import metrics as core
from worker.voice.records.attempt import STAGE_DIMENSION, STAGE_DURATION, TRAINING_METRICS

# What a job cost in trainer-stage time (GPU-seconds); at the commit, over all its attempts:
JOB_GPU_SECONDS = "JobGpuSeconds"
JOB_WASTED_GPU_SECONDS = "JobWastedGpuSeconds"          # of its attempts that did not commit
JOB_ATTEMPTS = "JobAttempts"
# At the end of each attempt that did not commit (failed, stopped, released, lease lost): its time.
WASTED_GPU_SECONDS = "WastedGpuSeconds"
# A job's evaluation (worker.voice.quality), per trained model (the Model dimension: full, light):
MODEL_SPEAKER_SIMILARITY = "ModelSpeakerSimilarity"
MODEL_CER = "ModelCer"                                   # left out when the language has no speech recogniser
MODEL_DNSMOS = "ModelDnsmos"                             # the overall DNSMOS (ovrl)
MODEL_DIMENSION = "Model"
QUALITY_METRICS = (MODEL_SPEAKER_SIMILARITY, MODEL_CER, MODEL_DNSMOS)
# What one reconcile pass changed (worker.ops.reconcile) -> its count (0 included, so alarms see a
# steady series).
RECONCILE_METRICS = {
    "worker_lost": "ReconciledWorkerLost",
    "reenqueued": "ReconciledReenqueued",
    "unenqueueable": "ReconciledUnenqueueable",
    "dead_lettered": "ReconciledDeadLettered",
    "failed": "ReconcileFailures",
}
# The latest of a trainer stage's METRIC values, per Stage (TrainingLoss, ValidationLoss, LearningRate, StepTime):
TRAINING_METRIC_NAMES = frozenset(TRAINING_METRICS)
VOICE_METRIC_NAMES = frozenset({STAGE_DURATION, *TRAINING_METRIC_NAMES, JOB_GPU_SECONDS, JOB_WASTED_GPU_SECONDS,
                                JOB_ATTEMPTS, WASTED_GPU_SECONDS, *QUALITY_METRICS, *RECONCILE_METRICS.values()})
METRIC_NAMES = core.METRIC_NAMES | VOICE_METRIC_NAMES
# Dimensions the voice worker adds to metrics of its own (StageDuration's Stage, the quality scores' Model).
DIMENSIONS = frozenset({STAGE_DIMENSION, MODEL_DIMENSION})

__all__ = ["DIMENSIONS", "JOB_ATTEMPTS", "JOB_GPU_SECONDS", "JOB_WASTED_GPU_SECONDS", "METRIC_NAMES",
           "MODEL_CER", "MODEL_DIMENSION", "MODEL_DNSMOS", "MODEL_SPEAKER_SIMILARITY", "QUALITY_METRICS",
           "RECONCILE_METRICS", "STAGE_DIMENSION", "STAGE_DURATION", "TRAINING_METRIC_NAMES", "VOICE_METRIC_NAMES",
           "WASTED_GPU_SECONDS", "parse_dimensions"]


def parse_dimensions(text: str) -> dict[str, str]:
    """METRICS_DIMENSIONS as the core parses it (``worker.core.metrics.parse_dimensions``), where no
    name may also be one of the voice worker's metrics or dimensions."""
    return core.parse_dimensions(text, reserved=VOICE_METRIC_NAMES | DIMENSIONS)
