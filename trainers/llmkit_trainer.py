"""`LLMKitTrainer`: the HF `Trainer`, plus the features switched on by `LLMKitTrainingArguments`.

Each feature lives in its own module; this class only dispatches to them, so a run with default arguments trains
like `transformers.Trainer`. Public hooks overridden: `train`, `training_step`, `compute_loss`, `save_model`,
`get_train_dataloader`, `get_eval_dataloader`, `log`, `create_optimizer`. Private hooks overridden (no public hook
runs at these points; each is listed with its reason and checked against the installed transformers in
`hf_llmkit.compat.transformers`):

- `_save_checkpoint`: clear the way and mark before the first byte, hold off the Trainer's pre-manifest rotation,
  retry transient I/O errors, one line on a full disk, the run record (hf_llmkit.trainers.checkpoint_writes);
- `_load_from_checkpoint`: resume exactly the PEFT model's own adapters, and MoE hub-layout experts;
- `_load_best_model`: verify the best checkpoint before loading it; MoE experts;
- `_clip_grad_norm`: under expert parallelism (DDP) the norm must cover every rank's experts, not the local ones;
- `_save`: the only place that holds the full state dict `save_model` gathered on every rank (FSDP2, ZeRO-3) while
  the main process writes; a DKM model packs its indices from it (`save_pretrained` asks its quantizer for the
  state dict to write and drops the one it was given; the model's own tensors are shards there).
"""

from __future__ import annotations

import math

from transformers import Trainer, TrainingArguments

from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.checkpoints.status import classify_checkpoint
from hf_llmkit.log_bridge import add_callback_logs
from hf_llmkit.parallel.host_clashes import check_expert_parallel_model
from hf_llmkit.parallel.moe.routing_stats import watch_native_routers
from hf_llmkit.trainers.changed_settings import apply_changed_settings
from hf_llmkit.trainers.checkpoint_writes import save_checkpoint, save_final_model
from hf_llmkit.trainers.distillation import TrainerDistillation
from hf_llmkit.trainers.eval_preparation import forget_evaluation_preparation
from hf_llmkit.trainers.expert_parallel import TrainerExpertParallel
from hf_llmkit.trainers.long_sequence import TrainerLongSequence
from hf_llmkit.trainers.moe_loss import (
    MoELossTracker,
    aux_loss_scale,
    has_moe_blocks,
    load_moe_checkpoint,
    register_zero3_leaf_modules,
)
from hf_llmkit.trainers.recovery import TrainingAlreadyComplete, run_training
from hf_llmkit.trainers.resume import load_own_adapters
from hf_llmkit.trainers.sequence_parallel import TrainerSequenceParallel


class LLMKitTrainer(Trainer):
    """Drop-in `transformers.Trainer`; pass `LLMKitTrainingArguments` to enable hf_llmkit's features.

    `teacher_model`: train on KL(teacher || model) of the next-token distributions instead of the model's loss
    (`hf_llmkit.trainers.distillation`; evaluation keeps the model's loss).

    Example:
        ```python
        from hf_llmkit import LLMKitTrainingArguments
        from hf_llmkit.trainers import LLMKitTrainer

        trainer = LLMKitTrainer(model=model, args=LLMKitTrainingArguments(output_dir="out"), train_dataset=ds)
        trainer.train()
        ```
    """

    def __init__(self, model=None, args=None, *rest, teacher_model=None, **kwargs):
        if model is not None:  # before the Trainer builds its Accelerator (which may refuse the model first)
            check_expert_parallel_model(getattr(args, "expert_parallel_size", 1), model)
        super().__init__(model, args, *rest, **kwargs)
        if not isinstance(self.args, TrainingArguments):
            raise TypeError(f"LLMKitTrainer needs TrainingArguments, got {type(self.args).__name__}")
        self.run_identity: dict | None = None  # what this run is (hf_llmkit.trainers.run_identity), set by train()
        self.resumed_from: str | None = None  # the checkpoint the last train() started from, set by train()
        self.changed_settings: list = []  # settings a resume changed (learning rate...): applied at the first step
        # Mixture of experts (hf_llmkit.trainers.moe_loss): auxiliary losses + routing logs for MoELayer models.
        self._moe_loss = MoELossTracker(
            aux_loss_coef=getattr(self.args, "moe_aux_loss_coef", 0.0),
            z_loss_coef=getattr(self.args, "moe_z_loss_coef", 0.0),
        )
        watch_native_routers(self.model)  # transformers' own sparse blocks report their routing too
        if self.is_deepspeed_enabled:
            register_zero3_leaf_modules(self.model)
        # Sequence parallelism (hf_llmkit.trainers.sequence_parallel): groups, attention wrapper, batch sharding, loss.
        self._sequence_parallel = TrainerSequenceParallel.for_trainer(self)
        # Long sequences (hf_llmkit.trainers.long_sequence): tiled loss, tiled MLP, activation-checkpoint offload.
        self._long_sequence = TrainerLongSequence.for_trainer(self)
        # Expert parallelism (hf_llmkit.trainers.expert_parallel): sharded experts, DDP reduction, clipping, saving.
        self._expert_parallel = TrainerExpertParallel.for_trainer(self)
        # Distillation (hf_llmkit.trainers.distillation): training steps on KL(teacher || model).
        self._distillation = TrainerDistillation.for_trainer(self, teacher_model)
        # DKM (hf_llmkit.quantization.training_state): resumable checkpoints and the final calibration, once.
        from hf_llmkit.quantization.training_state import add_training_state_callback

        add_training_state_callback(self)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """`Trainer.compute_loss` (with `teacher_model`, training steps distil: `hf_llmkit.trainers.distillation`),
        plus the MoE auxiliary losses of the forward it ran (training only)."""
        if model.training:
            self._moe_loss.begin_forward(model)
        if self._distillation is not None and model.training:
            result = self._distillation.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        elif self._sequence_parallel is not None:
            result = self._sequence_parallel.compute_loss(
                self, model, inputs, return_outputs, num_items_in_batch, long_sequence=self._long_sequence
            )
        elif self._long_sequence is not None:
            result = self._long_sequence.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
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

    # Expert parallelism (hf_llmkit.trainers.expert_parallel): only its DDP case needs these hooks. DKM: the latent
    # weights' learning-rate factor (DKMConfig.latent_lr_scale), set before the scheduler reads the groups' rates, on
    # an optimizer made here only (one passed in `optimizers` may come with its scheduler: the callback warns).
    def create_optimizer(self, model=None):
        from hf_llmkit.quantization.training_state import scale_latent_lr

        made_here = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if made_here:
            scale_latent_lr(optimizer, self.model if model is None else model)
        if self._expert_parallel is not None:
            self._expert_parallel.attach_optimizer(optimizer)  # checkpoints hold full expert states
        return optimizer

    def _clip_grad_norm(self, model):
        if self._expert_parallel is not None and not self.is_deepspeed_enabled:
            return self._expert_parallel.clip_grad_norm(self, model)  # the norm over all experts
        return super()._clip_grad_norm(model)

    def _write_model(self, output_dir: str | None, internal_call: bool) -> None:
        if self._expert_parallel is not None and not self.is_deepspeed_enabled:
            return self._expert_parallel.save_model(self, output_dir, internal_call)  # gathers the experts
        return super().save_model(output_dir, _internal_call=internal_call)

    # Fault tolerance (hf_llmkit.trainers.recovery / checkpoint_writes / resume / run_identity).
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """`Trainer.train`; `auto_resume` / `resume_from_checkpoint=True` pick the latest complete checkpoint, a
        checkpoint of another run is refused before any work, and a callback's rollback request is acted on."""
        forget_evaluation_preparation(self)  # an earlier evaluate() must not leave the model out of DDP
        return run_training(
            self, super().train, resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        if 0 < self.state.max_steps <= self.state.global_step:
            raise TrainingAlreadyComplete()  # resumed at the end: the Trainer would run one step too many
        if self.changed_settings:  # optimizer, scheduler and state now hold the checkpoint's values
            apply_changed_settings(self, self.changed_settings)
            self.changed_settings = []
        return super().training_step(model, inputs, num_items_in_batch)

    def _save_checkpoint(self, model, trial):
        save_checkpoint(self, lambda: super(LLMKitTrainer, self)._save_checkpoint(model, trial), self.run_identity)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; a final save (not a checkpoint's) is marked while written and gets a manifest."""
        if _internal_call:
            return self._write_model(output_dir, True)
        target = output_dir if output_dir is not None else self.args.output_dir
        save_final_model(self, lambda: self._write_model(output_dir, False), target)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        from hf_llmkit.quantization.quantizer import exporting_from

        with exporting_from(self.accelerator.unwrap_model(self.model), state_dict):  # DKM: pack the gathered weights
            return super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Resuming loads an MoE model's hub-layout experts through `from_pretrained`'s conversion, and a PEFT
        model's own adapters only."""
        target = model if model is not None else self.model
        if has_moe_blocks(target) and not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return load_moe_checkpoint(target, resume_from_checkpoint)
        if not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and load_own_adapters(
            target, resume_from_checkpoint
        ):
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        """`load_best_model_at_end`: the best checkpoint must verify; MoE models get the hub-layout conversion."""
        verdict = classify_checkpoint(self.state.best_model_checkpoint)
        if not verdict.resumable:
            raise ResumeError(f"cannot load the best model: {verdict.describe()}")
        if has_moe_blocks(self.model) and not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return load_moe_checkpoint(self.model, self.state.best_model_checkpoint)
        return super()._load_best_model()

    def save_metrics(self, split, metrics, combined=True):
        """`Trainer.save_metrics`, as valid JSON: a NaN or infinite value (a loss that diverged, the perplexity of
        a huge loss) is written as null."""
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        return super().save_metrics(split, finite, combined)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: MoE losses and expert load since the previous one
            logs.update(self._moe_loss.logs())
        add_callback_logs(self.callback_handler.callbacks, logs, self.state)  # reporters then receive them too
        super().log(logs, start_time)
