"""Building blocks of training commands people type (`examples/run_clm.py` is composed of them).

- `errors`: `UsageError`, one-line messages, exit status 2 (`exit_on_error`, `usage_errors`).
- `parser`: `CommandLineParser` (`HfArgumentParser` with grouped `--help`, JSON files, feature-flag checks).
- `feature_flags`: `FlagGroup`: a feature's flags are an error while the feature is off.
- `folders`: output / cache / model / tokenizer / checkpoint folder checks made before any work.
- `output`: quiet, rank-0 console output (narrow filters for known upstream noise).
- `results`: perplexity, the results table and the run summary.
"""

from hf_llmkit.cli.errors import USAGE_EXIT_CODE, UsageError, exit_on_error, one_line, usage_errors
from hf_llmkit.cli.feature_flags import FlagGroup, check_feature_flags

__all__ = [
    "USAGE_EXIT_CODE",
    "FlagGroup",
    "UsageError",
    "check_feature_flags",
    "exit_on_error",
    "one_line",
    "usage_errors",
]
