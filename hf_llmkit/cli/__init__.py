"""Building blocks of training commands people type (`examples/run_clm.py` is composed of them).

- `errors`: `UsageError`, one-line messages, exit status 2 (`exit_on_error`, `usage_errors`).
- `parser`: `CommandLineParser` (`HfArgumentParser` with JSON flag files, one-line errors, feature-flag checks);
  `help`: its grouped `--help` / `--help-all`.
- `feature_flags`: `FlagGroup`: a feature's flags are an error while the feature is off.
- `arguments`: `ModelArguments`, `DataArguments`, `RunArguments` of a causal-LM training command.
- `folders`: output / cache / model / tokenizer / checkpoint folder checks made before any work.
- `model_loading`: the tokenizer and model to train (pretrained folder, or `--model_type` from a config).
- `output`: quiet, rank-0 console output (narrow filters for known upstream noise).
- `results`: perplexity, results files as transformers' run_clm writes them, the results table.

The user's data files are checked by `hf_llmkit.data_files`; the PEFT, DKM / bitsandbytes and MoE arguments live
with their features (`hf_llmkit.tuners.arguments`, `hf_llmkit.quantization.arguments`,
`hf_llmkit.parallel.moe.arguments`).
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
