"""The command line itself: which argv reaches the daemon without a parser, and how a command ends on Ctrl-C."""

from __future__ import annotations

import pytest

from worker.ops import cli, commands
from worker.settings import Settings


def test_ctrl_c_during_an_operator_command_exits_130_with_one_line(monkeypatch, capsys):
    """A KeyboardInterrupt inside a command ends it with exit 130 and '<command> interrupted' on stderr."""
    def interrupted(_settings):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_health", interrupted)
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    assert cli.main(["health"]) == 130
    assert capsys.readouterr().err.strip() == "health interrupted"


@pytest.mark.parametrize("argv", [[], ["run"]], ids=["no command", "run"])
def test_the_daemon_starts_without_building_the_command_parser(monkeypatch, argv):
    """`python -m worker` and `python -m worker run` go to the daemon with its settings, argparse unused."""
    def no_parser():
        raise AssertionError("the daemon's start built the parser")

    started = []
    monkeypatch.setattr(cli, "build_parser", no_parser)
    monkeypatch.setattr(cli, "cmd_run", lambda settings, _args: started.append(settings) or 0)
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    assert cli.main(argv) == 0
    assert len(started) == 1 and isinstance(started[0], Settings)


def test_run_with_an_option_still_goes_through_the_parser(capsys):
    """`run --help` is parsed as before: the run command's help, exit 0."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "--help"])
    assert exited.value.code == 0 and "Take jobs from SQS_QUEUE_URL" in capsys.readouterr().out
