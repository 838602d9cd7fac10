"""The command line's own ending of an operator command: Ctrl-C is exit 130 and one line."""

from __future__ import annotations

from worker.ops import cli, commands


def test_ctrl_c_during_an_operator_command_exits_130_with_one_line(monkeypatch, capsys):
    """A KeyboardInterrupt inside a command ends it with exit 130 and '<command> interrupted' on stderr."""
    def interrupted(_settings):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_health", interrupted)
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    assert cli.main(["health"]) == 130
    assert capsys.readouterr().err.strip() == "health interrupted"
