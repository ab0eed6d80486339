"""Which run a checkpoint belongs to, so that resuming into a different run stops before any work.

Every checkpoint `LLMKitTrainer` writes holds `llmkit_run.json`: the model's architecture and sizes (its config,
without dtype / attention implementation / version fields), the PEFT method and its config, the quantization
config, the MoE settings (part of the config), whether the loss is distillation from a teacher model, the
parameters' names and shapes, the sequence-parallel size, the
training data (number of samples and a digest of a few evenly spread samples: the files, block size, split and
sample limits all show there), the seed, the number of ranks and the batch geometry (per-device batch size,
gradient accumulation), and the optimizer's type and settings other than the learning rate (they live in
`optimizer.pt`). Resuming compares it with the current run: any difference ends with one line naming only what
differs and the fix (the recorded values, another `--output_dir`, or `--overwrite_output_dir true` to start over).
A different number of ranks is refused because the data order could not continue: each rank's sampler position
and RNG state belong to its rank.

What a user may change between the runs of one job (learning rate, length, schedule, logging, save cadence,
clipping) is recorded too, under `settings`, and is not refused: the resumed run says in one line what changed and
applies it (`hf_llmkit.trainers.changed_settings`). A checkpoint without the file (a plain `Trainer`, an older
version) is resumed without the check; a record from an older version is compared on the sections it has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.checkpoints.names import RUN_RECORD
from hf_llmkit.checkpoints.transaction import register_contributor
from hf_llmkit.trainers.changed_settings import changed_settings, describe_changes, recorded_settings

logger = logging.getLogger(__name__)

__all__ = ["RUN_IDENTITY_FILE", "check_length", "check_run_identity", "run_identity", "write_run_identity"]

RUN_IDENTITY_FILE = RUN_RECORD
# The run record is a part of every checkpoint LLMKitTrainer writes (hf_llmkit.checkpoints.transaction).
RUN_IDENTITY_PART = register_contributor("run identity", files=(RUN_RECORD,), writer=__name__).name
FORMAT = 1
# Config fields that describe how a model runs, not which model it is (private "_" keys are dropped too).
_VOLATILE = {
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "_commit_hash",
    "torch_dtype",
    "dtype",
    "use_cache",
    "attn_implementation",
    "_experts_implementation",
    "experts_implementation",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "quantization_config",  # recorded on its own
}
_PEFT_VOLATILE = {"base_model_name_or_path", "revision", "inference_mode"}
_DATA_SAMPLES = 8
# most telling first
_ORDER = ("model", "peft", "quantization", "distillation", "sequence_parallel_size", "training", "data", "parameters")
# TrainingArguments fields that shape the checkpoint (refused when changed); "ranks" is the world size.
_TRAINING = (
    "seed",
    "data_seed",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "optim",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
)
_NOT_COMPARED = {"format", "settings"}


def _plain(value: Any) -> Any:
    """`value` as plain JSON data (sets sorted, enums and other objects as strings)."""
    return json.loads(json.dumps(value, default=_default, sort_keys=True))


def _default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    enum_value = getattr(value, "value", None)
    return enum_value if isinstance(enum_value, str) else str(value)


def _full_shape(tensor, experts: dict[int, int]) -> tuple[int, ...]:
    """The whole tensor's shape: ZeRO-3 partitions report `ds_shape`; an expert-parallel shard holds `count` of
    `total` experts along dim 0 (checkpoints hold every expert, so a run resumes under any expert-parallel size)."""
    shape = tuple(getattr(tensor, "ds_shape", tensor.shape))
    return (experts[id(tensor)], *shape[1:]) if id(tensor) in experts else shape


def _parameters(model) -> dict:
    """Parameter count and a digest of every parameter / buffer name and shape (any structural change shows here)."""
    from hf_llmkit.parallel.moe.expert_parallel import expert_shards

    experts = {id(shard.param): shard.total for shard in expert_shards(model).values()}
    digest, count = hashlib.sha256(), 0
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(f"{name}:{_full_shape(tensor, experts)};".encode())
    for param in model.parameters():
        count += math.prod(_full_shape(param, experts))
    return {"count": count, "layout": digest.hexdigest()[:16]}


def _config_dict(config) -> dict:
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {k: v for k, v in raw.items() if k not in _VOLATILE and not k.startswith("_")}


def _peft_configs(model) -> dict | None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    return {name: {k: v for k, v in cfg.to_dict().items() if k not in _PEFT_VOLATILE} for name, cfg in configs.items()}


def _base_config(model):
    for candidate in (model, getattr(model, "get_base_model", lambda: None)()):
        if candidate is not None and getattr(candidate, "config", None) is not None:
            return candidate.config
    return None


def _data_identity(dataset) -> dict | None:
    """Length and a digest of a few evenly spread samples (cheap; deterministic for the same data)."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return None
    n = len(dataset)
    digest = hashlib.sha256()
    for index in sorted({round(i * (n - 1) / max(_DATA_SAMPLES - 1, 1)) for i in range(_DATA_SAMPLES)} if n else ()):
        sample = dataset[index]
        items = sample.items() if isinstance(sample, dict) else [("", sample)]
        for key, value in sorted(items, key=lambda kv: str(kv[0])):
            value = value.tolist() if hasattr(value, "tolist") else value
            digest.update(json.dumps([str(key), value], default=str).encode())
    return {"samples": n, "digest": digest.hexdigest()[:16]}


def _training(args) -> dict:
    return {"ranks": args.world_size, **{name: getattr(args, name, None) for name in _TRAINING}}


def run_identity(trainer) -> dict:
    """What makes this trainer's run this run (see the module docstring)."""
    model = trainer.model
    config = _base_config(model)
    quantization = getattr(config, "quantization_config", None) if config is not None else None
    if quantization is not None and hasattr(quantization, "to_dict"):
        quantization = quantization.to_dict()
    return _plain(
        {
            "format": FORMAT,
            "model": _config_dict(config) if config is not None else type(model).__name__,
            "peft": _peft_configs(model),
            "quantization": quantization,
            "distillation": getattr(trainer, "_distillation", None) is not None,  # the loss: KL from a teacher
            "sequence_parallel_size": getattr(trainer.args, "sequence_parallel_size", 1),
            "training": _training(trainer.args),
            "data": _data_identity(trainer.train_dataset),
            "parameters": _parameters(model),
            "settings": recorded_settings(trainer.args),
        }
    )


def write_run_identity(identity: dict, folder: str | os.PathLike) -> None:
    path = Path(folder) / RUN_IDENTITY_FILE
    path.write_text(json.dumps(identity, indent=1, sort_keys=True), encoding="utf-8")


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}"))
        return flat
    return {prefix: value}


def _short(value: Any) -> str:
    if isinstance(value, dict) and value and all(isinstance(v, dict) and "peft_type" in v for v in value.values()):
        return ", ".join(f"{name}={config['peft_type']}" for name, config in value.items())  # PEFT adapters
    text = "none" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def differences(recorded: dict, current: dict) -> list[str]:
    """`field: recorded -> current` for every field that really differs, most telling first (nested fields dotted;
    the training section's fields by their argument names). Sections an older record lacks are not compared; the
    parameter digest, which follows from the rest, is named only when nothing else differs."""
    changed, digest_changed = [], False
    keys = [k for k in _ORDER if k in current and k in recorded]
    keys += sorted((set(current) & set(recorded)) - set(keys) - _NOT_COMPARED)
    for key in keys:
        old, new = recorded.get(key), current.get(key)
        if old == new or (key == "parameters" and changed):
            continue
        if not (isinstance(old, dict) and isinstance(new, dict)):
            pairs = [(key, old, new)]
        else:
            flat_old, flat_new = _flatten(old, key), _flatten(new, key)
            pairs = [(name, flat_old.get(name), flat_new.get(name)) for name in sorted(set(flat_old) | set(flat_new))]
        for name, a, b in pairs:
            if name == "data.digest" and a != b:
                digest_changed = True
            elif a != b and _short(a) != _short(b):
                changed.append(f"{name.removeprefix('training.')}: {_short(a)} -> {_short(b)}")
    if digest_changed and not changed:  # an internal hash: named only as what it stands for, when nothing else is
        changed.append("the training samples (same count, other contents: edited data files?)")
    return changed


def check_run_identity(identity: dict, checkpoint: str | os.PathLike, output_dir: str) -> list[tuple[str, Any, Any]]:
    """Raise `ResumeError` (one line) when `checkpoint` was written by a different run; else return the settings
    this run changes (`hf_llmkit.trainers.changed_settings`), after saying so in one line."""
    path = Path(checkpoint) / RUN_IDENTITY_FILE
    if not path.is_file():
        logger.info(
            "%s has no %s (written without LLMKitTrainer): resuming without the run check", checkpoint, path.name
        )
        return []
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ResumeError(f"{path} is unreadable ({err}); resume from another checkpoint") from err
    changed = differences(recorded, identity)
    if changed:
        shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise ResumeError(
            f"{checkpoint} belongs to a different run ({shown}); resume with the recorded values, pass another "
            f"--output_dir for this run, or --overwrite_output_dir true to start over in {output_dir}"
        )
    settings = changed_settings(recorded.get("settings"), identity["settings"])
    if settings:
        logger.warning("resuming from %s with changed settings: %s", checkpoint, describe_changes(settings))
    return settings


def check_length(max_steps: int, step: int, checkpoint: str | os.PathLike, output_dir: str) -> None:
    """Raise `ResumeError` (one line) when `max_steps` ends before the `step` the checkpoint reached: the run it
    would report is not the one recorded there (a longer one may continue it; the same length finds it finished)."""
    if 0 < max_steps < step:
        raise ResumeError(
            f"--max_steps {max_steps} ends before step {step}, which {checkpoint} reached: a different run; pass "
            f"--max_steps {step} or more to resume this one, another --output_dir for this run, or "
            f"--overwrite_output_dir true to start over in {output_dir}"
        )
