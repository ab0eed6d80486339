"""Keep data-parallel training intact when `evaluate()` runs before `train()`.

`Trainer.evaluate` prepares the model with `accelerator.prepare_model(..., evaluation_mode=True)`, which marks it
`_is_accelerate_prepared` without wrapping it in DistributedDataParallel. accelerate refuses to prepare a marked
model twice, so a later `train()` on several ranks gets the bare model: gradients are never all-reduced and each
rank silently trains its own copy (transformers 5.23 + accelerate 1.15; e.g. "perplexity before training" in a
pre-training script). Undoing the evaluation-only mark lets `train()` wrap the model as usual.
"""

from __future__ import annotations

from accelerate.utils import DistributedType


def forget_evaluation_preparation(trainer) -> None:
    """Before `train()`: drop accelerate's mark from a model that only `evaluate()` prepared (multi-rank runs)."""
    model, accelerator = trainer.model, trainer.accelerator
    evaluated_only = trainer.model_wrapped is model and getattr(model, "_is_accelerate_prepared", False)
    if not evaluated_only or accelerator.distributed_type == DistributedType.NO or trainer.is_deepspeed_enabled:
        return
    del model._is_accelerate_prepared
    accelerator._models[:] = [m for m in accelerator._models if m is not model]
