"""Which output folder a main job's run uses, decided from its flags before any work (issue 33).

A run's identity, as flags, is every flag that shapes its checkpoints: the model, data, PEFT, quantization and MoE
flags (except those that only say how to run, what to evaluate or what to write after training: `FREE`), the
training flags the checkpoint's run record compares (`hf_llmkit.trainers.run_identity`: seed, batch geometry,
optimizer), the sequence-parallel size, the number of ranks and the job. The main process writes it to
`output_dir/llmkit_flags.json` once nothing can refuse the run any more (`FlagRecord`: when training begins, after
the checkpoint's run record accepted a resume; before the evaluation of a run that does not train), so a refused run
leaves the folder's record as it was. A folder *holds a run* when it has a checkpoint or results files; only then
does its record count.

- A default output folder (no `--output_dir`) belongs to one identity: the run takes the first of `root`, `root-2`,
  `root-3`, ... that holds its own run (it resumes) or no run, and says in one line when that is not `root`. A
  folder holding a run without a record (deleted, or written before records existed) is another run's: its flags
  cannot be compared, and taking it would replace a finished run's model and results.
- An explicit `--output_dir` holding a run of another identity is refused before any work, in one line naming the
  flags that differ (`--seed: 42 -> 7`) and the fixes (as the checkpoint's run record does, which still checks what
  flags cannot see, such as edited data files). One holding a run without a record is left to the checkpoint's run
  record when it has a checkpoint, and refused when it holds only a finished run's results (nothing could tell
  whether this run is that one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_llmkit.checkpoints.names import CHECKPOINT_PREFIX

__all__ = [
    "FLAG_RECORD",
    "FlagRecord",
    "FREE",
    "choose_default_folder",
    "flag_identity",
    "holds_run",
    "settle_output_dir",
    "write_flag_record",
]

logger = logging.getLogger(__name__)

FLAG_RECORD = "llmkit_flags.json"
# Flags of the feature groups that do not shape a checkpoint: how to run, what to evaluate, and what to write once
# training is over (`--merge_adapter`: re-running a finished adapter run with it merges the final adapter, no step).
FREE = frozenset(
    {"torch_dtype", "attn_implementation", "data_cache_dir", "preprocessing_num_workers", "max_eval_samples",
     "merge_adapter"}
)  # fmt: skip
# Training flags that shape a checkpoint (the run record's "training" section, `run_identity._TRAINING`).
TRAINING = ("seed", "data_seed", "per_device_train_batch_size", "gradient_accumulation_steps", "optim",
            "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "sequence_parallel_size")  # fmt: skip
RESULT_FILES = ("all_results.json", "train_results.json")
_PATHS = ("model_name_or_path", "tokenizer_name_or_path", "dataset_dir", "train_file", "validation_file",
          "teacher_model_name_or_path")  # fmt: skip
_MAX_FOLDERS = 100
# What a folder holding a run without a flag record shows in place of the flags that differ.
UNRECORDED = f"its flags are not recorded: no {FLAG_RECORD}"


def _plain(value: Any) -> Any:
    enum_value = getattr(value, "value", None)
    value = enum_value if isinstance(enum_value, str) else value
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def flag_identity(args, prog: str) -> dict[str, Any]:
    """The flags (by field name) that make `args` this run; `prog` is the job ("run_clm.py")."""
    identity: dict[str, Any] = {"job": prog, "ranks": int(os.environ.get("WORLD_SIZE", "1"))}
    from hf_llmkit.cli import features

    parts = [args.features[f.name] for f in features.FEATURES if f.in_run_identity and f.arguments is not None]
    for part in (args.model, args.data, *parts):
        for f in dataclasses.fields(part):
            if f.init and f.name not in FREE:
                value = getattr(part, f.name)
                if f.name in _PATHS and isinstance(value, str):
                    value = os.path.normpath(value)
                identity[f.name] = _plain(value)
    for name in TRAINING:
        identity[name] = _plain(getattr(args.training, name, None))
    return identity


def holds_run(folder: str | os.PathLike) -> bool:
    """Whether `folder` has a checkpoint or a finished run's results."""
    path = Path(folder)
    if not path.is_dir():
        return False
    return any(path.glob(f"{CHECKPOINT_PREFIX}-*")) or any((path / name).is_file() for name in RESULT_FILES)


def recorded_identity(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The flag record of the run `folder` holds: None when it holds no run, an empty dict when it holds one whose
    record is missing or unreadable (deleted, or a run from before flag records)."""
    if not holds_run(folder):
        return None
    try:
        recorded = json.loads((Path(folder) / FLAG_RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) and recorded else {}


def _shown(value: Any) -> str:
    text = "none" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def flag_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`--flag: recorded -> current` for each flag both records have that differs (`job`, `ranks` as such)."""
    changed = []
    for name in [n for n in current if n in recorded]:
        old, new = recorded[name], current[name]
        if old != new:
            label = name if name in ("job", "ranks") else f"--{name}"
            changed.append(f"{label}: {_shown(old)} -> {_shown(new)}")
    return changed


def _summary(changed: list[str]) -> str:
    return "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")


def _numbered(base: str, n: int) -> str:
    return base if n == 1 else f"{base}-{n}"


def _agreed(n: int, training) -> int:
    """The largest of every rank's folder number (ranks on machines with disks of their own may see different
    folders: they agree on one); `n` itself without a process group."""
    import torch
    import torch.distributed as dist

    from hf_llmkit.checkpoints.collectives import world_size

    if world_size() == 1:
        return n
    value = torch.tensor([n], dtype=torch.int64, device=training.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def choose_default_folder(base: str, identity: dict[str, Any]) -> tuple[str, list[str]]:
    """The first of `base`, `base-2`, ... that holds this identity's run or no run; and what differs from the run
    in `base` when that is not the one (empty otherwise). A folder holding a run without a record holds another
    run (`UNRECORDED`)."""
    first: list[str] = []
    for n in range(1, _MAX_FOLDERS + 1):
        folder = _numbered(base, n)
        recorded = recorded_identity(folder)
        if recorded is None:
            return folder, first
        changed = flag_differences(recorded, identity) if recorded else [UNRECORDED]
        if not changed:
            return folder, first
        if n == 1:
            first = changed
    raise ValueError(f"{base} and {base}-2 .. -{_MAX_FOLDERS} hold other runs; pass --output_dir")


def settle_output_dir(args, prog: str) -> None:
    """Pick the default output folder of this run, or refuse an explicit `--output_dir` holding another run;
    before any work. Sets `args.training.output_dir` and says in one line when the default folder moved."""
    training = args.training
    identity = flag_identity(args, prog)
    if "output_dir" not in args.given:
        base = training.output_dir
        folder, changed = choose_default_folder(base, identity)
        folder = _numbered(base, _agreed(1 if folder == base else int(folder.rsplit("-", 1)[1]), training))
        if folder != base:
            training.output_dir = folder
            if training.should_log:
                logger.warning(
                    "%s holds a different run (%s): this run uses %s (--output_dir chooses)",
                    base,
                    _summary(changed),
                    folder,
                )
        return
    recorded = None if args.run.overwrite_output_dir else recorded_identity(training.output_dir)
    if recorded == {} and not any(Path(training.output_dir).glob(f"{CHECKPOINT_PREFIX}-*")):
        raise ValueError(
            f"--output_dir {training.output_dir} holds a finished run whose flags are not recorded (no {FLAG_RECORD}),"
            " so this run would replace its model and results; pass another --output_dir, or --overwrite_output_dir "
            "true to start over there"
        )
    changed = flag_differences(recorded, identity) if recorded else []
    if changed:
        raise ValueError(
            f"--output_dir {training.output_dir} holds a different run ({_summary(changed)}); rerun with the recorded "
            "values, pass another --output_dir for this run, or --overwrite_output_dir true to start over there"
        )


class FlagRecord(TrainerCallback):
    """Writes the run's flag record when training begins (after a resume was accepted), or ends without beginning
    (a run resumed at its last step)."""

    def __init__(self, args, prog: str) -> None:
        self.args, self.prog, self.written = args, prog, False

    def write(self) -> None:
        if not self.written:
            write_flag_record(self.args, self.prog)
            self.written = True

    def on_train_begin(self, args, state, control, **kwargs):
        self.write()

    def on_train_end(self, args, state, control, **kwargs):
        self.write()


def write_flag_record(args, prog: str) -> None:
    """Record this run's identity in its output folder (once the folder is held; the main process of each machine,
    whose disk may be its own)."""
    if args.training.local_process_index != 0:
        return
    folder = Path(args.training.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f"{FLAG_RECORD}.{socket.gethostname()}-{os.getpid()}.tmp"
    temporary.write_text(json.dumps(flag_identity(args, prog), indent=1, sort_keys=True), encoding="utf-8")
    os.replace(temporary, folder / FLAG_RECORD)
