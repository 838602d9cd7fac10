"""A failed step's message: headed by its own last line, its last lines after, the runner's lines left out, bounded."""

from __future__ import annotations

from pipeline.config import StageSpec
from pipeline.stages import FAILURE_MESSAGE_MAX_CHARS, LAST_LINE_MAX_CHARS, exit_error, failure_message, tail_lines


def test_the_message_starts_with_the_last_line_the_step_printed():
    """The first line is how it ended and the step's last line; the lines before follow under the log's name."""
    message = failure_message("stage s exited with code 2", "x-s.log", "step 1\nValueError: bad rate")
    assert message.split("\n") == ["stage s exited with code 2: ValueError: bad rate",
                                   "last lines of x-s.log:", "step 1", "ValueError: bad rate"]


def test_a_step_that_printed_nothing_says_so():
    """No output at all: the message says it, and where the log is, without an empty line."""
    assert str(exit_error(StageSpec(name="s", argv=("x",), outputs=("o",)), -9, "x-s.log", "")) == (
        "stage s was killed by signal 9, printing nothing; see x-s.log")


def test_the_runners_own_lines_and_blank_lines_are_not_the_failure(tmp_path):
    """The argv line the runner starts a log with, its exit line and blank lines never reach the tail."""
    log = tmp_path / "x-s.log"
    log.write_text("[runner 2026-12-02T05:00:00.000000Z] stage s starting: argv=['python', '--secret-path']\n"
                   "working\n\nOSError: disk gone\n   \n"
                   "[runner 2026-12-02T05:00:01.000000Z] stage s exited with code 1\n")
    assert tail_lines(log) == "working\nOSError: disk gone"


def test_a_long_tail_keeps_its_newest_lines_and_a_long_last_line_is_cut_in_the_head():
    """However much the step printed, the message fits the record: the head's last line is cut, the oldest lines go."""
    tail = "\n".join([f"line {i} " + "y" * 100 for i in range(40)] + ["E" * 1000])
    message = failure_message("stage s exited with code 1", "x-s.log", tail)
    assert len(message) <= FAILURE_MESSAGE_MAX_CHARS
    first = message.split("\n")[0]
    assert first == "stage s exited with code 1: " + "E" * LAST_LINE_MAX_CHARS
    assert "line 39" in message and "line 0 " not in message


def test_the_bound_leaves_room_in_the_records_error_message():
    """A step's whole message fits the record's error message, with room for a wrapper's words before it."""
    from worker.voice.records.rules import ERROR_MESSAGE_MAX_CHARS

    assert FAILURE_MESSAGE_MAX_CHARS + 100 <= ERROR_MESSAGE_MAX_CHARS
