"""What `--help` promises matches what the commands do (issue #27's defect 6)."""

from __future__ import annotations

import pytest

from worker.ops.cli import build_parser


def help_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args([*argv, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def test_dlq_list_and_dlq_redrive_each_have_their_own_help(capsys):
    """`dlq list --help` tells of listing and --json, `dlq redrive --help` of moving, --max and --fallback."""
    listing, redrive = help_of(capsys, "dlq", "list"), help_of(capsys, "dlq", "redrive")
    assert listing != redrive
    assert "--json" in listing and "--fallback" not in listing and "--max" not in listing
    assert "--fallback" in redrive and "--max" in redrive and "--json" not in redrive


@pytest.mark.parametrize("argv", [["dlq", "list", "--fallback"], ["dlq", "list", "--max", "3"],
                                  ["dlq", "redrive", "--json"], ["dlq"]])
def test_an_option_of_the_other_dlq_action_is_an_error(capsys, argv):
    """An option that belongs to the other action (or no action) is refused with exit 2, not ignored."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2


def test_doctors_help_names_every_kind_of_line_it_prints(capsys):
    """doctor prints PASS, FAIL and WARN lines, and its help says so."""
    assert "PASS/FAIL/WARN" in help_of(capsys, "doctor")
