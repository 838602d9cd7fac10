"""The layout is the layering: worker/core imports nothing voice-specific, and no layer imports one above it.

    worker/core     the generic queue worker: queue, heartbeat, loop, stop, errors, process, logs
    pipeline/       downloads, dataset, stages, the five artifacts                (uses core)
    worker/voice    the voice-cloning job: message, handler, artifacts, records   (uses core, pipeline)
    worker/ops      operator commands, demo, dev stack                            (uses all)
    worker/app.py   the wiring of the daemon; worker/settings.py the one shared settings object, which
                    builds each layer's own config values (no layer imports it)
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What each layer may import from the project, besides itself.
ALLOWED: dict[str, set[str]] = {
    "worker.core": set(),
    "worker.voice": {"worker.core", "pipeline"},
    "pipeline": {"worker.core"},
}


def project_imports(path: Path) -> set[str]:
    """Every worker.* or pipeline.* module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.update({node.module} if node.module not in ("worker", "pipeline")
                         else {f"{node.module}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("worker", "pipeline")}


def crossings(layer: str) -> dict[str, list[str]]:
    """The layer's modules that import something outside the layer and what it may use."""
    allowed = (layer, *ALLOWED[layer])
    found = {}
    for path in sorted((REPO / Path(*layer.split("."))).rglob("*.py")):
        bad = sorted(name for name in project_imports(path)
                     if not any(name == ok or name.startswith(ok + ".") for ok in allowed))
        if bad:
            found[str(path.relative_to(REPO))] = bad
    return found


def test_the_core_imports_only_the_core():
    """No core module imports the settings, the job, the records, the pipeline or the operator commands."""
    assert crossings("worker.core") == {}


def test_the_voice_job_and_the_pipeline_import_no_operator_command():
    """The pipeline stands on the core alone, the job on the core and the pipeline; neither on settings or ops."""
    assert crossings("worker.voice") == {} and crossings("pipeline") == {}


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """An import tucked into a function body counts like one at the top, also ``from worker import x``."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from worker.voice.job import VoiceJobHandler\n    from worker import app\n")
    assert project_imports(module) == {"worker.voice.job", "worker.app"}
