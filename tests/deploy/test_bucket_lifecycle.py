"""The model bucket's lifecycle rules: the shipped stage logs and the attempts' work mirrors expire after
their parameterised number of days, each under exactly the prefix the worker writes them to, and no rule
expires a model."""

from __future__ import annotations

from tests.deploy.cfn import Resolver, load_template
from worker.voice.artifacts import artifact_key
from worker.voice.stage_logs import chunk_key, job_logs_prefix

PREFIX = "models/v1"
MODEL_KEY = artifact_key(PREFIX, "production", "p1", "j1", "ab" * 32, "full/model.pth")
CHUNK_KEY = chunk_key(PREFIX, "665f1c2e9b1e8a0012ab34cd", "0002-1a2b3c4d", "20261202T052042.118313Z-train_full.log", 0)


def _rules(**params) -> dict[str, dict]:
    bucket = Resolver(load_template(), ModelPrefix=PREFIX, **params).resource("ModelBucket")
    return {rule["Id"]: rule for rule in bucket["LifecycleConfiguration"]["Rules"]}


def _expiring(rules: dict[str, dict], key: str) -> set[str]:
    """The enabled rules that expire the current version of ``key``."""
    return {rule_id for rule_id, rule in rules.items()
            if rule["Status"] == "Enabled" and "ExpirationInDays" in rule and key.startswith(rule.get("Prefix", ""))}


def test_shipped_logs_expire_after_thirty_days_by_default():
    """The ExpireShippedLogs rule covers <prefix>/.logs/, the prefix stage_logs.py ships every job's logs under,
    and removes them (and their noncurrent versions) after ShippedLogRetentionDays, 30 by default."""
    rule = _rules()["ExpireShippedLogs"]
    assert rule["Status"] == "Enabled"
    assert job_logs_prefix(PREFIX, "j1") == rule["Prefix"] + "j1/"
    assert int(rule["ExpirationInDays"]) == 30
    assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 1}
    assert load_template()["Parameters"]["ShippedLogRetentionDays"]["MinValue"] == 1


def test_shipped_log_retention_follows_its_parameter():
    """ShippedLogRetentionDays sets the logs' expiry and nothing else's."""
    default, short = _rules(), _rules(ShippedLogRetentionDays="7")
    assert int(short["ExpireShippedLogs"]["ExpirationInDays"]) == 7
    assert {k: v for k, v in short.items() if k != "ExpireShippedLogs"} == {
        k: v for k, v in default.items() if k != "ExpireShippedLogs"}


def test_a_shipped_chunk_expires_by_its_rule_and_a_model_by_none():
    """A chunk key matches the logs' rule only; no rule expires a committed model's current version."""
    rules = _rules()
    assert _expiring(rules, CHUNK_KEY) == {"ExpireShippedLogs"}
    assert _expiring(rules, MODEL_KEY) == set()
