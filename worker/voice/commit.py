"""The commit: a trained attempt's artifacts become the profile's, in an order no crash can tear.

``Commit.persist`` first writes the progress stage ``COMMITTING`` (fenced: from then on the store
refuses cancel requests), then, each step only after the previous one succeeded:

    1 verify every artifact's local file  (each configured key present; regular, non-empty, no symlink
                                           on the way)
    2 upload them all to S3               (content-addressed keys, never replacing an object; a matching
                                           object is reused; the claim proven before each object and part)
   2b publish them all under MODELS_ROOT  (content-addressed, never replaced: worker.voice.publish)
    3 write local and S3 paths            (fenced on the profile claim; local = the published files)
   3b write the quality figures           (fenced on the profile claim; only with a [quality] report,
                                           which the handler's gate passed before step 1)
   3c name the base model                 (fenced on the profile claim; only with a pinned [base_model])
    4 mark the profile completed          (fenced on the profile claim)
    5 mark the job completed              (fenced on the job lease: the commit marker, with the artifact
                                           keys it committed, which is_complete judges the job against)

The artifacts are the job's configured set (the pipeline config's ``[artifacts]``, ``artifacts``).

Cancel and shutdown are no longer honoured; a lost lease is checked before each step. An attempt that
learns it lost the job after uploading deletes what it wrote only once the job is committed and the
committed paths do not name it (same bytes, same key: it may be the committed object).

``Commit.clean_up`` runs after the commit, and again for a redelivery of the committed job (a crash may
have skipped it): the objects under the job's key prefix that the committed s3Paths do not name, the
entries of the job's models directory that no committed modelPaths lies in (a stale attempt's
digests), the job's work directory except ``logs/`` (``keep_work_files`` keeps it whole) and the job's
S3 mirror. The profile's ``modelPaths`` name the published copies under ``MODELS_ROOT``, which the
work files' removal never touches. Every clean-up is best effort: a failure is logged, never a failed
job. A crashed attempt keeps its files, so its retry still resumes from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from pipeline.errors import StageFailed
from pipeline.manifest import recorded_outputs
from pipeline.workdir import (
    models_dir_for,
    published_rel,
    remove_unpublished,
    remove_work_files,
    work_dir_for,
    work_layout,
)
from worker.core import tracing
from worker.core.errors import LeaseLost, Stopped, WorkerError
from worker.core.faults import NEVER, CrashPoints
from worker.core.lease import Lease
from worker.voice.artifacts import (
    ArtifactUploader,
    artifact_key,
    job_key_prefix,
    stale_leftovers,
    unreferenced,
    verify_local,
)
from worker.voice.message import Job
from worker.voice.publish import publish_all
from worker.voice.records import Store
from worker.voice.records.attempt import Attempt, StoreLease
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.models import ProfileRecord
from worker.voice.records.rules import COMMITTING, REQUIRED_ARTIFACTS

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Committed:
    """What the commit wrote: each asset's S3 URI and its published local path."""

    s3_paths: dict[str, str]
    model_paths: dict[str, str]


class Commit:
    """The commit steps and the clean-up after them, for every job of one handler."""

    def __init__(self, store: Store, uploader: ArtifactUploader, *, s3_prefix: str, work_root: Path,
                 models_root: Path, keep_work_files: bool = False,
                 forget_remote_work: Callable[[Path], None] | None = None, crash_points: CrashPoints = NEVER,
                 artifacts: Sequence[str] = REQUIRED_ARTIFACTS):
        """``artifacts``: the keys every commit must write (the pipeline config's ``artifact_keys``)."""
        self._store = store
        self._artifacts = tuple(artifacts)
        self._uploader = uploader
        self._s3_prefix = s3_prefix
        self._work_root = Path(work_root)
        self._models_root = Path(models_root)
        self._keep_work_files = keep_work_files
        # The job's mirror in S3 (pipeline.remote_work), when attempts mirror their work.
        self._forget_remote_work = forget_remote_work
        self._crash = crash_points.reached

    def reusable(self, job: Job, profile: ProfileRecord | None) -> dict[str, Path] | None:
        """The profile's published paths of this job when every configured artifact's verifies (an earlier
        attempt reached step 3): the retry then finishes that commit instead of training, and a cancel is
        too late."""
        try:
            return reusable_paths(profile, models_dir_for(self._models_root, job), self._artifacts)
        except WorkerError:
            return None  # a models directory that escapes MODELS_ROOT fails in persist, recorded

    def persist(self, job: Job, attempt: Attempt, paths: dict[str, Path], attempt_dir: Path, lease: Lease,
                store_lease: StoreLease, *, quality: dict | None = None,
                base_model: Mapping[str, str] | None = None) -> Committed:
        """Commit steps 1-5 for the artifact files ``paths`` (the attempt's outputs, or ``reusable``'s)."""
        # Past this point only a lost lease stops us: a cancel or shutdown now would strand half a commit.
        lease.stop.raise_if_set()
        # Progress stage COMMITTING (a fenced write): from here on the store refuses cancel requests
        # and `cancel` says it is too late. The renewal after it reads a request that landed before,
        # so a cancel is either honoured here or refused, never accepted and then ignored.
        try:
            attempt.progress(COMMITTING, 100.0)
        except StaleWrite as exc:
            raise LeaseLost(f"committing stage refused: {exc}") from exc
        store_lease.renew()
        lease.stop.raise_if_set()
        models_dir = models_dir_for(self._models_root, job)
        output_dir = work_layout(attempt_dir).output
        # The files lie in this attempt's output directory, or, when a retry reuses what an earlier
        # attempt of this job published, all under MODELS_ROOT: each is checked inside its own base.
        base_dir = _artifacts_base(paths, output_dir, models_dir)
        if missing := [key for key in self._artifacts if key not in paths]:
            raise StageFailed("artifacts not ready: the trainer produced no " + ", ".join(missing))
        verify_local(base_dir, paths)                                            # 1
        rels = artifact_rels(paths, output_dir, models_dir)
        claim = _ClaimProof(lease, store_lease)
        written: list[str] = []
        try:
            return self._steps(job, attempt, paths, base_dir, rels, models_dir, claim, written, quality, base_model)
        except (LeaseLost, StaleWrite):
            self._remove_stale_uploads(job, written)
            raise
        except Stopped as exc:
            if exc.reason == Stopped.LEASE_LOST:
                self._remove_stale_uploads(job, written)
            raise

    def _steps(self, job: Job, attempt: Attempt, paths: dict[str, Path], base_dir: Path, rels: dict[str, str],
               models_dir: Path, claim: _ClaimProof, written: list[str], quality: dict | None,
               base_model: Mapping[str, str] | None) -> Committed:
        # The uploader names each file by its path under base_dir; the key takes the artifact's own
        # relative path (a published file's path under MODELS_ROOT starts with its digest).
        sources = {name: Path(paths[name]).relative_to(base_dir).as_posix() for name in paths}
        rel_of = {sources[name]: rels[name] for name in paths}
        digest_of: dict[str, str] = {}  # path under base_dir -> the SHA-256 its object is stored under

        def key_for(sha256_hex: str, relative_path: str) -> str:
            digest_of[relative_path] = sha256_hex
            return artifact_key(self._s3_prefix, job.environment, job.profile_id, job.job_id, sha256_hex,
                                rel_of[relative_path])

        # The digests the stage manifests recorded name the keys, and their files' identities spare
        # the uploader and the publisher a second read: each file is hashed once, by its manifest.
        recorded = recorded_outputs(base_dir)
        with tracing.span("upload", files=len(paths)):
            s3_paths = self._uploader.upload_all(base_dir, paths, key_for, proof=claim.proof,      # 2
                                                 part_proof=claim.part_proof, written=written, recorded=recorded)
        self._crash("after_upload")
        claim.check()
        # Before the paths, so they never name a file that does not exist (see worker.voice.publish).
        # The published files must hold the bytes the objects hold: same rule, same digests.
        published = publish_all(base_dir, sources, rels,                         # 2b
                                {name: digest_of[sources[name]] for name in paths}, models_dir, recorded)
        claim.check()
        model_paths = {name: str(path) for name, path in published.items()}
        attempt.write_paths(model_paths, s3_paths)                               # 3
        self._crash("after_paths")
        claim.check()
        if quality is not None:
            attempt.write_profile_quality(quality)                               # 3b
            claim.check()
        if base_model is not None:
            attempt.write_profile_base_model(dict(base_model))                   # 3c
            claim.check()
        attempt.complete_profile()                                               # 4
        self._crash("after_profile_completed")
        claim.check()
        claim.store_lease.end()
        attempt.complete(list(model_paths))                                      # 5 commit marker
        self._crash("after_job_completed")
        return Committed(s3_paths, model_paths)

    def _remove_stale_uploads(self, job: Job, written: list[str]) -> None:
        """We lost the job after writing objects: delete those the committed job does not name."""
        if not written:
            return
        try:
            record, profile = self._store.get_job(job.job_id), self._store.get_profile(job.profile_id)
            if profile is None or profile.job_id != job.job_id:
                # Another job of the profile has claimed it since: its paths say nothing about what this
                # job committed, so nothing is provably unreferenced.
                log.info("artifacts.stale_uploads_kept", written=len(written), why="the profile moved on")
                return
            committed = profile.s3_paths.values()
            referenced = filter(None, (self._uploader.key_of(uri) for uri in committed))
            doomed = stale_leftovers(written, record, referenced)
            for key in doomed:
                self._uploader.delete(key)
        except Exception as exc:  # noqa: BLE001 - we are already failing with the lost lease
            log.warning("artifacts.stale_cleanup_failed", error=str(exc), written=len(written))
            return
        log.info("artifacts.stale_uploads", written=len(written), removed=len(doomed),
                 kept="referenced by the committed profile or the job is not committed yet")

    # --- after the commit

    def clean_up(self, job: Job, s3_paths: Mapping[str, str], model_paths: Iterable[str]) -> None:
        """Best effort, each step on its own: what no committed path names goes (S3 objects, published
        copies), then the job's scratch. Safe to run again: a redelivery of the committed job does."""
        self._remove_unreferenced_objects(job, s3_paths)
        self._remove_unpublished(job, model_paths)
        self._remove_work_files(job)
        if self._forget_remote_work is not None:
            try:
                self._forget_remote_work(work_dir_for(self._work_root, job))
            except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
                log.warning("job.remote_work_not_removed", error=f"{type(exc).__name__}: {exc}")

    def _remove_unreferenced_objects(self, job: Job, s3_paths: Mapping[str, str]) -> None:
        """Objects under the job's prefix that the committed paths do not name are a stale or failed
        attempt's; delete them (best effort: the job is committed whatever happens)."""
        prefix = job_key_prefix(self._s3_prefix, job.environment, job.profile_id, job.job_id)
        referenced = [self._uploader.key_of(uri) for uri in s3_paths.values()]
        try:
            doomed = unreferenced(self._uploader.list_keys(prefix), filter(None, referenced))
            for key in doomed:
                self._uploader.delete(key)
        except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
            log.warning("artifacts.cleanup_failed", error=str(exc))
            return
        if doomed:
            log.info("artifacts.unreferenced_removed", count=len(doomed), keys=doomed[:5])

    def _remove_unpublished(self, job: Job, model_paths: Iterable[str]) -> None:
        try:
            failures = remove_unpublished(models_dir_for(self._models_root, job), model_paths)
        except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
            failures = [f"{type(exc).__name__}: {exc}"]
        if failures:
            log.warning("job.unpublished_not_removed", failures=failures[:5], count=len(failures))

    def clean_ended(self, job: Job) -> None:
        """A job that ended without a commit (cancelled, refused, dead-lettered): its scratch goes, its
        logs stay (pruned later); its models directory and S3 objects are left as they are."""
        self._remove_work_files(job)

    def _remove_work_files(self, job: Job) -> None:
        """The models are in S3 and published, so only the job's logs stay as scratch."""
        if self._keep_work_files:
            return
        try:
            failures = remove_work_files(work_dir_for(self._work_root, job), self._models_root)
        except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
            failures = [f"{type(exc).__name__}: {exc}"]
        if failures:
            log.warning("job.work_files_not_removed", failures=failures[:5], count=len(failures))


class _ClaimProof:
    """The claim, proven during the commit: the message's lease and the record's."""

    def __init__(self, lease: Lease, store_lease: StoreLease):
        self.lease, self.store_lease = lease, store_lease

    def check(self) -> None:
        # lease.lost, not the stop reason: a lease lost after a shutdown or cancel request still counts.
        if self.lease.lost:
            raise Stopped(Stopped.LEASE_LOST, self.lease.lost_reason or "")

    def proof(self) -> None:
        # S3 is outside the store's fence: before each object, renew the claim (the proof that it is
        # still ours); a store that cannot be reached leaves the local deadline to decide.
        try:
            self.store_lease.renew()
        except StoreError as exc:
            log.warning("job.lease_renewal_failed", error=str(exc), when="before an upload")
        self.part_proof()

    def part_proof(self) -> None:
        self.check()
        self.store_lease.ensure_live()


def reusable_paths(profile: ProfileRecord | None, output_dir: Path,
                   artifacts: Sequence[str] = REQUIRED_ARTIFACTS) -> dict[str, Path] | None:
    """The profile's local model paths of ``artifacts`` from an earlier attempt of this job, when every
    one verifies on disk.

    ``output_dir`` is where they must lie: the job's published models directory.
    """
    stored = profile.model_paths if profile is not None else {}
    if not all(stored.get(k) for k in artifacts):
        return None
    paths = {k: Path(stored[k]) for k in artifacts}
    if not all(output_dir in p.parents for p in paths.values()):
        return None
    try:
        verify_local(output_dir, paths)
    except WorkerError:
        return None
    return paths


def artifact_rels(paths: dict[str, Path], output_dir: Path, models_dir: Path) -> dict[str, str]:
    """Each artifact's path relative to the output directory, whether it lies there or is published."""
    rels = {}
    for name, path in paths.items():
        rel = published_rel(models_dir, path)
        rels[name] = rel if rel is not None else path.relative_to(output_dir).as_posix()
    return rels


def _artifacts_base(paths: dict[str, Path], output_dir: Path, models_dir: Path) -> Path:
    """The directory the artifact files lie in: MODELS_ROOT's job directory when all are published, else
    the attempt's output directory (where verification then finds any file that is not)."""
    if paths and all(published_rel(models_dir, Path(path)) is not None for path in paths.values()):
        return models_dir
    return output_dir
