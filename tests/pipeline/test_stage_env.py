"""Stages run with an allow-listed environment: never the worker's credentials, refused at start-up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.config import StageSpec, parse_pipeline_config
from pipeline.run import run_pipeline
from pipeline.stage_env import BUILTIN_NAMES, is_secret_name, stage_env_problems, stage_environment
from pipeline.stages import StageContext, run_stage
from tests.pipeline.test_dataset import write_inputs
from tests.support import ARTIFACT_KEYS
from worker.core.errors import ConfigError
from worker.core.stop import StopSignal
from worker.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
DUMP_ENV = "import json, os, sys\nopen(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))\n"
SECRETS = {
    "MONGO_URI": "mongodb://voice:hunter2@mongo.internal/voice",
    "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "SENTRY_DSN": "https://public@sentry.example/1",
    "HF_TOKEN": "hf_abc",
}


def dump_stage(tmp_path: Path) -> StageSpec:
    path = tmp_path / "dump_env.py"
    path.write_text(DUMP_ENV)
    return StageSpec(name="dump", argv=("{python}", str(path), "{output_dir}/env.json"), outputs=("env.json",))


def context(tmp_path: Path, **env) -> StageContext:
    return StageContext(dataset_dir=tmp_path / "ds", output_dir=tmp_path / "out", checkpoints_root=tmp_path / "ck",
                        log_dir=tmp_path / "logs", job_id="j", language="en", **env)


def seen_env(ctx: StageContext) -> dict[str, str]:
    return json.loads((ctx.output_dir / "env.json").read_text())


def test_stage_gets_allow_listed_and_passthrough_names_but_no_secret(tmp_path):
    """A stage sees PATH, locale, GPU selection and passed-through names, never a credential, even if listed."""
    source = {**SECRETS, "PATH": "/usr/bin:/bin", "HOME": "/home/w", "LANG": "C.UTF-8",
              "CUDA_VISIBLE_DEVICES": "0", "EXTRA_OK": "yes", "UNLISTED": "no"}
    ctx = context(tmp_path, env=stage_environment(source, ("EXTRA_OK", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN")))
    run_stage(dump_stage(tmp_path), ctx, StopSignal(), lambda *_: None)
    env = seen_env(ctx)
    assert not set(SECRETS) & set(env)
    assert {k: env[k] for k in ("PATH", "HOME", "LANG", "CUDA_VISIBLE_DEVICES", "EXTRA_OK")} == {
        "PATH": "/usr/bin:/bin", "HOME": "/home/w", "LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0",
        "EXTRA_OK": "yes"}
    assert env["PYTHONUNBUFFERED"] == "1" and "UNLISTED" not in env
    assert not any(value in json.dumps(env) for value in SECRETS.values())


def test_context_without_an_env_does_not_inherit_the_workers_secrets(tmp_path, monkeypatch):
    """A StageContext built without an environment gives the stage the built-in list, not os.environ."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    ctx = context(tmp_path)
    run_stage(dump_stage(tmp_path), ctx, StopSignal(), lambda *_: None)
    env = seen_env(ctx)
    assert not set(SECRETS) & set(env) and "PATH" in env


def test_secret_looking_passthrough_names_are_refused_and_builtins_are_clean():
    """stage_env_problems names each secret-looking entry; no built-in name looks like a secret."""
    names = ("HF_HOME", "MONGO_URI", "AWS_REGION", "SENTRY_DSN", "WANDB_API_KEY", "DB_PASSWORD", "GH_TOKEN",
             "DATABASE_URL", "MY_SECRET_FILE")
    problems = stage_env_problems(names)
    assert len(problems) == len(names) - 1 and not any("HF_HOME" in line for line in problems)
    assert all(name in "\n".join(problems) for name in names[1:])
    assert not any(is_secret_name(name) for name in BUILTIN_NAMES)


def test_worker_refuses_to_start_with_a_secret_in_the_passthrough_list():
    """build_app raises ConfigError before any AWS or store call when STAGE_ENV_PASSTHROUGH lists a secret."""
    from worker.app import build_app

    settings = load_settings({"STAGE_ENV_PASSTHROUGH": "HF_HOME,HF_TOKEN",
                              "PIPELINE_CONFIG": str(REPO / "config" / "pipeline.toml")})
    with pytest.raises(ConfigError) as caught:
        build_app(settings)
    assert caught.value.problems == stage_env_problems(["HF_TOKEN"])


def test_run_pipeline_hands_its_stage_env_to_every_stage(tmp_path):
    """The environment given to run_pipeline is exactly what the configured stages run with."""
    script = tmp_path / "all.py"
    script.write_text("import json, os, sys\nout = sys.argv[1]\nfor name in sys.argv[2:]:\n"
                      "    os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)\n"
                      "    open(os.path.join(out, name), 'w').write(json.dumps(dict(os.environ)))\n")
    outputs = [f"a/{key}.bin" for key in ARTIFACT_KEYS]
    config = parse_pipeline_config({
        "artifacts": dict(zip(ARTIFACT_KEYS, outputs, strict=True)),
        "stages": [{"name": "all", "argv": ["{python}", str(script), "{output_dir}", *outputs], "outputs": outputs}],
    })
    inputs = write_inputs(tmp_path / "media")
    sources = {f"https://m.example/{i}": path for i, (path, _, _) in enumerate(inputs)}
    job = type("Job", (), {"job_id": "j", "language": "en",
                           "recordings": [type("Rec", (), {"url": url, "text": text})()
                                          for url, (_, text, _) in zip(sources, inputs, strict=True)]})()
    paths = run_pipeline(job, tmp_path / "work", StopSignal(), config=config,
                         fetch=lambda url, dest: shutil.copyfile(sources[url], dest),
                         progress=lambda *_: None, stage_env={"PATH": "/usr/bin:/bin", "ONLY_THIS": "1"})
    env = json.loads(next(iter(paths.values())).read_text())
    env.pop("LC_CTYPE", None)  # set by Python's own C-locale coercion in the stage, not by us
    assert env.pop("VOICE_WORKER_STAGE_RUN") and env.pop("VOICE_WORKER_JOB") == str((tmp_path / "work").resolve())
    assert env.pop("VOICE_WORKER_ATTEMPT") == ""  # a lone job directory is no attempt directory
    assert env == {"PATH": "/usr/bin:/bin", "ONLY_THIS": "1"}
