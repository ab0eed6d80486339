"""Bad input from the person running a command: one line that says what to change, exit status 2.

Library functions raise `ValueError` naming the fix; a command turns the ones that come from its input into a
`UsageError` (`usage_errors()`), and `exit_on_error` prints it as one line (from one rank) and exits.

    def main():
        exit_on_error(run, prog="run_clm.py")

    def run():
        with usage_errors():
            files = find_data_files(dataset_dir=args.dataset_dir)   # ValueError -> UsageError
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from hf_llmkit.checkpoints.exit_codes import EXIT_USAGE

__all__ = ["USAGE_EXIT_CODE", "UsageError", "exit_on_error", "one_line", "usage_errors"]

USAGE_EXIT_CODE = EXIT_USAGE  # argparse's status for bad arguments
_MAX_CHARS = 600
_OTHER_RANKS_EXIT_DELAY_S = 3.0


class UsageError(ValueError):
    """The command's input is wrong; the message says what to change (printed as one line, exit status 2)."""


def one_line(message: Any) -> str:
    """`message` on one line: whitespace runs (newlines of multi-line library errors) collapsed, long text cut."""
    text = " ".join(str(message).split())
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."


@contextmanager
def usage_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """Turn `ValueError` (and any of `kinds`) raised inside into `UsageError`: input checks and loading phases."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, *kinds) as err:
        raise UsageError(one_line(err)) from err


def _is_first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def exit_on_error(
    run: Callable[[], Any], *, prog: str, exit_codes: Mapping[type[BaseException], int] | None = None
) -> None:
    """Call `run()`; a `UsageError`, an error listed in `exit_codes`, or an error whose class sets an integer
    `exit_code` attribute (a library error meant for the person running the command) ends the process with that
    status and one line on stderr (none more when the error says it was `logged` already).

    Every rank of a multi-rank launch stops with the same status; only rank 0 prints the line (the others wait a
    moment first, so that a launcher stopping the group on the first failed rank does not cut rank 0 short).
    Other errors keep their traceback: they are bugs or failures, not input to fix.
    """
    codes = {UsageError: USAGE_EXIT_CODE, **(exit_codes or {})}
    try:
        run()
    except Exception as err:
        code = next((code for kind, code in codes.items() if isinstance(err, kind)), getattr(err, "exit_code", None))
        if not isinstance(code, int):
            raise
        if getattr(err, "logged", False):
            pass  # a run-ending error logged its one line already (hf_llmkit.checkpoints.endings)
        elif _is_first_rank():
            print(f"{prog}: error: {one_line(err)}", file=sys.stderr, flush=True)
        else:  # the other ranks read the same input: let rank 0 print before a launcher stops the group
            time.sleep(_OTHER_RANKS_EXIT_DELAY_S)
        raise SystemExit(code) from None
