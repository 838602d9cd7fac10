"""The layout is the layering: worker/core imports nothing voice-specific, and no layer imports one above it.

    worker/core     the generic queue worker: queue, heartbeat, loop, stop, errors, process, logs
    pipeline/       downloads, dataset, stages, the five artifacts                (uses core)
    worker/voice    the voice-cloning job: message, handler, artifacts, records   (uses core, pipeline)
    worker/ops      operator commands, demo, dev stack                            (uses all)
    worker/app.py   the wiring of the daemon; worker/settings.py the one shared settings object, which
                    builds each layer's own config values (no layer imports it)

Each layer draws the errors it defines in one place, the docstring of its errors module, on the
core's branches; and no modules import each other, by any kind of import, here or in the trainers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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


# Where each layer draws its error tree: the docstring of this module names every WorkerError class the
# layer's modules define (a nested layer's excepted), each under the class it derives from.
ERROR_TREES = {
    "worker.core": "worker/core/errors.py",
    "pipeline": "pipeline/errors.py",
    "worker.voice": "worker/voice/errors.py",
    "worker.voice.records": "worker/voice/records/errors.py",
}


def layer_files(layer: str) -> list[Path]:
    """The layer's modules, without those of a layer nested in it (the records in the voice job)."""
    nested = [REPO / Path(*other.split(".")) for other in ALLOWED if other.startswith(layer + ".")]
    return [path for path in sorted((REPO / Path(*layer.split("."))).rglob("*.py"))
            if not any(path.is_relative_to(folder) for folder in nested)]


def error_classes() -> dict[str, tuple[str, str]]:
    """Every class in worker/ and pipeline/ derived from WorkerError: name -> (its base, its file)."""
    defined = {}
    for path in sorted([*(REPO / "worker").rglob("*.py"), *(REPO / "pipeline").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.bases:
                base = node.bases[0]
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                defined[node.name] = (name, str(path.relative_to(REPO)))
    found, grown = {"WorkerError": ("Exception", "worker/core/errors.py")}, True
    while grown:
        more = {name: spec for name, spec in defined.items() if spec[0] in found and name not in found}
        found.update(more)
        grown = bool(more)
    return found


def drawn_tree(text: str, indent: int = 4) -> dict[str, str | None]:
    """The classes a drawing (indented by ``indent``) names, each with the class drawn above it (None
    for a root)."""
    drawn: dict[str, str | None] = {}
    parents: list[str] = []
    for line in text.splitlines():
        root = re.match(rf"^ {{{indent}}}([A-Z]\w+)", line)
        branch = re.match(rf"^ {{{indent}}}((?:[│ ] {{3}})*)[├└]── ([A-Z]\w+)", line)
        if root or branch:
            depth, name = (0, root.group(1)) if root else (len(branch.group(1)) // 4 + 1, branch.group(2))
            del parents[depth:]
            drawn[name] = parents[-1] if parents else None
            parents.append(name)
    return drawn


@pytest.mark.parametrize("layer", sorted(ERROR_TREES))
def test_each_layer_draws_its_errors_in_one_place(layer):
    """The layer's errors module draws every WorkerError class the layer defines under its parent, and
    draws nothing else but the core's classes it hangs them on."""
    classes = error_classes()
    files = {str(path.relative_to(REPO)) for path in layer_files(layer)}
    ours = {name: base for name, (base, file) in classes.items() if file in files}
    drawing = ast.get_docstring(ast.parse((REPO / ERROR_TREES[layer]).read_text(encoding="utf-8"))) or ""
    drawn = drawn_tree(drawing)
    assert {name: drawn.get(name, "(not drawn)") for name in ours} == {
        name: (None if name == "WorkerError" else base) for name, base in ours.items()}
    core = {name for name, (_base, file) in classes.items() if file == ERROR_TREES["worker.core"]}
    assert set(drawn) <= set(ours) | core
    assert all(parent is None or classes[name][0] == parent for name, parent in drawn.items())


def test_the_design_draws_every_layers_errors_where_they_live():
    """docs/design.md's failure classes: every class of the errors modules under its parent, each marked
    with the layer that defines it ([pipeline], [records], [voice]; the core's unmarked)."""
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    drawing = design.split("## Failure classes", 1)[1].split("```", 2)[1]
    drawn = drawn_tree(drawing, indent=0)
    classes = error_classes()
    tags = {"worker.core": None, "pipeline": "pipeline", "worker.voice.records": "records", "worker.voice": "voice"}
    expected = {name: tags[layer] for layer, file in ERROR_TREES.items()
                for name, (_base, defined_in) in classes.items() if defined_in == file}
    marked = {name: (tag.group(1) if (tag := re.search(rf"── {name}\S*\s+\[(\w+)\]", drawing)) else None)
              for name in drawn}
    assert marked == expected
    assert drawn == {name: (None if name == "WorkerError" else classes[name][0]) for name in expected}


def test_the_core_defines_no_error_of_a_layer_above():
    """The voice job's, the records' and the pipeline's errors live in their own layers, so the loop can
    decide only on the core's branches."""
    core = {name for name, (_base, file) in error_classes().items() if file.startswith("worker/core/")}
    assert core == {"WorkerError", "ConfigError", "RetryableError", "QueueError", "UnexpectedError",
                    "PermanentError", "InvalidMessage", "TimeLimitExceeded", "RetriesExhausted", "LeaseLost",
                    "Stopped", "HostFault"}


def module_paths() -> dict[str, Path]:
    """Every module of worker/, pipeline/ and the trainers' voice_trainers/, by its dotted name."""
    paths = {}
    for root, package in ((REPO, "worker"), (REPO, "pipeline"), (REPO / "trainers", "voice_trainers")):
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return paths


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` a file imports anywhere: at the top, under ``if TYPE_CHECKING``, inside a
    function. ``from pkg import name`` imports the module ``pkg.name`` when there is one, else ``pkg``
    itself (a name its ``__init__`` defines), whatever package the importing module is in."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif node.module in modules:
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found


def import_cycles(paths: dict[str, Path]) -> list[list[str]]:
    """Groups of modules that import each other, by any import: one at load time, one only for the type
    checker, one a function makes when it runs. Each group is a knot: no module of it can be read,
    tested or loaded without the others."""
    modules = set(paths)
    graph = {name: module_imports(path, modules) - {name} for name, path in paths.items()}
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
    """No group of modules in worker/, pipeline/ or trainers/voice_trainers/ imports each other, counting
    imports for the type checker and inside functions (the records once formed a cycle of six; the
    records' package and its MongoDB backend, an attempt and its store, and the trainers' command line
    and its stages each formed one through such imports)."""
    paths = module_paths()
    assert {"worker.core.loop", "pipeline.run", "voice_trainers.cli", "worker.voice.records"} <= set(paths)
    assert import_cycles(paths) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    """Two modules importing each other are one cycle; a module importing a sibling through its package's
    name depends on that sibling, not on the package."""
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("import pkg.a\n")
    (tmp_path / "c.py").write_text("from pkg import a\n")
    (tmp_path / "init.py").write_text("from pkg import c\n")
    paths = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py",
             "pkg": tmp_path / "init.py"}
    assert import_cycles(paths) == [["pkg.a", "pkg.b"]]


def test_the_cycle_finder_counts_type_only_and_in_function_imports(tmp_path):
    """An import under ``if TYPE_CHECKING`` or inside a function closes a cycle like one at the top, and
    so does a module that takes a name its own package's ``__init__`` defines."""
    (tmp_path / "init.py").write_text("def open_it():\n    from pkg.backend import Backend\n")
    (tmp_path / "backend.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from pkg import Config\n")
    (tmp_path / "store.py").write_text("from pkg.attempt import Attempt\n")
    (tmp_path / "attempt.py").write_text("def write():\n    import pkg.store\n")
    paths = {"pkg": tmp_path / "init.py", "pkg.backend": tmp_path / "backend.py",
             "pkg.store": tmp_path / "store.py", "pkg.attempt": tmp_path / "attempt.py"}
    assert import_cycles(paths) == [["pkg", "pkg.backend"], ["pkg.attempt", "pkg.store"]]
