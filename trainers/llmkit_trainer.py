"""`LLMKitTrainer`: the HF `Trainer`, plus the features switched on by `LLMKitTrainingArguments`.

It overrides only documented `Trainer` hooks, and each feature lives in its own module; this class only
dispatches to them, so a run with default arguments behaves exactly like `transformers.Trainer`.
"""

from __future__ import annotations

from transformers import Trainer, TrainingArguments

from hf_llmkit.callbacks.log_bridge import add_callback_logs
from hf_llmkit.callbacks.recovery import save_with_retries, train_with_recovery
from hf_llmkit.trainers.eval_preparation import forget_evaluation_preparation
from hf_llmkit.trainers.expert_parallel import TrainerExpertParallel
from hf_llmkit.trainers.moe_loss import (
    MoELossTracker,
    aux_loss_scale,
    has_moe_blocks,
    load_moe_checkpoint,
    register_zero3_leaf_modules,
)
from hf_llmkit.trainers.sequence_parallel import TrainerSequenceParallel


class LLMKitTrainer(Trainer):
    """Drop-in `transformers.Trainer`; pass `LLMKitTrainingArguments` to enable hf_llmkit's features.

    Example:
        ```python
        from hf_llmkit import LLMKitTrainingArguments
        from hf_llmkit.trainers import LLMKitTrainer

        trainer = LLMKitTrainer(model=model, args=LLMKitTrainingArguments(output_dir="out"), train_dataset=ds)
        trainer.train()
        ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, TrainingArguments):
            raise TypeError(f"LLMKitTrainer needs TrainingArguments, got {type(self.args).__name__}")
        # Mixture of experts (hf_llmkit.trainers.moe_loss): auxiliary losses + routing logs for MoELayer models.
        self._moe_loss = MoELossTracker(
            aux_loss_coef=getattr(self.args, "moe_aux_loss_coef", 0.0),
            z_loss_coef=getattr(self.args, "moe_z_loss_coef", 0.0),
        )
        if self.is_deepspeed_enabled:
            register_zero3_leaf_modules(self.model)
        # Sequence parallelism (hf_llmkit.trainers.sequence_parallel): groups, attention wrapper, batch sharding, loss.
        self._sequence_parallel = TrainerSequenceParallel.for_trainer(self)
        # Expert parallelism (hf_llmkit.trainers.expert_parallel): sharded experts, DDP reduction, clipping, saving.
        self._expert_parallel = TrainerExpertParallel.for_trainer(self)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """`Trainer.compute_loss`, plus the MoE auxiliary losses of the forward it ran (training only)."""
        if self._sequence_parallel is not None:
            result = self._sequence_parallel.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        else:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training:
            return result
        loss, outputs = result if return_outputs else (result, None)
        loss = self._moe_loss.add_aux_losses(model, loss, scale=aux_loss_scale(self, num_items_in_batch))
        return (loss, outputs) if return_outputs else loss

    def get_train_dataloader(self):
        """`Trainer.get_train_dataloader`; with sequence parallelism, batches split over data-parallel ranks only."""
        loader = super().get_train_dataloader()
        return self._sequence_parallel.shard_loader(loader) if self._sequence_parallel is not None else loader

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        return self._sequence_parallel.shard_loader(loader) if self._sequence_parallel is not None else loader

    # Expert parallelism (hf_llmkit.trainers.expert_parallel): only its DDP case needs these three hooks.
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._expert_parallel is not None:
            self._expert_parallel.attach_optimizer(optimizer)  # checkpoints hold full expert states
        return optimizer

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._expert_parallel is not None and not self.is_deepspeed_enabled:
            return self._expert_parallel.save_model(self, output_dir, _internal_call)  # gathers the experts
        return super().save_model(output_dir, _internal_call)

    def _clip_grad_norm(self, model):
        if self._expert_parallel is not None and not self.is_deepspeed_enabled:
            return self._expert_parallel.clip_grad_norm(self, model)  # the norm over all experts
        return super()._clip_grad_norm(model)

    # Fault tolerance (hf_llmkit.callbacks.recovery): a callback cannot restart the loop or re-run a save.
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """`Trainer.train`; `auto_resume` / `resume_from_checkpoint=True` pick the latest *complete* checkpoint, and a
        `FaultToleranceCallback` rollback restarts from the last good checkpoint."""
        forget_evaluation_preparation(self)  # an earlier evaluate() must not leave the model out of DDP
        return train_with_recovery(
            self, super().train, resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def _save_checkpoint(self, model, trial):
        save_with_retries(
            lambda: super(LLMKitTrainer, self)._save_checkpoint(model, trial),
            retries=getattr(self.args, "save_retries", 0),
            delay=getattr(self.args, "save_retry_delay", 1.0),
            device=self.args.device,
            what=f"checkpoint at step {self.state.global_step}",
        )

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Resuming an MoE model loads its hub-layout experts through `from_pretrained`'s conversion."""
        target = model if model is not None else self.model
        if has_moe_blocks(target) and not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return load_moe_checkpoint(target, resume_from_checkpoint)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        """`load_best_model_at_end` of an MoE model: the same hub-layout conversion as resuming."""
        if has_moe_blocks(self.model) and not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return load_moe_checkpoint(self.model, self.state.best_model_checkpoint)
        return super()._load_best_model()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: MoE losses and expert load since the previous one
            logs.update(self._moe_loss.logs())
        add_callback_logs(self.callback_handler.callbacks, logs, self.state)  # reporters then receive them too
        super().log(logs, start_time)
