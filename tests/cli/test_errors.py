"""hf_llmkit.cli.errors: input errors end a command with one line and a status; other errors keep their traceback."""

from __future__ import annotations

import pytest

from hf_llmkit.cli import UsageError, exit_on_error, one_line, usage_errors


class Interrupted(RuntimeError):
    exit_code = 143  # a library error meant for the person running the command carries its status


def _fail(err: BaseException):
    def run():
        raise err

    return run


@pytest.mark.parametrize(
    ("error", "status", "line"),
    [
        (UsageError("--x 1 is wrong; pass --x 2"), 2, "cmd.py: error: --x 1 is wrong; pass --x 2"),
        (ValueError("multi\n  line\tmessage"), 5, "cmd.py: error: multi line message"),
        (Interrupted("stopped at step 8; re-run the command to continue"), 143, "cmd.py: error: stopped at step 8"),
    ],
)
def test_known_errors_end_with_one_line_and_their_status(capsys, monkeypatch, error, status, line):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as done:
        exit_on_error(_fail(error), prog="cmd.py", exit_codes={ValueError: 5})
    err = capsys.readouterr().err
    assert done.value.code == status and err.startswith(line) and err.count("\n") == 1


def test_other_ranks_stay_silent_and_bugs_keep_their_traceback(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("hf_llmkit.cli.errors._OTHER_RANKS_EXIT_DELAY_S", 0.0)
    with pytest.raises(SystemExit):
        exit_on_error(_fail(UsageError("bad")), prog="cmd.py")
    assert capsys.readouterr().err == ""
    with pytest.raises(KeyError):
        exit_on_error(_fail(KeyError("bug")), prog="cmd.py")


def test_usage_errors_turn_value_errors_into_one_line():
    with pytest.raises(UsageError, match="^a b c$"), usage_errors():
        raise ValueError("a\nb   c")
    with pytest.raises(UsageError, match="disk"), usage_errors(OSError):
        raise OSError("disk")
    with pytest.raises(TypeError), usage_errors():
        raise TypeError("not converted")
    assert len(one_line("x" * 5000)) == 600
