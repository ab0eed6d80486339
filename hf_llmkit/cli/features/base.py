"""`Feature`: one switchable capability of the main jobs, owning everything the job does for it.

A feature is an object with a name (the attribute its parsed arguments take on the job's `Args`: `args.peft`) and
any of these, each a no-op by default:

- `arguments`: the dataclass of its flags (their defaults and help are the dataclass's, or derived from a config),
  `defaults`: the job's defaults of its flags where they differ, `flag_groups`: its flags that act only when another
  of its flags is on (`hf_llmkit.cli.feature_flags.FlagGroup`), `derived_defaults`: defaults that follow from what
  was typed;
- `check(args)`: the combinations it cannot work in, refused before any work with a `ValueError` naming the fix;
  `check_folders(args)`: what it writes inside the output folder, checked once that folder is settled (before any
  work, with the job's other folder checks);
- `folder_suffix(values)`: its part of the default output folder name (`outputs/run_clm-lora-dkm`);
- `load_config(args)`: the `quantization_config` the model is loaded with; `model_stage(args, state)`: what it does
  to the loaded model (`state.model`), run in the order of `stage` (upcycle, quantize, check, prepare, wrap);
- `callbacks(args)`: the Trainer callbacks it adds; `train_results(args, examples)`: what it adds to the results;
  `finished(args, trainer)`: what it writes once the job has trained, saved and evaluated (a merged model);
- `row` and `describe(args)`: its line in the results table (`row_when_off` when it is off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hf_llmkit.cli.feature_flags import FlagGroup

__all__ = ["BuildState", "Feature"]


@dataclass
class BuildState:
    """The model being built, passed from stage to stage (`model` is replaced by each stage that changes it)."""

    model: Any
    tokenizer: Any
    loaded_with: Any = None  # the quantization_config the model was loaded with (None: loaded as is)
    template: Any = None  # P-tuning v1: places each sample in the template
    base: Any = None  # from-scratch PEFT runs: (base model, tokenizer) the adapter trains on
    teacher: Any = None  # --distill_from_source: the source model the run distils from


class Feature:
    """A feature of the main jobs (see the module docstring); subclasses override what they own."""

    name: ClassVar[str]
    arguments: ClassVar[type | None] = None
    defaults: ClassVar[Mapping[str, Any]] = {}
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = ()
    in_run_identity: ClassVar[bool] = True  # its flags decide whether an output folder holds the same run
    stage: ClassVar[int | None] = None  # position of `model_stage` among the features' (None: it has none)
    row: ClassVar[str | None] = None  # its row in the results table
    row_when_off: ClassVar[str] = "none"

    def derived_defaults(self, values: Mapping[str, Any], given: set[str]) -> dict[str, Any]:
        return {}

    def check(self, args: Any) -> None:
        return None

    def check_folders(self, args: Any) -> None:
        return None

    def folder_suffix(self, values: Mapping[str, Any]) -> str | None:
        return None

    def load_config(self, args: Any) -> Any:
        return None

    def model_stage(self, args: Any, state: BuildState) -> None:
        return None

    def callbacks(self, args: Any) -> list[Any]:
        return []

    def train_results(self, args: Any, examples: int, *, warn: bool = False) -> dict[str, Any]:
        return {}

    def finished(self, args: Any, trainer: Any) -> dict[str, Any]:
        return {}

    def describe(self, args: Any) -> str | None:
        return None
