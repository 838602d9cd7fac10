"""run_pipeline end to end: downloads, dataset, stages, the five artifacts, re-runs and stops."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest

from pipeline.config import load_pipeline_config, parse_pipeline_config
from pipeline.downloads import Downloader, DownloadSettings
from pipeline.errors import BadRecording, DownloadError, StageFailed
from pipeline.limits import JobLimits
from pipeline.recording_url import RecordingUrl, parse_recording_url
from pipeline.run import DATASET_STEP, PipelineTrainer, run_pipeline, verify_artifacts
from tests.pipeline.test_dataset import write_inputs
from tests.support import ARTIFACT_KEYS
from worker.core.errors import Stopped
from worker.core.stop import StopSignal

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Rec:
    url: RecordingUrl
    text: str


@dataclass(frozen=True)
class FakeJob:
    job_id: str
    language: str
    recordings: tuple[Rec, ...]


@dataclass
class FakeFetch:
    """Copies a synthesized file for each URL, the way the real fetch writes: complete or not at all."""

    sources: dict[RecordingUrl, Path]
    calls: list[RecordingUrl] = field(default_factory=list)

    def __call__(self, url: RecordingUrl, destination: Path) -> None:
        self.calls.append(url)
        temp = destination.with_name(destination.name + ".part")
        shutil.copyfile(self.sources[url], temp)
        temp.replace(destination)


@pytest.fixture
def job_and_fetch(tmp_path):
    inputs = write_inputs(tmp_path / "media")
    recordings = tuple(Rec(parse_recording_url(f"https://media.example.com/rec/{i}.audio?sig=secret"), t)
                       for i, (_, t, _) in enumerate(inputs))
    fetch = FakeFetch({rec.url: path for rec, (path, _, _) in zip(recordings, inputs, strict=True)})
    return FakeJob("665f1c2e9b1e8a0012ab34cd", "en", recordings), fetch


@pytest.fixture(scope="module")
def default_config():
    return load_pipeline_config(REPO / "config" / "pipeline.toml")


def test_end_to_end_returns_five_existing_artifacts(tmp_path, job_and_fetch, default_config):
    """With a fake fetch, the default pipeline produces the five non-empty artifacts and reports each step."""
    job, fetch = job_and_fetch
    reports = []
    paths = run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                         progress=lambda stage, pct: reports.append((stage, pct)))
    assert set(paths) == set(ARTIFACT_KEYS)
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    assert all(p.is_relative_to(tmp_path / "work" / "output") for p in paths.values())
    order = list(dict.fromkeys(stage for stage, _ in reports))
    assert order == ["download", "dataset", "embed", "train_full", "train_light"]
    assert ("train_full", 100.0) in reports and ("download", 100.0) in reports
    assert all(0.0 <= pct <= 100.0 for _, pct in reports)
    logs = " ".join(p.read_text() for p in (tmp_path / "work/logs").iterdir())
    assert "sig=secret" not in logs and "media.example.com" not in logs


def test_second_run_downloads_and_trains_nothing(tmp_path, job_and_fetch, default_config):
    """A re-run on a finished work dir reuses downloads, the dataset and every verified stage."""
    job, fetch = job_and_fetch
    first = run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                         progress=lambda s, p: None)
    stage_logs = {p.name for p in (tmp_path / "work/logs").glob("*-t*.log")}
    second = run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                          progress=lambda s, p: None)
    assert first == second
    assert len(fetch.calls) == len(job.recordings)
    assert {p.name for p in (tmp_path / "work/logs").glob("*-t*.log")} == stage_logs


def test_existing_download_is_not_fetched_again(tmp_path, job_and_fetch, default_config):
    """A recording file kept from an earlier attempt is used as is; only the missing one is fetched."""
    job, fetch = job_and_fetch
    downloads = tmp_path / "work/downloads"
    downloads.mkdir(parents=True)
    shutil.copyfile(fetch.sources[job.recordings[0].url], downloads / "00000.audio")
    shutil.copyfile(fetch.sources[job.recordings[2].url], downloads / "00002.audio")
    run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                 progress=lambda s, p: None)
    assert fetch.calls == [job.recordings[1].url]


def test_stop_before_start_does_nothing(tmp_path, job_and_fetch, default_config):
    """A stop already requested raises Stopped with its reason before any download."""
    job, fetch = job_and_fetch
    stop = StopSignal()
    stop.set("cancelled")
    with pytest.raises(Stopped) as caught:
        run_pipeline(job, tmp_path / "work", stop, config=default_config, fetch=fetch,
                     progress=lambda s, p: None)
    assert caught.value.reason == "cancelled" and fetch.calls == []


def test_stop_between_steps_skips_the_remaining_stages(tmp_path, job_and_fetch, default_config):
    """A stop arriving between stages keeps the finished stage's outputs and starts no further command."""
    job, fetch = job_and_fetch
    stop = StopSignal()
    started = []

    def progress(stage, pct):
        started.append(stage)
        if stage == "train_full":
            stop.set("shutdown")

    with pytest.raises(Stopped):
        run_pipeline(job, tmp_path / "work", stop, config=default_config, fetch=fetch, progress=progress)
    assert "train_light" not in started
    assert (tmp_path / "work/output/.manifests/embed.json").exists()
    assert not list((tmp_path / "work/logs").glob("*-train_full.log"))


def test_bad_recording_from_fetch_propagates(tmp_path, job_and_fetch, default_config):
    """A permanent error raised by fetch reaches the caller unchanged."""
    job, _ = job_and_fetch

    def gone(url, destination):
        raise BadRecording("recording 0 is gone (404)")

    with pytest.raises(BadRecording, match="recording 0"):
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=gone,
                     progress=lambda s, p: None)


def test_fetch_that_writes_nothing_is_a_download_error(tmp_path, job_and_fetch, default_config):
    """A fetch returning without a file is reported as a retryable DownloadError, not a later crash."""
    job, _ = job_and_fetch
    with pytest.raises(DownloadError, match="recording 0"):
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config,
                     fetch=lambda url, dest: None, progress=lambda s, p: None)


def test_artifact_lost_after_its_stage_fails_the_run(tmp_path, job_and_fetch):
    """If an artifact is gone by the end, run_pipeline raises StageFailed naming it instead of returning."""
    job, fetch = job_and_fetch
    writer = tmp_path / "writer.py"
    writer.write_text(
        "import pathlib, sys\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "for name in ['m.pth', 'c.json', 's.pth', 'l.onnx', 'l.json']:\n"
        "    (out / name).write_text('x')\n",
        encoding="utf-8",
    )
    config = parse_pipeline_config({
        "artifacts": {"fullModel": "m.pth", "fullConfig": "c.json", "speakerEmbeddings": "s.pth",
                      "lightModel": "l.onnx", "lightConfig": "l.json"},
        "stages": [
            {"name": "write", "argv": ["{python}", str(writer), "{output_dir}"],
             "outputs": ["m.pth", "c.json", "s.pth", "l.onnx", "l.json"]},
            {"name": "clobber", "argv": ["{python}", "-c",
                                         "import os, sys; os.remove(sys.argv[1]); open(sys.argv[2], 'w').write('y')",
                                         "{output_dir}/s.pth", "{output_dir}/other.txt"],
             "outputs": ["other.txt"]},
        ],
    })
    with pytest.raises(StageFailed, match="speakerEmbeddings"):
        run_pipeline(job, tmp_path / "work", StopSignal(), config=config, fetch=fetch,
                     progress=lambda s, p: None)


def test_file_system_failure_is_a_retryable_stage_failure(tmp_path, job_and_fetch, default_config):
    """An OSError from the pipeline's own file work surfaces as StageFailed, not a raw OSError."""
    job, fetch = job_and_fetch
    blocked = tmp_path / "work"
    blocked.write_text("a file where the work dir should be")
    with pytest.raises(StageFailed, match="file system error"):
        run_pipeline(job, blocked, StopSignal(), config=default_config, fetch=fetch,
                     progress=lambda s, p: None)


# --- the job's download budget (MAX_JOB_DOWNLOAD_BYTES)


@dataclass
class BudgetFetch(FakeFetch):
    """A FakeFetch that records the budget each call was given (and, like a careless fetch, ignores it)."""

    budgets: list[int | None] = field(default_factory=list)

    def __call__(self, url: RecordingUrl, destination: Path, remaining_job_bytes: int | None = None) -> None:
        self.budgets.append(remaining_job_bytes)
        super().__call__(url, destination)


def _sizes(job, fetch) -> list[int]:
    return [fetch.sources[rec.url].stat().st_size for rec in job.recordings]


def test_kept_files_count_toward_the_job_download_budget(tmp_path, job_and_fetch, default_config):
    """A fetch is given the budget less every file already on disk, kept ones included."""
    job, plain = job_and_fetch
    fetch = BudgetFetch(plain.sources)
    sizes = _sizes(job, fetch)
    downloads = tmp_path / "work/downloads"
    downloads.mkdir(parents=True)
    shutil.copyfile(fetch.sources[job.recordings[0].url], downloads / "00000.audio")
    shutil.copyfile(fetch.sources[job.recordings[2].url], downloads / "00002.audio")
    budget = sum(sizes) + 100
    run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                 progress=lambda s, p: None, limits=JobLimits(max_job_download_bytes=budget))
    assert fetch.budgets == [budget - sizes[0] - sizes[2]]


def test_kept_files_alone_over_the_budget_fail_before_any_fetch(tmp_path, job_and_fetch, default_config):
    """When an earlier attempt's files already exceed the budget, the job fails permanently at once."""
    job, plain = job_and_fetch
    fetch = BudgetFetch(plain.sources)
    downloads = tmp_path / "work/downloads"
    downloads.mkdir(parents=True)
    shutil.copyfile(fetch.sources[job.recordings[0].url], downloads / "00000.audio")
    with pytest.raises(BadRecording, match="kept from an earlier attempt: the job's total download limit of 10 bytes"):
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                     progress=lambda s, p: None, limits=JobLimits(max_job_download_bytes=10))
    assert fetch.calls == []


def test_a_fetch_that_ignores_its_budget_is_caught(tmp_path, job_and_fetch, default_config):
    """A fetch writing more than the budget it was given still fails the job, naming the recording."""
    job, plain = job_and_fetch
    fetch = BudgetFetch(plain.sources)
    sizes = _sizes(job, fetch)
    with pytest.raises(BadRecording, match="recording 1: the job's total download limit"):
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                     progress=lambda s, p: None, limits=JobLimits(max_job_download_bytes=sizes[0] + 1))


def _in_s3(job: FakeJob, sources: dict[RecordingUrl, Path]):
    """The job's recordings uploaded to moto S3, and the job with s3:// URLs for them."""
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="recordings")
    recordings = []
    for index, rec in enumerate(job.recordings):
        s3.upload_file(str(sources[rec.url]), "recordings", f"r/{index}.audio")
        recordings.append(Rec(parse_recording_url(f"s3://recordings/r/{index}.audio"), rec.text))
    return s3, FakeJob(job.job_id, job.language, tuple(recordings))


def test_real_downloads_stop_at_the_job_download_budget(tmp_path, job_and_fetch, default_config, aws):
    """With the trainer the worker builds (real fetch, moto S3), the recording that would pass the job's total
    is refused permanently."""
    sizes = _sizes(*job_and_fetch)
    s3, job = _in_s3(job_and_fetch[0], job_and_fetch[1].sources)
    train = PipelineTrainer(default_config, DownloadSettings(timeout_s=10, max_bytes=10**7), s3_client=s3,
                            limits=JobLimits(max_job_download_bytes=sum(sizes[:2]) + 1))
    with pytest.raises(BadRecording, match=r"s3://recordings/r/2.audio: the job's total download limit "
                                           r"\(MAX_JOB_DOWNLOAD_BYTES\) was hit, 1 bytes were left"):
        train(job, tmp_path / "work", StopSignal(), lambda s, p: None)
    assert sorted(p.name for p in (tmp_path / "work/downloads").iterdir()) == ["00000.audio", "00001.audio"]


class StopOnDownload:
    """Crash points that, instead of killing, cancel the job when a download starts."""

    def __init__(self, stop: StopSignal):
        self.stop = stop
        self.points: list[str] = []

    def reached(self, point: str) -> None:
        self.points.append(point)
        self.stop.set("cancelled")


def test_each_download_answers_to_the_stop_signal_of_its_own_job(tmp_path, job_and_fetch, default_config, aws):
    """The trainer, built once, hands every call's downloads that call's stop signal and reaches the crash point."""
    s3, job = _in_s3(job_and_fetch[0], job_and_fetch[1].sources)
    first, second = StopSignal(), StopSignal()
    crash_points = StopOnDownload(first)
    train = PipelineTrainer(default_config, DownloadSettings(timeout_s=10), s3_client=s3,
                            crash_points=crash_points)  # type: ignore[arg-type]
    with pytest.raises(Stopped, match="cancelled"):
        train(job, tmp_path / "first", first, lambda s, p: None)
    assert crash_points.points == ["during_download"] and not (tmp_path / "first/downloads/00000.audio").exists()
    crash_points.stop = StopSignal()  # another job's signal: the second job's downloads do not answer to it
    with pytest.raises(DownloadsDone):
        train(job, tmp_path / "second", second, _end_after_downloads)
    assert len(list((tmp_path / "second/downloads").glob("*.audio"))) == len(job.recordings)


class DownloadsDone(Exception):
    pass


def _end_after_downloads(step: str, _percent: float) -> None:
    if step == DATASET_STEP:  # reported once every recording is on disk
        raise DownloadsDone


def test_a_downloader_carries_what_is_bound_to_it(tmp_path, aws):
    """Downloader(settings, s3_client, stop) is fetch with those arguments: a set stop means no request at all."""
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="recordings")
    s3.put_object(Bucket="recordings", Key="r/a.audio", Body=b"12345")
    url = parse_recording_url("s3://recordings/r/a.audio")
    assert Downloader(DownloadSettings(), s3_client=s3)(url, tmp_path / "a") == 5
    stopped = StopSignal()
    stopped.set("shutdown")
    with pytest.raises(Stopped, match="shutdown"):
        Downloader(DownloadSettings(), s3_client=s3, stop=stopped)(url, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def five_artifacts(output_dir: Path, config) -> None:
    for rel in config.artifacts.values():
        (output_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / rel).write_bytes(b"trained")


@pytest.mark.parametrize("linked", ["file", "parent dir"])
def test_an_artifact_reached_through_a_link_fails_the_run(tmp_path, default_config, linked):
    """An artifact that is a link, or sits in a linked directory, is refused by the end check like by the uploader."""
    outside, output_dir = tmp_path / "outside", tmp_path / "output"
    five_artifacts(outside, default_config)
    five_artifacts(output_dir, default_config)
    if linked == "file":
        (output_dir / "full/model.pth").unlink()
        (output_dir / "full/model.pth").symlink_to(outside / "full/model.pth")
        expected = r"fullModel \(full/model.pth: not a regular file \(a symbolic link\)\)"
    else:
        shutil.rmtree(output_dir / "light")
        (output_dir / "light").symlink_to(outside / "light")
        expected = r"lightModel \(light/model.onnx: reached through a symbolic link \(light\)\).*lightConfig"
    with pytest.raises(StageFailed, match=expected):
        verify_artifacts(default_config, output_dir)


def test_five_real_artifacts_pass_the_end_check(tmp_path, default_config):
    """Five non-empty regular files in real directories are the run's result, by key."""
    five_artifacts(tmp_path, default_config)
    paths = verify_artifacts(default_config, tmp_path)
    assert paths["fullModel"] == tmp_path / "full/model.pth"


def test_a_stage_manifest_that_cannot_be_written_fails_the_run(tmp_path, job_and_fetch, default_config, monkeypatch):
    """A manifest written behind the next stage that fails (here the last stage's: a full disk) fails the
    run as a retryable stage failure, with that stage's outputs removed."""
    import errno

    import pipeline.stages as stages

    real = stages.write_manifest

    def full_disk_for_light(path, output_dir, stage_name, *rest):
        if stage_name == "train_light":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, output_dir, stage_name, *rest)

    monkeypatch.setattr(stages, "write_manifest", full_disk_for_light)
    job, fetch = job_and_fetch
    with pytest.raises(StageFailed, match="No space left"):
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                     progress=lambda s, p: None)
    assert not (tmp_path / "work" / "output" / "light" / "model.onnx").exists()


def test_the_dataset_step_logs_its_completion_with_its_duration(tmp_path, job_and_fetch, default_config):
    """dataset.completed says how many recordings, whether it was rebuilt, and how long it took."""
    from structlog.testing import capture_logs

    job, fetch = job_and_fetch
    with capture_logs() as logs:
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                     progress=lambda s, p: None)
    [done] = [e for e in logs if e["event"] == "dataset.completed"]
    assert done["recordings"] == len(job.recordings) and done["rebuilt"] is True and done["duration_s"] >= 0


def test_a_traced_run_has_a_span_per_step_and_stage(tmp_path, job_and_fetch, default_config):
    """With tracing on, the downloads, the dataset step and each stage are spans under the caller's."""
    from tests.support import recorded_spans
    from worker.core import tracing

    job, fetch = job_and_fetch
    with recorded_spans() as exporter, tracing.span("job"):
        run_pipeline(job, tmp_path / "work", StopSignal(), config=default_config, fetch=fetch,
                     progress=lambda s, p: None)
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    steps = ["download", "dataset", "stage embed", "stage train_full", "stage train_light"]
    assert set(steps) <= set(by_name)
    assert all(by_name[name].parent.span_id == by_name["job"].context.span_id for name in steps)
    assert by_name["download"].attributes["recordings"] == len(job.recordings)
