"""The generic core (queue, heartbeat, loop, stop, errors, process, logs) imports nothing voice-specific."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What a queue worker for any job would need; the voice-cloning job, the records, the pipeline and
# the operator commands sit on top of it.
CORE = frozenset({"errors", "stop", "queue", "lease", "loop", "daemon", "health", "metrics", "reporting",
                  "faults", "redact", "logs", "aws"})
# The one shared object the core may read: the validated settings, built once at start-up.
SHARED = frozenset({"settings"})


def project_imports(path: Path) -> set[str]:
    """Every worker.* or pipeline.* module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("worker", "pipeline")}


def test_the_core_imports_only_the_core_and_the_settings():
    """No core module imports the job, the records, the pipeline or the operator commands."""
    allowed = {f"worker.{name}" for name in CORE | SHARED}
    crossings = {name: sorted(project_imports(REPO / "worker" / f"{name}.py") - allowed) for name in sorted(CORE)}
    assert {name: found for name, found in crossings.items() if found} == {}


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """An import tucked into a function body counts like one at the top."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from worker.job import VoiceJobHandler\n")
    assert project_imports(module) == {"worker.job"}
