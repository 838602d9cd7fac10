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
    # The records stand below the job: the handler uses them, they never use the handler.
    "worker.voice.records": {"worker.core", "pipeline"},
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


def test_the_records_import_nothing_of_the_job():
    """worker/voice/records uses the core and the pipeline, never the handler, the message or the uploads."""
    assert crossings("worker.voice.records") == {}


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """An import tucked into a function body counts like one at the top, also ``from worker import x``."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from worker.voice.job import VoiceJobHandler\n    from worker import app\n")
    assert project_imports(module) == {"worker.voice.job", "worker.app"}


def top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules a file imports when it is loaded (not under ``if TYPE_CHECKING`` or in a function)."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in modules)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found


def import_cycles(paths: dict[str, Path]) -> list[list[str]]:
    """Groups of modules that import each other at load time (a module's own packages excepted: Python
    loads those first anyway)."""
    modules = set(paths)
    graph = {name: {dep for dep in top_level_imports(path, modules) if not name.startswith(dep + ".")}
             for name, path in paths.items()}
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        reach = _reachable(graph, start)
        group = sorted(name for name in reach if start in _reachable(graph, name))
        done.update(group)
        if len(group) > 1:
            cycles.append(group)
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_modules_import_each_other():
    """No group of project modules imports each other at load time (the records once formed a cycle of six)."""
    paths = {}
    for path in sorted([*(REPO / "worker").rglob("*.py"), *(REPO / "pipeline").rglob("*.py")]):
        parts = path.relative_to(REPO).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    assert import_cycles(paths) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    """Two modules importing each other are one cycle; a module importing its own package is none."""
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("import pkg.a\n")
    (tmp_path / "c.py").write_text("from pkg import a\n")
    (tmp_path / "init.py").write_text("from pkg import c\n")
    paths = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py",
             "pkg": tmp_path / "init.py"}
    assert import_cycles(paths) == [["pkg.a", "pkg.b"]]
