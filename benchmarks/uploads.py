"""Uploading a job's 1 GiB of artifacts: this worker's uploader next to s3transfer, on one local moto server.

    python benchmarks/uploads.py [--rounds 3] [--http] [--dir DIR]

The five artifacts (an 800 MiB model and four smaller files, 1 GiB together; at the shipped pipeline's
paths) are written once to DIR, with the stage manifests the pipeline writes for them (timed apart:
that hash belongs to the stages, not to the upload). Then, in each round, in alternating order:

  project   what the job's commit path does for step 1-2: ``verify_local``, the digests the stage
            manifests recorded (``recorded_outputs``), then ``upload_all`` of
            ``worker.voice.artifacts.ArtifactUploader`` as ``worker.app`` builds it, proving the claim
            the way the job does (a real SQLite record lease: a renewal before each object, the local
            deadline checked before each write)
  baseline  one s3transfer ``TransferManager`` (what boto3's ``upload_file`` runs on), 8 concurrent
            requests, 8 MiB parts, all five files submitted at once

Both use the same client settings. The server speaks HTTPS (moto's own certificate) as S3 does: over
plain HTTP botocore signs every payload with one more SHA-256 pass, on both sides (``--http`` shows
that). Between the sides the bucket is emptied, so the server's temp files never hold more than one
copy. The local server is CPU-bound, so the absolute times say little; the ratio does. On a shared
machine the rounds vary a lot, so besides the ratio of the medians the per-round ratios (the two
sides of a round run back to back) and the ratio of the fastest rounds are printed. Also printed:
the S3 requests of each side, this process's and the server's CPU seconds per side, and a retry of
the project side that finds all five objects stored (what a redelivered job does).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import boto3
import structlog
from botocore.config import Config
from s3transfer.manager import TransferConfig, TransferManager

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline.config import load_pipeline_config  # noqa: E402
from pipeline.manifest import manifest_path, recorded_outputs, write_manifest  # noqa: E402
from worker.core.stop import StopSignal  # noqa: E402
from worker.ops.demo import LocalAws  # noqa: E402
from worker.voice.artifacts import ArtifactUploader, artifact_key, verify_local  # noqa: E402
from worker.voice.records.attempt import StoreLease  # noqa: E402
from worker.voice.records.sqlite import SqliteStore  # noqa: E402

MIB = 1024 * 1024
SIZES_MIB = {"fullModel": 800, "lightModel": 160, "speakerEmbeddings": 48, "fullConfig": 12, "lightConfig": 4}
BUCKET = "bench-artifacts"
JOB_ID, PROFILE_ID = "665f1c2e9b1e8a0012ab34cd", "665f1c2e9b1e8a0012ab34ce"
CONCURRENCY = 8
CHUNK_BYTES = 8 * MIB


class MotoServer(LocalAws):
    """The project's local moto server, HTTPS (moto's own certificate, or ``tls_args``) unless ``http``;
    it also reports the server's CPU time."""

    def __init__(self, http: bool, tls_args: list[str] | None = None):
        super().__init__(tls_args=() if http else (tls_args or ["-s"]), start_timeout_s=60)

    def cpu_s(self) -> float:
        """The server process's CPU seconds so far (user + system, from /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_client(url: str, verify: bool | str = False):
    session = boto3.session.Session(aws_access_key_id="bench", aws_secret_access_key="bench",
                                    region_name="us-east-1")
    # worker.core.aws.client_config's retries and timeouts; the pool as large as the concurrency needs.
    config = Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=5, read_timeout=60,
                    max_pool_connections=CONCURRENCY + 2)
    return session.client("s3", endpoint_url=url, verify=verify, config=config)


def count_requests(client) -> Counter:
    counter: Counter = Counter()
    client.meta.events.register("before-call.s3", lambda model, **_: counter.update([model.name]))
    return counter


def write_artifacts(output: Path) -> tuple[dict[str, Path], float]:
    """The five files at the shipped pipeline's paths, and the seconds their stage manifests took."""
    config = load_pipeline_config(ROOT / "config" / "pipeline.toml")
    files = {}
    for name, size_mib in SIZES_MIB.items():
        path = output / config.artifacts[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            for _ in range(size_mib // 8):
                handle.write(os.urandom(8 * MIB))
            handle.write(os.urandom((size_mib % 8) * MIB))
        files[name] = path
    started_s = time.perf_counter()
    for stage in config.stages:
        write_manifest(manifest_path(output, stage.name), output, stage.name, stage.fingerprint, stage.outputs)
    return files, time.perf_counter() - started_s


def empty_bucket(client) -> None:
    for upload in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads") or []:
        client.abort_multipart_upload(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents") or []:
            client.delete_object(Bucket=BUCKET, Key=item["Key"])


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ProjectSide:
    """The job's step 1-2 with a real record lease as its proof."""

    def __init__(self, client, output: Path, files: dict[str, Path], store_dir: Path):
        self.client, self.output, self.files = client, output, files
        self.requests = count_requests(client)
        self.uploader = ArtifactUploader(client, BUCKET)  # as worker.app builds it
        store = SqliteStore(str(store_dir / "records.db"))
        store.submit({"_id": JOB_ID, "profileId": PROFILE_ID, "environment": "production"}, {"_id": PROFILE_ID})
        attempt = store.claim(JOB_ID, owner="bench", token="bench-token", lease_s=3600).attempt
        self.store_lease = StoreLease(attempt, StopSignal(), margin_s=10)

    def proof(self) -> None:
        self.store_lease.renew()
        self.part_proof()

    def part_proof(self) -> None:
        self.store_lease.ensure_live()

    def key_for(self, sha256_hex: str, rel: str) -> str:
        return artifact_key("models", "production", PROFILE_ID, JOB_ID, sha256_hex, rel)

    def run(self) -> dict[str, str]:
        verify_local(self.output, self.files)
        return self.uploader.upload_all(self.output, self.files, self.key_for, proof=self.proof,
                                        part_proof=self.part_proof, recorded=recorded_outputs(self.output))


class BaselineSide:
    def __init__(self, client, files: dict[str, Path], output: Path):
        self.client, self.files, self.output = client, files, output
        self.requests = count_requests(client)
        self.manager = TransferManager(client, TransferConfig(
            max_request_concurrency=CONCURRENCY, multipart_chunksize=CHUNK_BYTES,
            multipart_threshold=CHUNK_BYTES))

    def run(self) -> None:
        futures = [self.manager.upload(str(path), BUCKET, "baseline/" + path.relative_to(self.output).as_posix())
                   for path in self.files.values()]
        for future in futures:
            future.result()


def timed(side, server: MotoServer) -> tuple[float, float, Counter, float]:
    """Wall seconds, this process's CPU seconds, the requests, the server's CPU seconds."""
    side.requests.clear()
    server0, cpu0, t0 = server.cpu_s(), cpu_s(), time.perf_counter()
    side.run()
    wall_s, client_cpu_s = time.perf_counter() - t0, cpu_s() - cpu0
    return wall_s, client_cpu_s, Counter(side.requests), server.cpu_s() - server0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--http", action="store_true", help="plain HTTP: botocore then signs every payload")
    parser.add_argument("--dir", type=Path, default=None, help="where the 1 GiB of artifacts is written")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    # The uploader's per-object info lines would bury the figures.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    work = Path(tempfile.mkdtemp(prefix="bench-uploads-", dir=args.dir))
    try:
        output = work / "output"
        files, manifest_s = write_artifacts(output)
        total_mib = sum(SIZES_MIB.values())
        print(f"{total_mib} MiB in five files ({', '.join(f'{n} {s} MiB' for n, s in SIZES_MIB.items())}); "
              f"stage manifests (hashed at stage end, not part of either side): {manifest_s:.2f} s")
        with MotoServer(args.http) as server:
            setup = make_client(server.url)
            setup.create_bucket(Bucket=BUCKET)
            project = ProjectSide(make_client(server.url), output, files, work)
            baseline = BaselineSide(make_client(server.url), files, output)
            results: dict[str, list[tuple[float, float, Counter]]] = {"project": [], "baseline": []}
            retry = None
            for number in range(args.rounds):
                order = [("project", project), ("baseline", baseline)]
                for name, side in order if number % 2 == 0 else reversed(order):
                    results[name].append(timed(side, server))
                    if name == "project" and retry is None:
                        retry = timed(project, server)  # every object is there now: a redelivered job's upload
                    empty_bucket(setup)
                wall = {name: results[name][-1][0] for name in results}
                print(f"round {number + 1}: project {wall['project']:.2f} s, baseline {wall['baseline']:.2f} s "
                      f"(free disk {shutil.disk_usage('/').free / 2**30:.1f} GiB)")
            baseline.manager.shutdown()
        median = {name: statistics.median(r[0] for r in rows) for name, rows in results.items()}
        cpu = {name: statistics.median(r[1] for r in rows) for name, rows in results.items()}
        server_cpu = {name: statistics.median(r[3] for r in rows) for name, rows in results.items()}
        for name in ("project", "baseline"):
            requests = results[name][-1][2]
            print(f"{name:9s} median {median[name]:6.2f} s, {total_mib / median[name]:6.1f} MiB/s, "
                  f"client CPU {cpu[name]:5.2f} s, server CPU {server_cpu[name]:5.2f} s, "
                  f"requests {sum(requests.values())}: "
                  + ", ".join(f"{op} {n}" for op, n in sorted(requests.items())))
        print(f"retry with all five stored: {retry[0]:.2f} s, requests: "
              + ", ".join(f"{op} {n}" for op, n in sorted(retry[2].items())))
        per_round = [p[0] / b[0] for p, b in zip(results["project"], results["baseline"], strict=True)]
        print(f"ratio project/baseline: {median['project'] / median['baseline']:.2f} "
              f"(medians of {args.rounds} rounds, {'HTTP' if args.http else 'HTTPS'}); per round "
              + ", ".join(f"{r:.2f}" for r in per_round) + f", median {statistics.median(per_round):.2f}; "
              f"fastest rounds {min(r[0] for r in results['project']) / min(r[0] for r in results['baseline']):.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
