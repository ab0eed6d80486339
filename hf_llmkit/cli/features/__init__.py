"""The main jobs' features and the fixed pipeline that walks them (`hf_llmkit.cli.job` calls these functions).

`FEATURES` is the registry, in the order the job walks them for flags, checks, the output folder's name, callbacks
and the results table; model stages run in the order of each feature's `stage` (the distillation's source 5,
upcycle 10, DKM 20, sequence parallel 30, k-bit 40, PEFT 50). Each feature is one module of this package
(`base.Feature`).

Add a feature: write `features/<name>.py` with its arguments dataclass and a `Feature` subclass instance, and add
it to `FEATURES` below (CONTRIBUTING.md, "Add a main-job feature"; `tests/cli/test_features.py` builds one).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.features.base import BuildState, Feature
from hf_llmkit.cli.features.distillation import DISTILLATION
from hf_llmkit.cli.features.dkm import DKM
from hf_llmkit.cli.features.kbit import KBIT
from hf_llmkit.cli.features.moe import MOE
from hf_llmkit.cli.features.peft import PEFT, adapter_base_dir
from hf_llmkit.cli.features.run import RUN
from hf_llmkit.cli.features.sequence_parallel import SEQUENCE_PARALLEL

__all__ = [
    "FEATURES", "BuildState", "Feature", "adapter_base_dir", "argument_types", "build_stages", "callbacks",
    "check_combinations", "check_folders", "default_values", "derived_defaults", "finished", "flag_groups",
    "folder_suffixes", "load_config", "setup_rows", "train_results",
]  # fmt: skip

FEATURES: tuple[Feature, ...] = (PEFT, DKM, DISTILLATION, KBIT, MOE, SEQUENCE_PARALLEL, RUN)


def _registry() -> tuple[Feature, ...]:
    """The registry as it is now (read at each call: a test may extend it)."""
    return FEATURES


def argument_types() -> list[type]:
    """The features' arguments dataclasses, in order (parsed between the data's and the training arguments)."""
    return [f.arguments for f in _registry() if f.arguments is not None]


def default_values() -> dict[str, Any]:
    return dict(chain.from_iterable(f.defaults.items() for f in _registry()))


def flag_groups() -> tuple[FlagGroup, ...]:
    return tuple(chain.from_iterable(f.flag_groups for f in _registry()))


def derived_defaults(values: Mapping[str, Any], given: set[str]) -> dict:
    derived: dict[str, Any] = {}
    for feature in _registry():
        derived.update(feature.derived_defaults(values, given))
    return derived


def check_combinations(args: Any) -> None:
    for feature in _registry():
        feature.check(args)


def check_folders(args: Any) -> None:
    for feature in _registry():
        feature.check_folders(args)


def folder_suffixes(values: Mapping[str, Any]) -> list[str]:
    return [suffix for f in _registry() if (suffix := f.folder_suffix(values))]


def load_config(args: Any) -> Any:
    """The one `quantization_config` the model is loaded with (None: none); two features asking is a bug that
    `check_combinations` should have refused."""
    configs = [(f.name, config) for f in _registry() if (config := f.load_config(args)) is not None]
    assert len(configs) <= 1, f"two features load the model quantized: {[name for name, _ in configs]}"
    return configs[0][1] if configs else None


def build_stages(args: Any, state: BuildState) -> BuildState:
    """Each feature's model stage, in the order of `stage`."""
    for feature in sorted((f for f in _registry() if f.stage is not None), key=lambda f: f.stage):
        feature.model_stage(args, state)
    return state


def callbacks(args: Any) -> list[Any]:
    return list(chain.from_iterable(f.callbacks(args) for f in _registry()))


def train_results(args: Any, examples: int, *, warn: bool = False) -> dict:
    return dict(chain.from_iterable(f.train_results(args, examples, warn=warn).items() for f in _registry()))


def finished(args: Any, trainer: Any) -> dict:
    return dict(chain.from_iterable(f.finished(args, trainer).items() for f in _registry()))


def setup_rows(args: Any) -> list[tuple[str, str]]:
    """The results table's rows the features describe: one per row title, the first feature on that row that is
    on (DKM or k-bit share "quantization"), else the row's text when off."""
    rows: dict[str, str | None] = {}
    off: dict[str, str] = {}
    for feature in _registry():
        if feature.row is None:
            continue
        off.setdefault(feature.row, feature.row_when_off)
        if rows.get(feature.row) is None:
            rows[feature.row] = feature.describe(args)
    return [(row, text if text is not None else off[row]) for row, text in rows.items()]
