"""A stage's ``NOTE <text>`` lines reach the job's progress object, and from there the job record."""

from __future__ import annotations

import pytest

from pipeline.config import StageSpec
from pipeline.run import ReportedProgress
from pipeline.stages import NOTE_MAX_CHARS, parse_note, run_stage
from tests.pipeline.test_stages import ctx, script  # noqa: F401 - ctx is the fixture
from worker.core.stop import StopSignal


class Keeper:
    """A progress callback that keeps notes, as the job's does."""

    def __init__(self):
        self.progress: list[tuple[str, float]] = []
        self.notes: list[tuple[str, str]] = []

    def __call__(self, stage: str, percent: float) -> None:
        self.progress.append((stage, percent))

    def note(self, stage: str, text: str) -> None:
        self.notes.append((stage, text))


def test_note_lines_reach_a_progress_object_that_keeps_notes(tmp_path, ctx):  # noqa: F811
    """Each NOTE line is handed on with its stage, in order, through the pipeline's progress wrapper;
    other lines are not."""
    body = (
        "import sys\n"
        "for line in ['NOTE left out clip 3: 0.2 s, too short', 'PROGRESS 50', 'NOTES not one', 'NOTE',\n"
        "             'note lower case', 'NOTE   second note  ']:\n"
        "    print(line, flush=True)\n"
        "open(sys.argv[1], 'w').write('done')\n"
    )
    stage = StageSpec(name="n", argv=("{python}", script(tmp_path, "n", body), "{output_dir}/o"), outputs=("o",))
    keeper = Keeper()
    run_stage(stage, ctx, StopSignal(), ReportedProgress(keeper))
    assert keeper.notes == [("n", "left out clip 3: 0.2 s, too short"), ("n", "second note")]
    assert keeper.progress == [("n", 50.0)]


def test_a_plain_progress_callback_is_not_bothered_by_notes(tmp_path, ctx):  # noqa: F811
    """A stage's notes need nothing of a callback that keeps none."""
    body = "import sys\nprint('NOTE hello', flush=True)\nopen(sys.argv[1], 'w').write('done')\n"
    stage = StageSpec(name="n", argv=("{python}", script(tmp_path, "n", body), "{output_dir}/o"), outputs=("o",))
    seen: list = []
    run_stage(stage, ctx, StopSignal(), lambda name, pct: seen.append((name, pct)))
    assert seen == []


@pytest.mark.parametrize(("line", "text"), [
    (b"NOTE a\x1b[31mred\x07 text\n", "a [31mred  text"),
    (b"NOTE " + "é".encode() * 600 + b"\n", "é" * NOTE_MAX_CHARS),
    (b"NOTE \xff\xfe bytes\n", "\ufffd\ufffd bytes"),
])
def test_a_note_is_printable_text_of_bounded_length(line, text):
    """Control characters become spaces, bad UTF-8 is replaced, and a note is cut to its bound."""
    assert parse_note(line) == text
