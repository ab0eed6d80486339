"""Keep data-parallel training intact when `evaluate()` runs before `train()`.

`Trainer.evaluate` prepares the model with `accelerator.prepare_model(..., evaluation_mode=True)`, which marks it
prepared without wrapping it in DistributedDataParallel. accelerate refuses to prepare a marked model twice, so a
later `train()` on several ranks gets the bare model: gradients are never all-reduced and each rank silently trains
its own copy (transformers 5.23 + accelerate 1.15; e.g. "perplexity before training" in a pre-training script).
Undoing the evaluation-only preparation (`hf_llmkit.compat.accelerate`) lets `train()` wrap the model as usual.
"""

from __future__ import annotations

from accelerate.utils import DistributedType

from hf_llmkit.compat.accelerate import forget_prepared_model, is_prepared


def forget_evaluation_preparation(trainer) -> None:
    """Before `train()`: drop accelerate's mark from a model that only `evaluate()` prepared (multi-rank runs)."""
    model, accelerator = trainer.model, trainer.accelerator
    evaluated_only = trainer.model_wrapped is model and is_prepared(model)
    if not evaluated_only or accelerator.distributed_type == DistributedType.NO or trainer.is_deepspeed_enabled:
        return
    forget_prepared_model(accelerator, model)
