"""The job record as the ledger of the job's S3 mirror (``pipeline.remote_work.Ledger``).

Every worker role can write under the mirror's ``.work/`` prefix, so a restore believes only what the
job record vouches for: each attempt's history entry names the digests of the listings and manifests
it mirrored (``rules.with_mirror``), written fenced on its claim token; an attempt is found under the
name its number and token give it (``pipeline.workdir.attempt_dir_name``), never under a name read from
the bucket.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.workdir import attempt_dir_name
from worker.voice.records.attempt import Attempt
from worker.voice.records.models import JobRecord
from worker.voice.records.rules import vouched_mirrors


class RecordLedger:
    """One attempt's view of the record: the other attempts' vouched mirrors as the claim read them,
    and its own vouches, each a fenced write."""

    def __init__(self, attempt: Attempt, claimed: JobRecord | None):
        self._attempt = attempt
        # As the claim read them: an attempt before ours can write no more (its token is fenced out).
        self._vouched = {attempt_dir_name(number, token): items
                         for number, token, items in vouched_mirrors(claimed, attempt.token)}

    def vouched(self) -> Mapping[str, Mapping[str, str]]:
        return self._vouched

    def vouch(self, item: str, sha256_hex: str) -> None:
        self._attempt.vouch_mirror(item, sha256_hex)
