"""Target-module diagnostics shared by hf_llmkit's tuners.

peft only raises when *no* module matched, and its message does not say what the model calls its modules. These
checks run before injection and fail with a `ValueError` that lists the closest module names (difflib), so a typo
like `o_porj` is caught even when another entry of the list matched.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator

from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn


def visible_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`model.named_modules()` without the insides of peft's wrappers, which are listed themselves.

    A tuner layer hides its `base_layer` and adapter modules; a `modules_to_save` wrapper (`ModulesToSaveWrapper`,
    any `AuxiliaryTrainingWrapper`) hides its `original_module` and its per-adapter copies, which are plain modules
    (no `get_base_layer`) that no adapter may target. Code that picks modules to adapt walks this, not
    `named_modules()`, so a second adapter never lands inside the first one's wrappers.
    """
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(w + ".") for w in wrapped):
            continue
        if name and isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            wrapped.append(name)
        yield name, module


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a tuner layer wraps, or `module` itself (a plain module, or a `modules_to_save` wrapper)."""
    return module.get_base_layer() if isinstance(module, BaseTunerLayer) else module


def module_names(model: nn.Module) -> list[str]:
    """Names of the model's modules, with peft's wrappers seen through (`visible_modules`)."""
    return [name for name, _ in visible_modules(model) if name]


def suffixes(names: list[str], depth: int = 3) -> list[str]:
    """Every dotted suffix of up to `depth` components (`o_proj`, `self_attn.o_proj`, ...), sorted."""
    out = set()
    for name in names:
        parts = name.split(".")
        for k in range(1, min(depth, len(parts)) + 1):
            out.add(".".join(parts[-k:]))
    return sorted(out)


def close_candidates(entry: str, names: list[str], n: int = 5) -> list[str]:
    """Module-name suffixes closest to `entry`; falls back to a few leaf names when nothing is close."""
    pool = [s for s in suffixes(names) if not s[0].isdigit()]
    close = difflib.get_close_matches(entry, pool, n=n, cutoff=0.5)
    if close:
        return close
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names if not n.rsplit(".", 1)[-1].isdigit()})
    return leaves[:n]


def entry_matches(entry: str, name: str) -> bool:
    return name == entry or name.endswith("." + entry)


def check_targets_exist(model: nn.Module, target_modules: str | list[str] | set[str] | None, method: str) -> None:
    """Raise a ValueError naming close candidates when `target_modules` (or one of its entries) matches no module."""
    if target_modules is None or target_modules in ("all-linear", ["all-linear"], {"all-linear"}):
        return
    names = module_names(model)
    if isinstance(target_modules, str):
        if not any(re.fullmatch(target_modules, n) for n in names):
            examples = ", ".join(names[-3:])
            raise ValueError(
                f"{method}: the regex target_modules={target_modules!r} matches no module name (it must match the "
                f"full name, e.g. one of: {examples}). Fix the pattern or pass a list of name suffixes."
            )
        return
    missing = [e for e in sorted(target_modules) if not any(entry_matches(e, n) for n in names)]
    if missing:
        hints = "; ".join(f"{e!r} -> did you mean {close_candidates(e, names)}?" for e in missing)
        raise ValueError(
            f"{method}: target_modules entries match no module of the model: {hints} "
            "Fix or remove these entries in target_modules."
        )
