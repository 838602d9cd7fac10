"""doctor's store check says which store it reached, without credentials, and passes on a real MongoDB server."""

from __future__ import annotations

import io

import boto3
import pytest

from pipeline.config import load_pipeline_config
from tests.mongo_server import database_uri
from tests.ops.test_commands import good_deployment
from worker.core.redact import redact_url
from worker.ops.doctor import report, run_checks, store_description
from worker.settings import load_settings
from worker.voice.records import open_store


@pytest.mark.parametrize("env, said", [
    ({"STORE_URL": "sqlite:///var/dev/records.db"}, "sqlite:///var/dev/records.db"),
    ({"MONGO_URI": "mongodb://voice:hunter2@db.internal:27017/voicedb?authSource=admin"},
     "MongoDB at mongodb://db.internal:27017/voicedb, database voicedb, collections voiceclonings and useraudioprofiles"),
    ({"MONGO_URI": "mongodb+srv://u:p@cluster0.x.net/?retryWrites=true", "MONGO_DATABASE": "prod",
      "MONGO_JOBS_COLLECTION": "jobs"},
     "MongoDB at mongodb+srv://cluster0.x.net, database prod, collections jobs and useraudioprofiles"),
])
def test_the_store_is_described_by_kind_place_and_database_never_by_its_secret(env, said):
    """SQLite by its file; MongoDB by host, database (the URI's, else MONGO_DATABASE) and collections, without userinfo or query."""
    assert store_description(load_settings(env)) == said


def test_doctor_reaches_a_real_mongodb_server_and_says_so(sqs, mongo_server_uri, mongo_db):
    """Against a real MongoDB server the store check opens the store (indexes too), reads, and names the server."""
    q = good_deployment(sqs, "mongo")
    uri = database_uri(mongo_server_uri, mongo_db.name)
    settings = load_settings({"SQS_QUEUE_URL": q.url, "S3_BUCKET": "voice-models", "MONGO_URI": uri,
                              "AWS_REGION": "us-east-1", "MONGO_CONNECT_MAX_ATTEMPTS": "1"})
    checks = run_checks(settings, sqs=boto3.client("sqs", region_name="us-east-1"),
                        s3=boto3.client("s3", region_name="us-east-1"),
                        sts=boto3.client("sts", region_name="us-east-1"),
                        open_store=lambda s: open_store(s.store_config()), load_pipeline=load_pipeline_config)
    out = io.StringIO()
    assert report(checks, out=out) == 0, out.getvalue()
    assert f"PASS  store reachable: MongoDB at {redact_url(uri)}, database {mongo_db.name}," in out.getvalue()
    assert "idempotencyKey_unique" in mongo_db["voiceclonings"].index_information()
