"""Checks of the folders a training command reads and writes, before any work starts.

Each raises `ValueError` with one sentence that names the flag and the fix:

- `check_writable_folder`: an output or cache folder must be a folder (or creatable) and writable; probed by
  writing a file, since permission bits say nothing for root or on read-only mounts. Nothing is left behind.
- `check_model_folder`: a local model folder with a `config.json` that parses and readable weights.
- `check_tokenizer_folder`: a local tokenizer folder.
- `check_checkpoint_folder`: a Trainer checkpoint (`trainer_state.json` that parses).
- `check_json_file`: a configuration file (a DeepSpeed config, say) that exists and holds a JSON object.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from hf_llmkit.checkpoints.names import TRAINER_STATE, list_checkpoints, path_too_long, shown_path

__all__ = [
    "check_checkpoint_folder",
    "check_json_file",
    "check_model_folder",
    "check_tokenizer_folder",
    "check_writable_folder",
]

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def check_writable_folder(path: str | os.PathLike, *, flag: str) -> None:
    """`path` is a writable folder, or one that can be created (the probe creates nothing that stays)."""
    folder = Path(path)
    too_long = path_too_long(folder)
    if too_long:
        raise ValueError(f"{flag} {shown_path(path)} {too_long}; pass a shorter path")
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        where = "is a file" if existing == folder else f"is inside {existing}, which is a file"
        raise ValueError(f"{flag} {path} {where}; pass a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".hf_llmkit-write-probe-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ValueError(
            f"{flag} {path} is not writable ({reason} in {existing}); pass a folder you can write to"
        ) from None


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is corrupt ({err}); restore it or pass another folder") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} holds a JSON {type(data).__name__}, not an object; restore it")
    return data


def _existing_folder(path: str | os.PathLike, *, flag: str, fix: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise ValueError(f"{flag} {path} {what}; {fix}")
    return folder


def _check_safetensors_header(path: Path, flag: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as err:  # safetensors raises its own SafetensorError for truncated or garbled headers
        raise ValueError(f"{flag}: {path} is not a readable safetensors file ({err}); restore it") from None


def check_model_folder(path: str | os.PathLike, *, flag: str = "--model_name_or_path") -> None:
    """A local model folder: `config.json` (a JSON object naming its `model_type`) and weights that open."""
    folder = _existing_folder(path, flag=flag, fix="pass a local model folder (models are not downloaded)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{flag} {path} has no config.json; pass the folder save_pretrained() wrote")
    config = _read_json(config_file, f"{flag}:")
    if "model_type" not in config:
        raise ValueError(f"{flag}: {config_file} names no model_type; it is not a transformers model config")
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    shards = sorted(folder.glob("*.safetensors"))
    if not present and not shards:
        raise ValueError(
            f"{flag} {path} has a config.json but no weights ({', '.join(WEIGHT_FILES[:3])}); "
            "pass the folder save_pretrained() wrote"
        )
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index_name in present:
            weight_map = _read_json(folder / index_name, f"{flag}:").get("weight_map", {})
            missing = sorted({name for name in weight_map.values() if not (folder / name).is_file()})
            if missing:
                raise ValueError(f"{flag} {path}: {index_name} lists missing shard(s) {', '.join(missing[:3])}")
    for shard in shards:
        _check_safetensors_header(shard, flag)


def check_tokenizer_folder(path: str | os.PathLike, *, flag: str = "--tokenizer_name_or_path") -> None:
    """A local tokenizer folder (tokenizer.json, tokenizer_config.json, vocab files...)."""
    folder = _existing_folder(path, flag=flag, fix="pass a local tokenizer folder (tokenizers are not downloaded)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{flag} {path} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    if (folder / "tokenizer_config.json").is_file():
        _read_json(folder / "tokenizer_config.json", f"{flag}:")


def check_checkpoint_folder(path: str | os.PathLike, *, flag: str = "--resume_from_checkpoint") -> None:
    """A Trainer checkpoint folder (`checkpoint-N` with a `trainer_state.json` that parses)."""
    folder = _existing_folder(path, flag=flag, fix="pass a checkpoint-N folder of an earlier run")
    state = folder / TRAINER_STATE
    if not state.is_file():
        inside = [p.name for p in list_checkpoints(folder)]
        hint = f" (it holds {inside[-1]}: pass that)" if inside else ""
        raise ValueError(f"{flag} {path} is not a checkpoint: no trainer_state.json{hint}")
    _read_json(state, f"{flag}:")


def check_json_file(path: str | os.PathLike, *, flag: str) -> None:
    """A file holding one JSON object (e.g. `--deepspeed ds_config.json`)."""
    file = Path(path)
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise ValueError(f"{flag} {path} {what}; pass a JSON config file")
    _read_json(file, f"{flag}:")
