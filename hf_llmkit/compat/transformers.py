"""transformers internals hf_llmkit relies on (checked against transformers 5.23.0).

`LLMKitTrainer` overrides three private `Trainer` methods; each is needed because no public hook runs at that point:

- `_save_checkpoint(model, trial)`: the only place that runs before a checkpoint's first byte and after its last.
  hf_llmkit marks the folder as being written, holds off the Trainer's own `save_total_limit` rotation (which runs
  at the end of this method, before the checkpoint is complete, and counts incomplete folders), retries transient
  I/O errors on every rank together, turns disk-full / permission errors into one line, and writes the run record.
- `_load_from_checkpoint(resume_from_checkpoint, model=None)`: resume loads exactly the adapters a PEFT model has
  (the Trainer loads every adapter subfolder as one more adapter) and the hub-layout experts of MoE models.
- `_load_best_model()`: the best checkpoint is verified before it is loaded, and MoE experts are converted.
- `_clip_grad_norm(model)`: under expert parallelism (DDP) the clipping norm covers the experts of every rank.

Expert parallelism also calls `Trainer._save(output_dir, state_dict)` to write the gathered full model the way a
normal save would (safetensors, config, tokenizer, training arguments).

It also relies on `_save_checkpoint` reading `args.save_total_limit` for its rotation (held off as above), and on
`save_model(output_dir, _internal_call)`, whose private flag tells a checkpoint's model save from a final one.
`tests/compat/test_transformers.py` fails when any of these is gone or changed its parameters.
"""

from __future__ import annotations

import inspect

CHECKED_AGAINST = "5.23.0"

# Private Trainer methods LLMKitTrainer overrides -> the parameters (after self) it relies on.
TRAINER_PRIVATE_HOOKS: dict[str, tuple[str, ...]] = {
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_best_model": (),
    "_clip_grad_norm": ("model",),
}
# Private Trainer methods hf_llmkit calls -> the parameters it passes.
TRAINER_PRIVATE_CALLS: dict[str, tuple[str, ...]] = {"_save": ("output_dir", "state_dict")}
# Public Trainer methods whose private parameters LLMKitTrainer reads.
TRAINER_PRIVATE_PARAMETERS: dict[str, tuple[str, ...]] = {"save_model": ("output_dir", "_internal_call")}

__all__ = [
    "CHECKED_AGAINST",
    "TRAINER_PRIVATE_CALLS",
    "TRAINER_PRIVATE_HOOKS",
    "TRAINER_PRIVATE_PARAMETERS",
    "missing_trainer_internals",
]


def missing_trainer_internals() -> list[str]:
    """What the installed `transformers.Trainer` lacks of the above (empty when everything is there)."""
    from transformers import Trainer

    missing = []
    for table in (TRAINER_PRIVATE_HOOKS, TRAINER_PRIVATE_CALLS, TRAINER_PRIVATE_PARAMETERS):
        for name, expected in table.items():
            method = getattr(Trainer, name, None)
            if method is None:
                missing.append(f"Trainer.{name}")
                continue
            parameters = tuple(inspect.signature(method).parameters)[1:]
            if parameters[: len(expected)] != expected:
                missing.append(f"Trainer.{name}{expected} (found {parameters})")
    if "save_total_limit" not in inspect.getsource(Trainer._save_checkpoint):
        missing.append("Trainer._save_checkpoint no longer rotates by args.save_total_limit")
    return missing
