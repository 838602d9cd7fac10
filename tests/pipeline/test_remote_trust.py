"""The S3 mirror restores only what the job record vouches for: nothing planted under ``.work/`` wins."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import pipeline.remote_work as remote_work_module
from pipeline.manifest import manifest_path, write_manifest
from pipeline.remote_work import MAX_LISTING_FILES, MemoryLedger, listing_problem
from pipeline.reuse import attempt_order
from pipeline.run import run_pipeline
from pipeline.workdir import earlier_attempts
from tests.pipeline.test_remote_work import (
    BUCKET,
    CONFIG,
    JOB,
    STAGE,
    VOUCHED,
    _fresh_record,  # noqa: F401 - the autouse fixture: each test starts with an empty record
    finished_outputs,
    mirror,
    run_on_host_a,
    s3,  # noqa: F401 - the fixture
    tree,
    write,
)
from worker.core.stop import StopSignal

ATTEMPTS = f"voice/.work/{JOB}/attempts"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plant_checkpoints(s3, attempt: str, files: dict[str, bytes], *, vouch: bool = False, **extra) -> bytes:
    """What someone with write access to ``.work/`` can put there: blobs and a listing that match."""
    base = f"{ATTEMPTS}/{attempt}/checkpoints/train_full"
    for data in files.values():
        s3.put_object(Bucket=BUCKET, Key=f"{base}/{sha(data)}", Body=data)
    listing = {"version": 1, "stage": "train_full", "attempt": attempt,
               "files": {rel: {"sha256": sha(data), "size": len(data)} for rel, data in files.items()}, **extra}
    body = json.dumps(listing, sort_keys=True).encode()
    s3.put_object(Bucket=BUCKET, Key=f"{base}.{sha(body)}.json", Body=body)
    # And over the attempt's listing that the record does vouch for, when it has one.
    for vouched in filter(None, [VOUCHED.get(attempt, {}).get("checkpoints/train_full")]):
        s3.put_object(Bucket=BUCKET, Key=f"{base}.{vouched}.json", Body=body)
    if vouch:
        VOUCHED.setdefault(attempt, {})["checkpoints/train_full"] = sha(body)
    return body


def plant_outputs(s3, attempt: str, outputs: dict[str, bytes], stage=STAGE, tmp: Path | None = None) -> bytes:
    """Outputs and a manifest for them that verifies against the stage's definition (its fingerprint
    can be derived from the pipeline's config)."""
    assert tmp is not None
    out = write(tmp, outputs)
    write_manifest(manifest_path(out, stage.name), out, stage.name, stage.fingerprint, stage.outputs)
    base = f"{ATTEMPTS}/{attempt}/output"
    for rel, data in outputs.items():
        s3.put_object(Bucket=BUCKET, Key=f"{base}/{rel}", Body=data)
    body = manifest_path(out, stage.name).read_bytes()
    s3.put_object(Bucket=BUCKET, Key=f"{base}/.manifests/{stage.name}.json", Body=body)
    return body


def test_an_attempt_planted_in_the_bucket_restores_nothing(s3, tmp_path):
    """A ``99999-evil`` attempt with well-formed blobs, listing and manifest loses to the vouched one,
    and alone gives nothing."""
    plant_checkpoints(s3, "99999-evil", {"c.pth": b"ATTACKER CHECKPOINT"})
    plant_outputs(s3, "99999-evil", {"full/model.pth": b"ATTACKER MODEL", "full/config.json": b"{}"},
                  tmp=tmp_path / "planted")
    target = tmp_path / "out"
    target.mkdir()
    assert mirror(s3, "2-bbbb").pull_outputs(STAGE, target) is None
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", tmp_path / "r0") is None
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "a", {"c.pth": b"real"}), 10.0)
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", tmp_path / "r1") == "1-aaaa"
    assert tree(tmp_path / "r1") == {"c.pth": b"real"} and tree(target) == {}


def test_a_vouched_attempts_listing_replaced_in_the_bucket_is_refused(s3, tmp_path):
    """A listing rewritten over a real attempt's (naming blobs that match it) no longer hashes to what
    the record vouches for: nothing is restored, the host's checkpoints stay."""
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "a", {"c.pth": b"real"}))
    plant_checkpoints(s3, "1-aaaa", {"c.pth": b"ATTACKER CHECKPOINT"})
    target = write(tmp_path / "local", {"c.pth": b"local"})
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", target) is None
    assert tree(target) == {"c.pth": b"local"}


def test_a_vouched_attempts_manifest_replaced_in_the_bucket_is_refused(s3, tmp_path):
    """Outputs and a manifest rewritten over a real attempt's mirror are refused; the stage then runs."""
    mirror(s3, "1-aaaa").push_outputs(STAGE, finished_outputs(tmp_path / "a" / "output"))
    plant_outputs(s3, "1-aaaa", {"full/model.pth": b"ATTACKER MODEL", "full/config.json": b"{}"},
                  tmp=tmp_path / "planted")
    target = tmp_path / "b" / "output"
    target.mkdir(parents=True)
    assert mirror(s3, "2-bbbb").pull_outputs(STAGE, target) is None
    assert tree(target) == {}


def test_a_progress_that_is_not_a_percent_is_refused(s3, tmp_path):
    """A listing claiming 1e308 % (even one the record vouches for) does not beat a real 50 %."""
    plant_checkpoints(s3, "1-aaaa", {"c.pth": b"far, far away"}, vouch=True, progress=1e308)
    mirror(s3, "2-bbbb").push_checkpoints("train_full", write(tmp_path / "b", {"c.pth": b"half"}), 50.0)
    assert mirror(s3, "3-cccc").pull_checkpoints("train_full", tmp_path / "r") == "2-bbbb"
    assert tree(tmp_path / "r") == {"c.pth": b"half"}


@pytest.mark.parametrize("progress", [101, -1, float("nan"), True, "90"])
def test_every_progress_outside_0_to_100_refuses_the_listing(progress):
    """Above 100, below 0, NaN, a boolean or a text: the listing is refused whole."""
    listing = {"version": 1, "stage": "s", "attempt": "1-a", "progress": progress,
               "files": {"c.pth": {"sha256": "0" * 64, "size": 1}}}
    assert listing_problem(listing, "s", "1-a") is not None
    assert listing_problem({**listing, "progress": 100}, "s", "1-a") is None


@pytest.mark.parametrize("size", [-1, True, 1.5, "4", 10**30])
def test_sizes_that_are_negative_boolean_or_absurd_are_refused(size):
    """A size must be a whole number of bytes within the restore's bound."""
    listing = {"version": 1, "stage": "s", "attempt": "1-a", "files": {"c.pth": {"sha256": "0" * 64, "size": size}}}
    assert "size" in (listing_problem(listing, "s", "1-a") or "")


def test_odd_attempt_names_sort_first_and_never_raise(s3, tmp_path):
    """``²-x`` (a digit to ``isdigit``, not to ``int``) is skipped with a warning, here and on disk."""
    assert attempt_order("²-x") == (-1, "²-x") and attempt_order("0012-ab") == (12, "ab")
    mirror(s3, "1-aaaa").push_checkpoints("train_full", write(tmp_path / "a", {"c.pth": b"real"}))
    VOUCHED["²-x"] = {"checkpoints/train_full": "0" * 64}
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", tmp_path / "r", newer_than="0-z") == "1-aaaa"
    attempts = tmp_path / "job" / "attempts"
    for name in ("²-x", "0001-aa", "0002-bb"):
        (attempts / name).mkdir(parents=True)
    assert [p.name for p in earlier_attempts(attempts / "0002-bb")] == ["0001-aa", "²-x"]


def test_a_blob_larger_than_its_listing_is_not_downloaded(s3, tmp_path, monkeypatch):
    """A 4-byte entry whose object holds 8 MiB writes nothing to disk: the length is checked first,
    and no more than the declared size is ever read."""
    written: list[int] = []
    real = remote_work_module.replaced_at

    def counting(dir_fd, name):
        manager = real(dir_fd, name)

        class Counted:
            def __enter__(self):
                out = manager.__enter__()
                original = out.write

                def write(data):
                    written.append(len(data))
                    return original(data)

                out.write = write
                return out

            def __exit__(self, *exc):
                return manager.__exit__(*exc)

        return Counted()

    monkeypatch.setattr(remote_work_module, "replaced_at", counting)
    plant_checkpoints(s3, "1-aaaa", {"c.pth": b"four"}, vouch=True)
    s3.put_object(Bucket=BUCKET, Key=f"{ATTEMPTS}/1-aaaa/checkpoints/train_full/{sha(b'four')}",
                  Body=b"\0" * (8 * 1024 * 1024))
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", tmp_path / "r") is None
    assert sum(written) <= 4 and not (tmp_path / "r").exists()


def test_a_listing_of_too_many_files_is_refused_before_any_download(s3, tmp_path):
    """Past the cap on files per listing, the listing is the only object fetched."""
    gets: list[str] = []
    s3.meta.events.register("before-call.s3.GetObject", lambda params, **_: gets.append(params["url_path"]))
    files = {f"c{n:05d}.pth": b"x" for n in range(MAX_LISTING_FILES + 1)}
    plant_checkpoints(s3, "1-aaaa", files, vouch=True)
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", tmp_path / "r") is None
    assert len(gets) == 1 and not (tmp_path / "r").exists()


def test_the_last_stages_outputs_are_never_taken_from_the_mirror(s3, tmp_path):
    """Even vouched for, mirrored outputs of the last stage (the artifacts) are not adopted: the stage
    runs, and the artifacts are its own."""
    config, trainer, job, fetch = run_on_host_a(s3, tmp_path)
    last = config.stages[-1]
    planted = {rel: b"ATTACKER " + rel.encode() for rel in last.outputs}
    body = plant_outputs(s3, "1-aaaa", planted, stage=last, tmp=tmp_path / "planted")
    VOUCHED["1-aaaa"][f"output/{last.name}"] = sha(body)
    host_b = tmp_path / "b" / JOB / "attempts" / "2-bbbb"
    ran: list[str] = []
    paths = run_pipeline(job, host_b, StopSignal(), config=config, fetch=fetch,
                         progress=lambda step, pct: ran.append(step) if pct == 0 else None,
                         remote=trainer.remote_work(host_b, MemoryLedger("2-bbbb", VOUCHED)))
    assert last.name in ran
    assert not any(path.read_bytes().startswith(b"ATTACKER") for path in paths.values())


def test_a_listing_the_record_does_not_vouch_for_yet_keeps_the_previous_sets_blobs(s3, tmp_path):
    """When the store refuses the vouch, the mirror keeps the blobs of the set it last vouched for,
    so a retry still restores that one."""
    source = write(tmp_path / "ckpt", {"c.pth": b"first"})
    ledger = MemoryLedger("1-aaaa", VOUCHED)
    ours = remote_work_module.RemoteWork(s3, CONFIG, JOB, "1-aaaa", ledger)
    ours.push_checkpoints("train_full", source)

    def refused(_item, _digest):
        raise RuntimeError("StaleWrite: not held")

    ledger.vouch = refused  # type: ignore[method-assign]
    write(source, {"c.pth": b"second"})
    ours.push_checkpoints("train_full", source)
    assert mirror(s3, "2-bbbb").pull_checkpoints("train_full", tmp_path / "r") == "1-aaaa"
    assert tree(tmp_path / "r") == {"c.pth": b"first"}
    del ledger.vouch  # the store is back: the next set is vouched, and only its listing and blob stay
    write(source, {"c.pth": b"third"})
    ours.push_checkpoints("train_full", source)
    left = sorted(o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=ATTEMPTS)["Contents"])
    assert left == sorted([sha(b"third"), f"train_full.{VOUCHED['1-aaaa']['checkpoints/train_full']}.json"])
