"""What a DKM checkpoint holds, read from its safetensors headers before any weight is (`read_layout`, which
`DKMHfQuantizer` calls before the module swap of `integration.py`).

- the tensor names of each clustered layer: the packed export (`weight_packed` + `weight_lut`) and the training state
  (`weight` + `centroids`), each with the block scales when the config has `scale_block_size`;
- `checkpoint_layout`: every clustered layer has one complete representation (the one it then loads), and no DKM
  tensor belongs to a module the config keeps in full precision (an edited `modules_to_not_convert` would otherwise
  load a freshly initialised layer);
- `check_table_dtypes`: lookup tables and block scales are saved in the config's `lut_dtype`.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open
from torch import nn

from hf_llmkit.compat.transformers import ignore_unexpected_keys
from hf_llmkit.quantization import steps
from hf_llmkit.quantization.config import DKMConfig

PACKED_NAMES = ("weight_packed", "weight_lut")
TRAINING_NAMES = ("weight", "centroids")
# with DKMConfig.scale_block_size: the block scales, packed and in the training state
SCALE_NAMES = {"packed": "weight_scale", "train": "scales"}
LOADED_NAMES = (*PACKED_NAMES, SCALE_NAMES["packed"])  # the tensors packed layers load

STAND_IN_DTYPE = "U8"  # `integration.stand_in_weight`'s safetensors dtype: a `weight` saved so is no dense one
# A one-byte tensor of every checkpoint with a stand-in weight, named after what a load without hf_llmkit needs:
# transformers then skips the unknown "dkm" method, fails on the stand-in weights, and lists this key as unexpected.
IMPORT_MARKER = "import_hf_llmkit_to_load_this_dkm_checkpoint"


def checkpoint_keys(checkpoint_files: list[str] | None) -> dict[str, str] | None:
    """Tensor names of safetensors checkpoint files and their dtypes ("F32", "F16", ...; headers only), or None when
    they cannot be read that way."""
    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return None
    keys: dict[str, str] = {}
    for file in checkpoint_files:
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            keys.update((k, f.get_slice(k).get_dtype()) for k in names)
    return keys


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_SAFETENSORS_NAMES = {"F64": "float64", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                      "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # fmt: skip


def _plain(key: str, prefix: str) -> str:
    """A checkpoint key without the base model's prefix (checkpoints may carry it or not)."""
    return key[len(prefix) + 1 :] if prefix and key.startswith(f"{prefix}.") else key


def _clustered_scale(name: str, target_set: set[str]) -> bool:
    """Whether a checkpoint key (without the base model's prefix) is block scales of a clustered module, packed or
    in the training state: another module may well have tensors named so."""
    module, _, tensor = name.rpartition(".")
    return tensor in SCALE_NAMES.values() and module in target_set


def check_table_dtypes(keys: dict[str, str], lut_dtype: str, targets: list[str], prefix: str = "") -> None:
    """Saved lookup tables (and the block scales of the clustered modules `targets`; another module may have tensors
    named so) must have the config's `lut_dtype`: loading them into another would round them, and the reloaded
    model would no longer compute what the trained one did."""
    want = _SAFETENSORS_DTYPES[lut_dtype]
    target_set = {_plain(t, prefix) for t in targets}
    for key, dtype in sorted(keys.items()):
        table = key.endswith(".weight_lut")
        packed_scale = key.endswith(f".{SCALE_NAMES['packed']}") and _clustered_scale(_plain(key, prefix), target_set)
        if (table or packed_scale) and dtype != want:
            found = next((name for name, code in _SAFETENSORS_DTYPES.items() if code == dtype), None)
            if found is None:  # no lut_dtype could load it
                raise ValueError(
                    f"{key!r} is saved as {_SAFETENSORS_NAMES.get(dtype, dtype)}, which is no lookup-table dtype "
                    f"({', '.join(_SAFETENSORS_DTYPES)}): the checkpoint was not written by DKM's save_pretrained; "
                    "save it again from the trained model"
                )
            raise ValueError(
                f"{key!r} is saved as {found} but quantization_config.lut_dtype is {lut_dtype!r}: set lut_dtype to "
                f"{found!r} in config.json (the tables would otherwise be rounded on load)."
            )


def checkpoint_layout(
    keys: set[str], targets: list[str], prefix: str = "", scaled: bool = False
) -> tuple[dict[str, str], list[str]]:
    """(`{module: "train" | "packed"}`, key patterns to ignore) from a DKM checkpoint's tensor names.

    A module loads its training state when the checkpoint has it, else its packed export; the other representation
    is expected in the file (the patterns). `scaled`: the config has block scales, which both representations then
    hold (and only then). Any inconsistency is a ValueError naming the tensor or module.
    """
    names = {_plain(k, prefix) for k in keys}
    target_set = {_plain(t, prefix) for t in targets}
    scale_keys = sorted(k for k in names if _clustered_scale(k, target_set))
    if scale_keys and not scaled:
        raise ValueError(
            f"The checkpoint holds DKM block scales ({scale_keys[0]!r}) but its quantization_config has no "
            "scale_block_size: set scale_block_size in config.json to the block size it was trained with."
        )
    packed_names = (*PACKED_NAMES, SCALE_NAMES["packed"]) if scaled else PACKED_NAMES
    training_names = (*TRAINING_NAMES, SCALE_NAMES["train"]) if scaled else TRAINING_NAMES
    layout, patterns = {}, []
    for target in targets:
        t = _plain(target, prefix)

        def has(*suffixes: str, t=t) -> bool:
            return all(f"{t}.{s}" in names for s in suffixes)

        if has(*training_names):
            layout[target], unused = "train", packed_names
        elif has(*packed_names):
            layout[target], unused = "packed", training_names
        elif any(has(n) for n in packed_names) or has(*TRAINING_NAMES):
            found = packed_names if any(has(n) for n in packed_names) else training_names
            missing = next(n for n in found if not has(n))
            if missing in SCALE_NAMES.values():
                raise ValueError(
                    f"The DKM checkpoint has no '{target}.{missing}' but its quantization_config sets "
                    "scale_block_size: set it to 0 in config.json if the checkpoint was saved without block scales."
                )
            raise ValueError(
                f"The DKM checkpoint has no '{target}.{missing}' (needed for {target!r}): it is incomplete."
            )
        elif has("weight"):
            raise ValueError(
                f"The checkpoint stores {target!r} in full precision ('{target}.weight') but its quantization_config "
                f"clusters it: config.json's modules_to_not_convert no longer matches the weights. Add {target!r} to "
                "quantization_config.modules_to_not_convert."
            )
        else:
            raise ValueError(f"The DKM checkpoint has no tensors for {target!r} (expected '{target}.weight_packed').")
        # The representation a layer does not load from is part of the checkpoint, not an unexpected key; so is the
        # optimizer step's state (read by a Trainer resume through load_state_dict, see steps.py).
        patterns.append(rf"(^|\.){re.escape(t)}\.({'|'.join(unused + steps.STEP_NAMES)})$")
    stray = sorted({k.rpartition(".")[0] for k in keys if k.rpartition(".")[2] in PACKED_NAMES + ("centroids",)})
    stray = [k for k in stray if _plain(k, prefix) not in target_set]
    if stray:
        more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
        raise ValueError(
            f"The checkpoint holds DKM tensors for {stray[0]!r}{more}, but quantization_config.modules_to_not_convert "
            f"keeps it in full precision, so it would load with freshly initialised weights. Remove {stray[0]!r} from "
            "modules_to_not_convert in config.json."
        )
    return layout, patterns


def read_layout(model: nn.Module, checkpoint_files, targets: list[str], config: DKMConfig) -> dict[str, str] | None:
    """Per-module layout of the checkpoint files being loaded into `model` (None when their tensor names cannot be
    read up front, e.g. .bin files); the unused representation is registered as expected; tables and scales are
    checked to be saved in the config's `lut_dtype`."""
    keys = checkpoint_keys([str(Path(f)) for f in checkpoint_files] if checkpoint_files else None)
    if keys is None:
        return None
    prefix, scaled = getattr(model, "base_model_prefix", ""), bool(config.scale_block_size)
    check_table_dtypes(keys, config.lut_dtype, targets, prefix)
    names = {k for k, dtype in keys.items() if not (k.endswith(".weight") and dtype == STAND_IN_DTYPE)}
    layout, patterns = checkpoint_layout(names - {IMPORT_MARKER}, targets, prefix, scaled)
    ignore_unexpected_keys(model, [*patterns, f"^{IMPORT_MARKER}$"])
    return layout
