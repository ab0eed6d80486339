"""Building blocks of training commands people type (`examples/run_clm.py` is composed of them).

- `errors`: `UsageError`, one-line messages, exit status 2 (`exit_on_error`, `usage_errors`).
- `parser`: `CommandLineParser` (`HfArgumentParser` with JSON flag files, one-line errors, feature-flag checks);
  `help`: its grouped `--help` / `--help-all`.
- `feature_flags`: `FlagGroup`: a feature's flags are an error while the feature is off.
- `options`: flags derived from the declarations they configure (config dataclasses, function signatures).
- `checks`: every number checked before any work (NaN, infinity, declared bounds, a run that trains nothing).
- `arguments`: `ModelArguments`, `DataArguments`, `RunArguments` of a causal-LM training command; `peft`
  (`PeftArguments`, from `hf_llmkit.tuners.PEFT_METHODS`), `quantization` (`DKMArguments` from `DKMConfig`,
  `KbitArguments`), `moe` (`MoEArguments`, from `upcycle_to_moe`).
- `job`: what the main jobs (`run_clm.py`, `run_sft.py`) share: parsing, model, trainer, results, `main()`; a fixed
  pipeline over `features` (one object per feature: flags, checks, folder suffix, model stage, callbacks, results).
- `folders`: output / cache / model / tokenizer / checkpoint folder checks made before any work.
- `model_loading`: the tokenizer and model to train (pretrained folder, or `--model_type` from a config).
- `output`: quiet, rank-0 console output (narrow filters for known upstream noise).
- `results`: perplexity, results files as transformers' run_clm writes them, the results table.

The user's data files are checked by `hf_llmkit.data.files`. This package depends on the features; no feature
imports it (tests/cli/test_import_direction.py).
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
