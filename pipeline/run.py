"""One job's training pipeline: downloads -> dataset -> configured stages -> the configured artifacts.

Every step can be re-run on the same work directory after a crash or a retry and redoes only what is
not already complete: a downloaded file is kept (``fetch`` writes atomically, so an existing file is
whole), a complete dataset is left alone, and a stage whose manifest verifies is skipped. The stop
signal is checked between steps and watched during stages; the handler maps ``Stopped`` to its reason.

The handler gives each attempt a directory of its own, ``<job dir>/attempts/<attempt id>/``: two
attempts never write the same files. Such a directory's logs go to the job's ``logs/`` (timestamped,
so every attempt's stay), and its siblings are the job's earlier attempts, whose verified work is
copied in before the steps run (``pipeline.reuse``). Any other directory is a job directory of its
own (tests, benchmarks): logs inside it, no earlier attempts. ``pipeline.workdir`` draws the tree.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import structlog

from pipeline.config import PipelineConfig
from pipeline.dataset_stage import prestart_dataset, run_dataset_stage
from pipeline.download_pool import DownloadPool, Item
from pipeline.downloads import Downloader, DownloadSettings
from pipeline.errors import BadRecording, StageFailed
from pipeline.files import fsync_dir, output_problem
from pipeline.limits import JobLimits
from pipeline.manifest import manifest_path
from pipeline.proctree import ATTEMPT_NAME, JOB_NAME
from pipeline.recording_url import RecordingUrl
from pipeline.remote_work import Ledger, RemoteWork, RemoteWorkConfig, job_key, shared_file_system
from pipeline.reuse import adopt_checkpoints, adopt_downloads, adopt_verified_outputs
from pipeline.stage_env import stage_environment
from pipeline.stages import (
    DEFAULT_GRACE_S,
    ManifestWriter,
    Progress,
    StageContext,
    end_survivors,
    open_step_log,
    run_stage,
)
from pipeline.workdir import (
    download_path,
    earlier_attempts,
    is_attempt_dir,
    job_dir_of,
    remove_attempt_dirs,
    trim_earlier_attempts,
    work_layout,
)
from worker.core import tracing
from worker.core.faults import NEVER, CrashPoints
from worker.core.stop import StopSignal

log = structlog.get_logger(__name__)

DOWNLOAD_STEP = "download"
DATASET_STEP = "dataset"
# The progress steps that are the worker's own work, not a trainer stage's (no GPU time).
OWN_STEPS = frozenset({DOWNLOAD_STEP, DATASET_STEP})


class Recording(Protocol):
    @property
    def url(self) -> RecordingUrl: ...

    @property
    def text(self) -> str: ...


class Job(Protocol):
    @property
    def job_id(self) -> str: ...

    @property
    def language(self) -> str: ...

    @property
    def recordings(self) -> Sequence[Recording]: ...


class Fetcher(Protocol):
    """What the pipeline calls to download one recording to ``dest``: ``pipeline.downloads.Downloader``.

    ``remaining_job_bytes`` is passed only when the job has a download budget (``JobLimits``), and
    ``stop`` (this file's own signal, which also answers to the job's) only when several files are
    fetched at once, so a fake for a job without either may take ``(url, dest)`` alone. The result
    is not read: the pipeline takes the size from the file, which must be whole or absent. Calls
    come from the step's threads, in the order of the recordings.
    """

    def __call__(self, url: RecordingUrl, dest: Path, /, *, remaining_job_bytes: int = ...,
                 stop: StopSignal = ...) -> object: ...


@dataclass(frozen=True)
class DownloadPlan:
    """How the download step runs: how many files at once, and the most one file may take
    (DOWNLOAD_MAX_BYTES), which is what each reserves of the job's budget; None: unknown, so each
    file reserves all that is left and the files run one at a time while a budget is set."""

    concurrency: int = 1
    file_max_bytes: int | None = None
    # The fetcher takes ``reservation=`` (``pipeline.downloads.Reservation``) and asks it for its share
    # once the length is known, so a file reserves its declared length, not its maximum.
    sized_reservations: bool = False


class PipelineTrainer:
    """The pipeline as the job handler calls it (``worker.voice.job.Trainer``), built once at start-up.

    The constructor takes what is the same for every job: the stages, how to download and with which
    S3 client, the per-job limits, the stages' environment and stop grace. A call takes the job's
    own: the job, its attempt directory, its stop signal and where its progress goes.
    """

    def __init__(self, config: PipelineConfig, downloads: DownloadSettings, *, s3_client: Any = None,
                 limits: JobLimits | None = None, stage_env: Mapping[str, str] | None = None,
                 grace_s: float = DEFAULT_GRACE_S, crash_points: CrashPoints = NEVER,
                 remote: RemoteWorkConfig | None = None):
        self._config = config
        self._remote = remote
        self._downloads = downloads
        self._s3_client = s3_client
        self._limits = limits
        self._stage_env = stage_env
        self._grace_s = grace_s
        self._crash_points = crash_points

    def __call__(self, job: Job, work_dir: Path, stop: StopSignal, progress: Progress,
                 ledger: Ledger | None = None, /) -> dict[str, Path]:
        return run_pipeline(job, work_dir, stop, config=self._config, fetch=self.downloader(stop), progress=progress,
                            grace_s=self._grace_s, limits=self._limits, stage_env=self._stage_env,
                            plan=self.download_plan, remote=self.remote_work(work_dir, ledger))

    def remote_work(self, work_dir: Path, ledger: Ledger | None) -> RemoteWork | None:
        """The attempt's mirror in S3, when jobs mirror their work (``CHECKPOINT_S3_SYNC_SECONDS``) and the
        attempt has a ledger in the job record to vouch for it: without one, nothing could be restored."""
        if self._remote is None or ledger is None or not is_attempt_dir(work_dir):
            return None
        return RemoteWork(self._s3_client, self._remote, job_key(job_dir_of(work_dir)), work_dir.name, ledger)

    def forget_remote_work(self, job_dir: Path) -> None:
        """After the commit: the job's mirror in S3, every attempt's, is no longer needed."""
        if self._remote is not None:
            RemoteWork(self._s3_client, self._remote, job_key(job_dir), "", _NO_LEDGER).forget()

    def downloader(self, stop: StopSignal) -> Downloader:
        """The job's fetcher: bound per call, so every download of the job answers to its stop signal,
        and its kept-alive connections are the job's alone."""
        # The step syncs downloads/ once when all files are in, instead of once per file.
        return Downloader(self._downloads, s3_client=self._s3_client, stop=stop, crash_points=self._crash_points,
                          sync_dir=False)

    @property
    def download_plan(self) -> DownloadPlan:
        return DownloadPlan(self._downloads.concurrency, self._downloads.max_bytes, sized_reservations=True)

    @property
    def limits(self) -> JobLimits:
        return self._limits or JobLimits()


class _NoLedger:
    """The ledger of a mirror that only deletes: it vouches for nothing."""

    def vouched(self) -> dict[str, dict[str, str]]:
        return {}

    def vouch(self, item: str, sha256_hex: str) -> None:
        raise RuntimeError("this mirror only forgets")


_NO_LEDGER = _NoLedger()


def run_pipeline(
    job: Job,
    work_dir: Path,
    stop: StopSignal,
    *,
    config: PipelineConfig,
    fetch: Fetcher,
    progress: Progress,
    grace_s: float = DEFAULT_GRACE_S,
    limits: JobLimits | None = None,
    stage_env: Mapping[str, str] | None = None,
    plan: DownloadPlan = DownloadPlan(),
    remote: RemoteWork | None = None,
) -> dict[str, Path]:
    """Run every step that is not already complete; returns every configured artifact's path by key.

    ``stage_env`` is the stages' whole environment (``pipeline.stage_env``); None means the built-in
    allow-list from this process. ``plan``: how the downloads run (one at a time unless told).
    ``remote``: the attempt's mirror in S3 (``pipeline.remote_work``), or None.
    """
    try:
        return _run(job, Path(work_dir), stop, config, fetch, ReportedProgress(progress), grace_s,
                    stage_env, limits or JobLimits(), plan, remote)
    except OSError as exc:
        # Our own file system work failed (full or unavailable shared disk): worth another attempt.
        where = Path(exc.filename).name if exc.filename else "work dir"
        raise StageFailed(f"pipeline file system error at {where}: {exc.strerror or exc}") from exc


def _run(
    job: Job,
    work_dir: Path,
    stop: StopSignal,
    config: PipelineConfig,
    fetch: Fetcher,
    progress: ReportedProgress,
    grace_s: float,
    stage_env: Mapping[str, str] | None,
    limits: JobLimits,
    plan: DownloadPlan,
    remote: RemoteWork | None,
) -> dict[str, Path]:
    dirs = work_layout(work_dir)
    for directory in dirs.directories():
        directory.mkdir(parents=True, exist_ok=True)
    env = stage_environment(os.environ) if stage_env is None else stage_env
    # Every stage process carries the job's id and attempt, so a later attempt on this host can find
    # and end it (and a stale one learns that a newer attempt is running).
    attempt = work_dir.name if is_attempt_dir(work_dir) else ""
    # The job's mark is its work directory, not its bare id: unique per job *and* work root, so two
    # deployments (or two test runs) on one host that share a job id never end each other's stages.
    job_mark = str(job_dir_of(work_dir).resolve())
    env = {**env, JOB_NAME: job_mark, ATTEMPT_NAME: attempt}
    # Before anything is copied from an earlier attempt: none of its processes may still be writing.
    end_survivors(job_mark, grace_s, attempt=attempt)
    earlier = earlier_attempts(work_dir)

    stop.raise_if_set()
    # Started now, held, so that its interpreter and numpy/soundfile/soxr imports overlap the downloads
    # (after the survivor scan above, which would end it). Whatever ends this attempt before its step
    # (a stop, the deadline, a failed download) ends it too.
    dataset_child = prestart_dataset([rec.text for rec in job.recordings], dirs.dataset, dirs.logs,
                                     env=env, grace_s=grace_s)
    try:
        # Another host's stale attempt may still read a shared root: nothing of its earlier attempts moves.
        local_root = shared_file_system(work_dir) is None
        copied = adopt_downloads([work_layout(d).downloads for d in earlier], dirs.downloads,
                                 [download_path(dirs.downloads, i).name for i in range(len(job.recordings))],
                                 move=local_root)
        if copied:
            log.info("pipeline.downloads_reused", count=len(copied), moved=local_root)
        if local_root:
            _left(trim_earlier_attempts(earlier))
        with tracing.span("download", recordings=len(job.recordings), reused=len(copied)):
            sources = download_all(job, dirs.downloads, dirs.logs, stop, fetch, progress,
                                   limits.max_job_download_bytes, plan)

        stop.raise_if_set()
        progress(DATASET_STEP, 0.0)
        started_s = time.monotonic()
        with tracing.span("dataset", recordings=len(sources)):
            dataset = run_dataset_stage(
                [(path, rec.text) for path, rec in zip(sources, job.recordings, strict=True)],
                dirs.dataset, dirs.logs, stop, progress, limits=limits, env=env, grace_s=grace_s,
                child=dataset_child,
            )
        log.info("dataset.completed", recordings=len(sources), rebuilt=dataset.rebuilt,
                 duration_s=round(time.monotonic() - started_s, 3))
    finally:
        if dataset_child is not None:
            dataset_child.end()
    progress(DATASET_STEP, 100.0)

    ctx = StageContext(
        dataset_dir=dirs.dataset,
        output_dir=dirs.output,
        checkpoints_root=dirs.checkpoints,
        log_dir=dirs.logs,
        job_id=job.job_id,
        language=job.language,
        trainer_python=config.trainer_python,
        base_model_dir=config.base_model_dir,
        env=env,
    )
    manifests = ManifestWriter()  # a stage's outputs are hashed while the next stage runs
    try:
        for index, stage in enumerate(config.stages):
            manifests.check()
            stop.raise_if_set()
            # The last stage's outputs are the artifacts: only this attempt's own run (or this host's
            # verified copy) may give them, never the mirror, which no attempt sends them to.
            last = index == len(config.stages) - 1
            _adopt_earlier_work(stage, ctx, earlier, None if last else remote,
                                checkpoints_from=remote)
            if last and earlier and local_root:  # nothing more is taken from them
                _left(remove_attempt_dirs(earlier))
            # After the copies and restores: the stage's time (its GPU-seconds) starts with its run.
            progress(stage.name, 0.0)
            with tracing.span(f"stage {stage.name}", stage=stage.name):
                outcome = run_stage(stage, ctx, stop, progress, grace_s=grace_s, manifests=manifests,
                                    while_running=_mirroring(stage, ctx, remote, stop, progress))
            if remote is not None and not outcome.skipped and index < len(config.stages) - 1:
                # Behind its manifest, on the same thread. Not the last stage's: the commit sends those.
                manifests.then(functools.partial(remote.push_outputs, stage, ctx.output_dir))
            progress(stage.name, 100.0)
            log.info("pipeline.stage_done", job_id=job.job_id, stage=stage.name, skipped=outcome.skipped)
        manifests.wait()
    finally:
        manifests.close()

    stop.raise_if_set()
    return verify_artifacts(config, dirs.output)


def _left(failures: Sequence[str]) -> None:
    if failures:
        log.warning("pipeline.earlier_attempts_not_removed", left=failures[:20])


def _adopt_earlier_work(stage, ctx: StageContext, earlier: Sequence[Path], remote: RemoteWork | None = None,
                        *, checkpoints_from: RemoteWork | None = None) -> None:
    """Give the stage an earlier attempt's verified outputs, or (resumable) its newest checkpoints:
    from this host's earlier attempts, else from the attempts mirrored in S3 (``remote`` for outputs,
    ``checkpoints_from`` for checkpoints)."""
    if manifest_path(ctx.output_dir, stage.name).exists():
        return  # this attempt's own manifest decides (run_stage verifies it)
    outputs = [work_layout(d).output for d in earlier]
    source = adopt_verified_outputs(stage, outputs, ctx.output_dir) if earlier else None
    if source is not None:
        log.info("pipeline.stage_reused", stage=stage.name, attempt=source.parent.name)
        return
    if remote is not None and remote.pull_outputs(stage, ctx.output_dir) is not None:
        return
    if stage.resumable:
        root = ctx.checkpoints_root
        local = adopt_checkpoints(earlier, root.parent, f"{root.name}/{stage.name}") if earlier else None
        if local is not None:
            log.info("pipeline.checkpoints_reused", stage=stage.name, attempt=local.name)
        if checkpoints_from is not None:
            # Only a newer attempt's (another host's, since): a local copy from this host wins a tie.
            checkpoints_from.pull_checkpoints(stage.name, ctx.checkpoint_dir(stage),
                                              newer_than=local.name if local else None)


def _mirroring(stage, ctx: StageContext, remote: RemoteWork | None, stop: StopSignal, progress: ReportedProgress):
    """While a resumable stage runs, its checkpoints are mirrored to S3 (when the job mirrors), each
    set with the stage's progress at the time."""
    if remote is None or not stage.resumable:
        return None
    return functools.partial(remote.syncing, stage.name, ctx.checkpoint_dir(stage), stop,
                             functools.partial(progress.of, stage.name))


def verify_artifacts(config: PipelineConfig, output_dir: Path) -> dict[str, Path]:
    """Every configured artifact's path (in the config's order), or StageFailed naming each one that is
    refused and why.

    The rule is the stages' and the uploader's (``pipeline.files.output_problem``): a non-empty regular
    file with no symbolic link in any component of its path, the output directory included.
    """
    paths = {key: output_dir / rel for key, rel in config.artifacts.items()}
    bad = [
        f"{key} ({rel}: {problem})"
        for key, rel in config.artifacts.items()
        if (problem := output_problem(output_dir, rel))
    ]
    if bad:
        raise StageFailed("pipeline finished without these artifacts: " + ", ".join(bad))
    return paths


def download_all(
    job: Job, downloads_dir: Path, log_dir: Path, stop: StopSignal, fetch: Fetcher, progress: Progress,
    budget_bytes: int | None = None, plan: DownloadPlan = DownloadPlan(),
) -> list[Path]:
    """The download step: every recording not already on disk fetched (``pipeline.download_pool``);
    the paths in the order of the recordings. A fetcher with ``close`` is closed at the end (the
    ``Downloader``'s kept-alive connections)."""
    recordings = list(job.recordings)
    progress(DOWNLOAD_STEP, 0.0)
    destinations = [download_path(downloads_dir, index) for index in range(len(recordings))]
    kept = [path.is_file() for path in destinations]
    # Files kept from an earlier attempt were downloaded for this job too: they spend the same budget.
    used = sum(path.stat().st_size for path, keep in zip(destinations, kept, strict=True) if keep)
    over = f"the job's total download limit of {budget_bytes} bytes (MAX_JOB_DOWNLOAD_BYTES) was hit"
    if budget_bytes is not None and used > budget_bytes:
        raise BadRecording(f"recordings kept from an earlier attempt: {over}")
    stop.raise_if_set()
    items = [Item(index, recording.url, destination)
             for index, (recording, destination, keep) in enumerate(zip(recordings, destinations, kept, strict=True))
             if not keep]
    pool = DownloadPool(items, fetch, stop, budget_bytes=None if budget_bytes is None else budget_bytes - used,
                        file_max_bytes=plan.file_max_bytes, concurrency=plan.concurrency, over_budget=over,
                        sized_reservations=plan.sized_reservations)
    already = sum(kept)
    try:
        sizes = pool.run(lambda done: progress(DOWNLOAD_STEP, 100.0 * (already + done) / len(recordings)))
    finally:
        close = getattr(fetch, "close", None)
        if close is not None:
            close()
    fsync_dir(downloads_dir, strict=True)  # the renames of every fetched file, at once
    progress(DOWNLOAD_STEP, 100.0)
    notes = [f"recording {index}: kept from an earlier attempt" if keep
             else f"recording {index}: fetched {sizes[index]} bytes"
             for index, keep in enumerate(kept)]
    _write_step_log(log_dir, DOWNLOAD_STEP, notes)
    return destinations


class ReportedProgress:
    """The job's progress callback, minus a report identical to the one before (a stage's own 100 %,
    then ours), remembering each step's last percent: the checkpoint mirror records how far a stage
    had got with each set it names."""

    def __init__(self, progress: Progress):
        self._progress = progress
        self._last: tuple[str, float] | None = None
        self._percent: dict[str, float] = {}

    def __call__(self, stage: str, percent: float) -> None:
        self._percent[stage] = percent
        if self._last != (stage, percent):
            self._progress(stage, percent)
            self._last = (stage, percent)

    def of(self, stage: str) -> float | None:
        return self._percent.get(stage)

    def note(self, stage: str, text: str) -> None:
        """A stage's ``NOTE`` line, to the job's record when the job's progress keeps notes."""
        note = getattr(self._progress, "note", None)
        if note is not None:
            note(stage, text)

    def metric(self, stage: str, step: int, values: Mapping[str, float]) -> None:
        """A stage's ``METRIC`` line, to the job's record when the job's progress keeps metrics."""
        metric = getattr(self._progress, "metric", None)
        if metric is not None:
            metric(stage, step, values)

    def tick(self) -> None:
        """Passed on from the stage runner's loop: the job's progress writes and logs at its intervals."""
        tick = getattr(self._progress, "tick", None)
        if tick is not None:
            tick()

    def flush(self) -> None:
        """Passed on from the stage runner once a stage exited: the job's progress writes what it held back."""
        flush = getattr(self._progress, "flush", None)
        if flush is not None:
            flush()


def _write_step_log(log_dir: Path, step: str, lines: Sequence[str]) -> None:
    # URLs are deliberately absent: they may carry signed query strings.
    _path, handle = open_step_log(log_dir, step, datetime.now(UTC))
    with handle:
        handle.write("".join(f"{line}\n" for line in lines).encode())

