"""The soak's checker: a pure function from the final state of a run to the list of what went wrong.

It checks the whole queue at once, the way a total-queue checker does, with evidence from three
sources that do not depend on each other: the store's records, the S3 version lists (the bucket is
versioned, so every overwrite leaves a trace), and the trainer stand-in's own log of each training.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tests.reliability.soak_trainer import TICK_S
from tests.support import ARTIFACT_KEYS, SHIPPED_ARTIFACTS

COMPLETION, S3, OVERLAP, LOST, DLQ = "completion", "s3", "overlap", "lost", "dlq"
KINDS = (COMPLETION, S3, OVERLAP, LOST, DLQ)


@dataclass(frozen=True)
class Violation:
    kind: str
    job_id: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.job_id}: {self.detail}"


@dataclass(frozen=True)
class Training:
    job_id: str
    pid: int
    start: float
    end: float          # when it ended, or (no end line: SIGKILLed) shortly after its last tick
    finished: bool      # wrote all five files and said so
    digests: dict[str, str]


@dataclass
class SoakState:
    """Everything the checker looks at, gathered once the run is over."""

    jobs: dict[str, str]                              # job id -> profile id
    records: dict[str, dict]                          # job id -> job record
    profiles: dict[str, dict]                         # profile id -> profile record
    commits_logged: Counter                           # job id -> `job.completed` lines in worker logs
    snapshots: dict[str, dict[str, list[str]]]        # job id -> key -> version ids listed after commit
    versions: dict[str, list[dict]]                   # key -> [{version_id, sha256, body_sha256}] now
    trainer_log: list[dict]                           # the stand-in's JSON lines
    queue_left: int = 0                               # messages visible or in flight on the job queue
    dead_letters: list[dict] = field(default_factory=list)  # [{message_id, body}] from the DLQ
    artifacts: dict[str, str] = field(default_factory=lambda: dict(SHIPPED_ARTIFACTS))


def trainings(trainer_log: list[dict]) -> dict[str, list[Training]]:
    """Each training run (one stand-in process) per job, from its start/tick/end/stop lines."""
    by_run: dict[tuple[str, int], list[dict]] = {}
    for line in trainer_log:
        by_run.setdefault((line["job"], line["pid"]), []).append(line)
    runs: dict[str, list[Training]] = {}
    for (job_id, pid), lines in by_run.items():
        lines.sort(key=lambda line: line["t"])
        last = lines[-1]
        closed = last["event"] in ("end", "stop")
        # A SIGKILLed run wrote no last line: it was dead before its next tick was due.
        end = last["t"] if closed else last["t"] + 2 * TICK_S
        runs.setdefault(job_id, []).append(Training(
            job_id, pid, lines[0]["t"], end, last["event"] == "end", last.get("digests") or {}))
    return runs


def overlapping(runs: list[Training]) -> list[tuple[Training, Training]]:
    ordered = sorted(runs, key=lambda run: run.start)
    return [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1:] if b.start < a.end]


def key_of(uri: str) -> str:
    return uri.removeprefix("s3://").partition("/")[2]


def check(state: SoakState) -> list[Violation]:
    found: list[Violation] = []
    runs = trainings(state.trainer_log)
    for job_id, profile_id in state.jobs.items():
        record, profile = state.records.get(job_id) or {}, state.profiles.get(profile_id) or {}
        found += _completion(job_id, record, profile, state.commits_logged[job_id])
        if record.get("status") == "completed" and len(profile.get("s3Paths") or {}) == len(ARTIFACT_KEYS):
            found += _objects(job_id, profile["s3Paths"], state, runs.get(job_id, []))
        for a, b in overlapping(runs.get(job_id, [])):
            found.append(Violation(OVERLAP, job_id, f"trainer {b.pid} started {b.start - a.start:.2f} s "
                                                    f"after trainer {a.pid}, which ran until {a.end - b.start:.2f} s later"))
    if state.queue_left:
        found.append(Violation(LOST, "-", f"{state.queue_left} messages left on the queue"))
    found += _dead_letters(state)
    return found


def _completion(job_id: str, record: dict, profile: dict, commits_logged: int) -> list[Violation]:
    status = record.get("status")
    if status != "completed":
        kind = LOST if status not in ("failed", "cancelled") else COMPLETION
        return [Violation(kind, job_id, f"ended {status!r} (error {record.get('error')})")]
    problems = []
    completions = [h for h in record.get("history") or [] if h.get("outcome") == "completed"]
    if len(completions) != 1:
        problems.append(f"{len(completions)} completed attempts in the history")
    if commits_logged != 1:
        problems.append(f"{commits_logged} job.completed lines in the worker logs")
    if profile.get("status") != "completed":
        problems.append(f"profile {profile.get('status')!r}")
    for paths in ("modelPaths", "s3Paths"):
        if sorted(profile.get(paths) or {}) != sorted(ARTIFACT_KEYS):
            problems.append(f"profile {paths} {sorted(profile.get(paths) or {})}")
    return [Violation(COMPLETION, job_id, p) for p in problems]


def _objects(job_id: str, s3_paths: dict[str, str], state: SoakState, runs: list[Training]) -> list[Violation]:
    problems, held = [], {}
    at_commit = state.snapshots.get(job_id) or {}
    for name in sorted(s3_paths):
        key = key_of(s3_paths[name])
        versions = state.versions.get(key) or []
        ids = [v["version_id"] for v in versions]
        if len(versions) != 1:
            problems.append(f"{name}: {len(versions)} versions of {key} (written more than once)")
        if key in at_commit and ids != at_commit[key]:
            problems.append(f"{name}: {key} changed after the commit: {at_commit[key]} then, {ids} now")
        if not versions:
            continue
        latest = versions[0]
        if latest["sha256"] != latest["body_sha256"]:
            problems.append(f"{name}: sha256 metadata {latest['sha256']} but the bytes hash to {latest['body_sha256']}")
        held[name] = latest["body_sha256"]
    if len(held) == len(s3_paths) and not _one_training_wrote(held, state.artifacts, runs):
        owners = {name: [r.pid for r in runs if r.digests.get(state.artifacts[name]) == sha]
                  for name, sha in held.items()}
        problems.append(f"the committed objects are not one training's bytes: written by {owners}")
    return [Violation(S3, job_id, p) for p in problems]


def _one_training_wrote(held: dict[str, str], artifacts: dict[str, str], runs: list[Training]) -> bool:
    return any(run.finished and all(run.digests.get(artifacts[name]) == sha for name, sha in held.items())
               for run in runs)


def _dead_letters(state: SoakState) -> list[Violation]:
    found = []
    for message in state.dead_letters:
        job_id = str((message.get("body") or {}).get("jobId", "?"))
        error = (state.records.get(job_id) or {}).get("error") or {}
        explained = error.get("retryable") is False and error.get("messageId") == message["message_id"]
        if not explained:
            found.append(Violation(DLQ, job_id, f"message {message['message_id']} dead-lettered with no "
                                                f"permanent error recorded for it (error {error or None})"))
    return found
