"""The pinned base model: its [base_model] table, the content-addressed cache, and what a fetch refuses."""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from pipeline.base_model import (
    LOCK_NAME,
    TEMP_PREFIX,
    BaseModelCache,
    BaseModelFile,
    BaseModelIdentity,
    BaseModelSpec,
    LocalSource,
    S3Source,
    source_for,
)
from pipeline.config import parse_pipeline_config
from pipeline.errors import HostUnfit
from pipeline.stages import StageContext
from worker.core.errors import ConfigError

ARTIFACTS = {"fullModel": "m", "fullConfig": "c", "speakerEmbeddings": "s", "lightModel": "l", "lightConfig": "lc"}


def config_data(base: dict | None = None, argv: list[str] | None = None, **stage) -> dict:
    data: dict = {"artifacts": ARTIFACTS, "stages": [{
        "name": "all", "argv": argv or ["{python}", "-c", "pass", "--base", "{base_model_dir}"],
        "outputs": list(ARTIFACTS.values()), **stage}]}
    if base is not None:
        data["base_model"] = base
    return data


def write_files(root: Path, files: dict[str, bytes]) -> list[dict]:
    """The files under ``root`` and their [base_model] entries."""
    entries = []
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        entries.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return entries


def local_base(tmp_path: Path, files: dict[str, bytes] | None = None) -> BaseModelSpec:
    source = tmp_path / "source"
    entries = write_files(source, files or {"model.pth": b"weights" * 1000, "config/model.json": b"{}"})
    config = parse_pipeline_config(config_data({"name": "tiny-base", "location": str(source),
                                                "licence": "CC-BY-4.0", "files": entries}))
    assert config.base_model is not None
    return config.base_model


def problems_of(data: dict, trainer_python: str = "") -> str:
    with pytest.raises(ConfigError) as caught:
        parse_pipeline_config(data, trainer_python=trainer_python)
    return str(caught.value)


# ---------------------------------------------------------------- the table


def test_a_valid_table_gives_the_spec_and_an_identity_named_by_the_file_lists_digest(tmp_path):
    """The identity's digest is the SHA-256 of the canonical JSON of the sorted file list, order-free."""
    spec = local_base(tmp_path)
    listing = sorted(({"path": f.path, "sha256": f.sha256, "size": f.size} for f in spec.files),
                     key=lambda entry: entry["path"])
    canonical = "[" + ",".join(f'{{"path":"{e["path"]}","sha256":"{e["sha256"]}","size":{e["size"]}}}'
                               for e in listing) + "]"
    assert spec.identity == BaseModelIdentity(name="tiny-base", digest="sha256:" + hashlib.sha256(
        canonical.encode()).hexdigest(), licence="CC-BY-4.0")
    assert spec.identity.as_record() == {"name": "tiny-base", "digest": spec.identity.digest, "licence": "CC-BY-4.0"}
    reordered = BaseModelSpec(spec.name, "s3://elsewhere/x", "other", tuple(reversed(spec.files)))
    assert reordered.digest_hex == spec.digest_hex  # name, location and licence are not the content


@pytest.mark.parametrize("path, why", [
    ("../escape.bin", "escapes the location"),
    ("a/../../escape.bin", "escapes the location"),
    ("/etc/passwd", "is absolute"),
    (".hidden", "is not a plain relative path"),
    ("a//b", "is not a plain relative path"),
    ("", "must be a non-empty relative path"),
])
def test_a_path_that_could_leave_the_location_is_refused_at_load(path, why):
    """A declared path with '..', an absolute one, a dot name or an empty part is a config problem."""
    base = {"name": "b", "location": "s3://models-bucket/base", "licence": "MIT",
            "files": [{"path": path, "size": 1, "sha256": "0" * 64}]}
    assert why in problems_of(config_data(base))


def test_a_file_reached_through_a_symlink_is_refused_at_load(tmp_path):
    """A local location whose declared file lies behind a symbolic link is refused when the config loads."""
    outside = tmp_path / "outside"
    write_files(outside, {"model.pth": b"x"})
    source = tmp_path / "source"
    source.mkdir()
    (source / "weights").symlink_to(outside)
    base = {"name": "b", "location": str(source), "licence": "MIT",
            "files": [{"path": "weights/model.pth", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}]}
    assert "is reached through a symbolic link" in problems_of(config_data(base))


def test_a_symlink_planted_after_load_is_still_not_followed(tmp_path):
    """The fetch opens every component without following a link: a link made after the load is refused."""
    spec = local_base(tmp_path, {"weights/model.pth": b"x"})
    outside = tmp_path / "outside"
    write_files(outside, {"model.pth": b"x"})
    source = tmp_path / "source"
    (source / "weights" / "model.pth").unlink()
    (source / "weights").rmdir()
    (source / "weights").symlink_to(outside)
    with pytest.raises(HostUnfit, match="symbolic link"):
        BaseModelCache(tmp_path / "cache").ensure(spec, LocalSource(spec.location))
    assert not BaseModelCache(tmp_path / "cache").entry(spec).exists()


@pytest.mark.parametrize("base, why", [
    ({"name": "b", "location": "relative/dir", "licence": "MIT", "files": []}, "neither s3://bucket/prefix"),
    ({"name": "b", "location": "s3://B/x", "licence": "MIT", "files": [{"path": "a", "size": 1, "sha256": "0" * 64}]},
     "names no valid bucket"),
    ({"name": "", "location": "s3://bucket/x", "licence": "MIT", "files": [{"path": "a", "size": 1, "sha256": "0" * 64}]},
     "base_model.name"),
    ({"name": "b", "location": "s3://bucket/x", "files": [{"path": "a", "size": 1, "sha256": "0" * 64}]},
     "base_model.licence"),
    ({"name": "b", "location": "s3://bucket/x", "licence": "MIT", "files": [{"path": "a", "size": -1, "sha256": "0" * 64}]},
     "size must be"),
    ({"name": "b", "location": "s3://bucket/x", "licence": "MIT", "files": [{"path": "a", "size": 1, "sha256": "ABC"}]},
     "sha256 must be"),
    ({"name": "b", "location": "s3://bucket/x", "licence": "MIT",
      "files": [{"path": "a", "size": 1, "sha256": "0" * 64}, {"path": "a/b", "size": 1, "sha256": "0" * 64}]},
     "cannot lie below it"),
    ({"name": "b", "location": "s3://bucket/x", "licence": "MIT", "extra": 1,
      "files": [{"path": "a", "size": 1, "sha256": "0" * 64}]}, "unknown key 'extra'"),
])
def test_a_malformed_table_is_refused_with_its_line(base, why):
    """Each malformed part of [base_model] is one line of the config's problems."""
    assert why in problems_of(config_data(base))


def test_base_model_dir_without_a_base_is_refused():
    """A stage that reads {base_model_dir} needs a [base_model] table."""
    assert "uses {base_model_dir}, but the config has no [base_model]" in problems_of(config_data())


def test_a_stage_that_reads_the_base_is_fingerprinted_with_its_digest(tmp_path):
    """Another base voids the manifests of the stages that read it (their fingerprint changes)."""
    first = local_base(tmp_path / "a", {"m": b"one"})
    second = local_base(tmp_path / "b", {"m": b"two"})
    fingerprints = []
    for spec in (first, second):
        base = {"name": "b", "location": spec.location, "licence": "MIT",
                "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in spec.files]}
        fingerprints.append(parse_pipeline_config(config_data(base)).stages[0].fingerprint)
    assert fingerprints[0] != fingerprints[1]


# ---------------------------------------------------------------- device


def test_device_is_substituted_from_the_stage_and_base_model_dir_from_the_context(tmp_path):
    """{device} takes the stage's device key and {base_model_dir} the worker's verified entry, each one argv element."""
    spec = local_base(tmp_path)
    base = {"name": "b", "location": spec.location, "licence": "MIT",
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in spec.files]}
    config = parse_pipeline_config(config_data(base, argv=["{python}", "--base", "{base_model_dir}",
                                                           "--device", "{device}"], device="cpu"))
    ctx = StageContext(dataset_dir=tmp_path, output_dir=tmp_path, checkpoints_root=tmp_path, log_dir=tmp_path,
                       job_id="j", language="en", base_model_dir="/cache/with space/abc")
    from pipeline.config import render_argv

    argv = render_argv(config.stages[0].argv, ctx.placeholder_values(config.stages[0]))
    assert argv[1:] == ["--base", "/cache/with space/abc", "--device", "cpu"]


@pytest.mark.parametrize("stage, why", [
    ({"argv": ["{python}", "--device", "{device}"]}, "uses {device}, but the stage declares no device"),
    ({"argv": ["{python}"], "device": "tpu"}, "device must be one of cpu, cuda"),
])
def test_a_device_the_stage_cannot_have_is_refused(stage, why):
    """{device} needs the stage's device, and the device is cpu or cuda."""
    argv = stage.pop("argv")
    assert why in problems_of(config_data(argv=argv, **stage))


def test_a_cuda_stage_needs_the_trainer_interpreter_for_its_probe():
    """device = "cuda" makes the start-up probe run {trainer_python}: TRAINER_PYTHON must then be usable."""
    why = problems_of(config_data(argv=["{python}"], device="cuda"), trainer_python="")
    assert 'declare device = "cuda"' in why and "TRAINER_PYTHON is not set" in why


# ---------------------------------------------------------------- the cache


def test_a_base_that_verifies_is_published_read_only_and_then_reused(tmp_path):
    """The first ensure fetches and publishes; a second finds the entry and fetches nothing."""
    spec = local_base(tmp_path)
    cache = BaseModelCache(tmp_path / "cache")
    first = cache.ensure(spec, LocalSource(spec.location))
    assert first.fetched and first.directory == tmp_path / "cache" / spec.digest_hex
    assert (first.directory / "config" / "model.json").read_bytes() == b"{}"
    assert oct((first.directory / "model.pth").stat().st_mode & 0o777) == oct(0o444)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(TEMP_PREFIX)]
    again = cache.ensure(spec, LocalSource(spec.location))
    assert again == type(first)(first.directory, fetched=False)


def test_a_wrong_digest_is_refused_and_nothing_is_published(tmp_path):
    """A file whose bytes do not hash to the declared SHA-256 is refused; no entry and no temp dir remain."""
    spec = local_base(tmp_path)
    (Path(spec.location) / "model.pth").write_bytes(b"Weights" + b"weights" * 999)  # same size, other bytes
    cache = BaseModelCache(tmp_path / "cache")
    with pytest.raises(HostUnfit, match="model.pth: its SHA-256 is not the one the config declares"):
        cache.ensure(spec, LocalSource(spec.location))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [LOCK_NAME]


def test_a_damaged_cache_entry_is_refused_at_start(tmp_path):
    """A published entry whose file changed on disk is found at the next start, never used."""
    spec = local_base(tmp_path)
    cache = BaseModelCache(tmp_path / "cache")
    entry = cache.ensure(spec, LocalSource(spec.location)).directory
    os.chmod(entry / "model.pth", 0o644)
    (entry / "model.pth").write_bytes(b"Weights" + b"weights" * 999)
    with pytest.raises(HostUnfit, match="does not match the config"):
        cache.ensure(spec, LocalSource(spec.location))


class CountingBody:
    """An S3 body that counts what was read from it."""

    def __init__(self, data: bytes):
        self._stream, self.read_bytes, self.closed = io.BytesIO(data), 0, False

    def read(self, size: int = -1) -> bytes:
        chunk = self._stream.read(size)
        self.read_bytes += len(chunk)
        return chunk

    def close(self) -> None:
        self.closed = True


class FakeS3:
    """get_object over a dict of keys; ``lengths`` overrides the ContentLength it reports."""

    def __init__(self, objects: dict[str, bytes], lengths: dict[str, int | None] | None = None):
        self.objects, self.lengths, self.bodies = objects, lengths or {}, []

    def get_object(self, Bucket: str, Key: str):  # noqa: N803 - boto3's names
        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey", "Message": "The specified key does not exist."}},
                              "GetObject")
        body = CountingBody(self.objects[Key])
        self.bodies.append(body)
        response = {"Body": body}
        length = self.lengths.get(Key, len(self.objects[Key]))
        if length is not None:
            response["ContentLength"] = length
        return response


def s3_spec(files: dict[str, bytes], declared: dict[str, int] | None = None) -> BaseModelSpec:
    entries = tuple(BaseModelFile(path=rel, size=(declared or {}).get(rel, len(data)),
                                  sha256=hashlib.sha256(data).hexdigest()) for rel, data in sorted(files.items()))
    return BaseModelSpec(name="b", location="s3://models-bucket/bases/b1", licence="MIT", files=entries)


def test_an_s3_base_is_fetched_under_its_prefix(tmp_path):
    """Each declared file is read from <prefix>/<path> with the injected client, and every body closed."""
    s3 = FakeS3({"bases/b1/model.pth": b"w" * 100, "bases/b1/cfg/c.json": b"{}"})
    spec = s3_spec({"model.pth": b"w" * 100, "cfg/c.json": b"{}"})
    ensured = BaseModelCache(tmp_path / "cache").ensure(spec, source_for(spec, s3))
    assert (ensured.directory / "cfg" / "c.json").read_bytes() == b"{}"
    assert all(body.closed for body in s3.bodies)


def test_a_file_larger_than_declared_is_refused_without_reading_it_whole(tmp_path):
    """A body longer than its declared size is refused once one byte more arrives (a lying ContentLength too)."""
    data = b"w" * (3 * 1024 * 1024)
    spec = s3_spec({"model.pth": data}, declared={"model.pth": 1024})
    s3 = FakeS3({"bases/b1/model.pth": data}, lengths={"bases/b1/model.pth": None})
    with pytest.raises(HostUnfit, match="larger than the 1024 bytes the config declares"):
        BaseModelCache(tmp_path / "cache").ensure(spec, S3Source(s3, spec.location))
    assert s3.bodies[0].read_bytes <= 1025
    honest = FakeS3({"bases/b1/model.pth": data})
    with pytest.raises(HostUnfit, match=f"the object has {len(data)} bytes, the config declares 1024"):
        BaseModelCache(tmp_path / "cache").ensure(spec, S3Source(honest, spec.location))
    assert honest.bodies[0].read_bytes == 0


def test_a_file_larger_than_declared_is_refused_from_a_local_directory(tmp_path):
    """A local file that grew past its declared size is refused, and nothing is published."""
    spec = local_base(tmp_path, {"model.pth": b"x" * 10})
    (Path(spec.location) / "model.pth").write_bytes(b"x" * 11)
    cache = BaseModelCache(tmp_path / "cache")
    with pytest.raises(HostUnfit, match="larger than the 10 bytes"):
        cache.ensure(spec, LocalSource(spec.location))
    assert not cache.entry(spec).exists()


def test_an_s3_error_is_a_host_problem_in_one_line(tmp_path):
    """botocore's error stops at the adapter: HostUnfit naming the object and S3's code."""
    spec = s3_spec({"model.pth": b"x"})
    with pytest.raises(HostUnfit) as caught:
        BaseModelCache(tmp_path / "cache").ensure(spec, S3Source(FakeS3({}), spec.location))
    assert caught.value.check == "base model"
    assert "s3://models-bucket/bases/b1/model.pth: NoSuchKey" in caught.value.problem
    assert "\n" not in str(caught.value)


class WatchingSource:
    """A local source that records, at each file it opens, whether the entry is already visible."""

    def __init__(self, inner: LocalSource, entry: Path):
        self.inner, self.entry, self.seen = inner, entry, []

    def describe(self) -> str:
        return self.inner.describe()

    def open(self, file):
        self.seen.append((file.path, self.entry.exists()))
        return self.inner.open(file)


def test_no_half_fetched_entry_is_ever_visible(tmp_path):
    """While files are still arriving the entry's name does not exist; a fetch that fails leaves none."""
    spec = local_base(tmp_path, {"a.bin": b"a" * 10, "b.bin": b"b" * 10, "c.bin": b"c" * 10})
    cache = BaseModelCache(tmp_path / "cache")
    (Path(spec.location) / "c.bin").write_bytes(b"C" * 10)  # the last file fails its digest
    watching = WatchingSource(LocalSource(spec.location), cache.entry(spec))
    with pytest.raises(HostUnfit):
        cache.ensure(spec, watching)
    assert watching.seen == [("a.bin", False), ("b.bin", False), ("c.bin", False)]
    assert not cache.entry(spec).exists()


def test_a_crashed_fetchs_temp_dir_is_removed_by_the_next_fetch(tmp_path):
    """A temp dir left by a killed fetch is cleared by the next lock holder, and never read as an entry."""
    spec = local_base(tmp_path)
    cache = BaseModelCache(tmp_path / "cache")
    stale = tmp_path / "cache" / f"{TEMP_PREFIX}{spec.digest_hex}-dead"
    stale.mkdir(parents=True)
    (stale / "model.pth").write_bytes(b"half")
    assert cache.ensure(spec, LocalSource(spec.location)).fetched
    assert not stale.exists()


# ---------------------------------------------------------------- two workers of one host


def _fetch_in_process(cache_root: str, spec: BaseModelSpec, gate: str, name: str, results) -> None:
    """One worker's start-up: ensure the base; its source waits at ``gate`` before the first byte."""
    marks = Path(gate).parent

    class GatedSource(LocalSource):
        def open(self, file):
            (marks / f"fetching-{name}").touch()
            deadline = time.monotonic() + 60
            while not Path(gate).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return super().open(file)

    def waiting(seconds: float) -> None:
        (marks / f"waiting-{name}").touch()
        time.sleep(min(seconds, 0.05))

    try:
        ensured = BaseModelCache(Path(cache_root), wait=waiting).ensure(spec, GatedSource(spec.location))
        files = sorted(str(p.relative_to(ensured.directory)) for p in ensured.directory.rglob("*") if p.is_file())
        results.put((name, ensured.fetched, files))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        results.put((name, repr(exc), []))


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_two_workers_of_one_host_fetch_once_and_both_see_the_whole_entry(tmp_path):
    """The second worker waits on the lock while the first fetches, then finds the entry published."""
    spec = local_base(tmp_path)
    marks = tmp_path / "marks"
    marks.mkdir()
    gate = marks / "go"
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    first = context.Process(target=_fetch_in_process, args=(str(tmp_path / "cache"), spec, str(gate), "one", results))
    first.start()
    _wait_for(lambda: (marks / "fetching-one").exists(), "the first worker to start fetching")
    second = context.Process(target=_fetch_in_process, args=(str(tmp_path / "cache"), spec, str(gate), "two", results))
    second.start()
    # The second either waits on the lock (as it must) or starts a fetch of its own (the bug).
    _wait_for(lambda: (marks / "waiting-two").exists() or (marks / "fetching-two").exists(),
              "the second worker to wait or fetch")
    gate.touch()
    got = sorted(results.get(timeout=60) for _ in range(2))
    first.join(timeout=60)
    second.join(timeout=60)
    files = ["config/model.json", "model.pth"]
    assert got == [("one", True, files), ("two", False, files)]
    assert not (marks / "fetching-two").exists()
