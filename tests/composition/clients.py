"""How the matrix drives the clients users already train with (issue 19): mixed precision, TRL's `SFTTrainer` (with
our callbacks), accelerate FSDP2 -- and the single-rank reference each one must match.

Two things accelerate 1.15 does only on an accelerator, and what the CPU matrix does instead (on CUDA,
`tests/gpu/test_composition_amp.py`, neither is needed):

- fp16: accelerate creates its `GradScaler` and fp16 autocast only for accelerator devices; `Trainer(fp16=True,
  use_cpu=True)` silently trains in fp32 (`Accelerator.native_amp` stays False, `scaler` None). `enable_cpu_fp16`
  gives the accelerator what it would hold on a GPU -- a real `torch.amp.GradScaler("cpu")` and `native_amp`, so
  `prepare` wraps the forward in fp16 autocast and `backward` / `step` scale, unscale and skip like on CUDA.
- FSDP2: `AcceleratorState` keeps the FSDP plugin only for accelerator devices; on CPU ranks (`MULTI_CPU`) it drops
  it and the Trainer runs plain DDP. `CPUFullyShardedMixin` turns accelerate's FSDP2 path back on after the Trainer
  made its accelerator (distributed type FSDP in both shared states, the plugin the Trainer built from
  `fsdp_config`); from there `fully_shard`, the sharded optimizer step and the full-state-dict save are accelerate's
  and torch's own code, and each cell checks the parameters really are sharded `DTensor`s.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from tests.composition.matrix import Setup

FSDP_CONFIG = {"fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT", "reshard_after_forward": True}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(setup: Setup, device: str = "cpu"):
    """The autocast context the cell trains under (a null context in fp32)."""
    dtype = DTYPES.get(setup.autocast_dtype)
    return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def grad_scaler(setup: Setup, device: str = "cpu") -> torch.amp.GradScaler:
    """The scaler of an fp16 cell with accelerate's defaults (init scale 2**16, growth every 2,000 steps); disabled
    (a pass-through) otherwise."""
    return torch.amp.GradScaler(device, enabled=setup.autocast_dtype == "fp16")


def enable_cpu_fp16(accelerator) -> None:
    """fp16 autocast and a real CPU `GradScaler` on an accelerator that has none (see the module docstring). Call
    before `train()`: `prepare` reads both."""
    if accelerator.device.type == "cpu" and accelerator.scaler is None:
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu")


class CPUFullyShardedMixin:
    """A Trainer that runs accelerate's FSDP2 path on CPU ranks (see the module docstring)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is None or getattr(self.accelerator.state, "fsdp_plugin", None) is not None:
            return  # no FSDP asked for, or accelerate kept it (an accelerator device)
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        if self.accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(self.accelerator.mixed_precision)
        state = self.accelerator.state
        state.distributed_type = PartialState().distributed_type = DistributedType.FSDP  # AcceleratorState re-reads it
        state.fsdp_plugin = plugin
        self.is_fsdp_enabled = True


def llmkit_trainer_class(setup: Setup):
    from hf_llmkit.trainers import LLMKitTrainer

    return type("CPUFSDPLLMKitTrainer", (CPUFullyShardedMixin, LLMKitTrainer), {}) if setup.fsdp else LLMKitTrainer


def sharded(model) -> bool:
    """Whether FSDP2 really sharded `model` (its parameters are `DTensor`s)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


# --- TRL's SFTTrainer ---------------------------------------------------------------------------------------------


def trl_callbacks(setup: Setup) -> list:
    from hf_llmkit.callbacks import FaultToleranceCallback, LossScaleCallback, SavePeftModelCallback
    from hf_llmkit.quantization import DKMTrainingStateCallback

    callbacks = [FaultToleranceCallback(), LossScaleCallback(), *([SavePeftModelCallback()] if setup.peft else [])]
    return callbacks + ([DKMTrainingStateCallback()] if setup.dkm else [])  # a plain Trainer's DKM user adds it


def train_trl_cell(setup: Setup, out_dir: Path, common: dict[str, Any], model, rows: list, peft_config) -> Any:
    """Train with TRL's `SFTTrainer` as its users do: a pre-tokenized dataset, its own collator and loss, the PEFT
    config handed to it (it wraps the model itself, after `set_seed(args.seed)`), its default bf16 autocast, and our
    callbacks; a checkpoint at the last step. Returns the trainer."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_llmkit.data.corpus import corpus_tokenizer

    common = {k: v for k, v in common.items() if k != "gradient_checkpointing"}  # TRL's default (on) applies
    args = SFTConfig(**common, seed=ADAPTER_SEED, save_strategy="steps", save_steps=common["max_steps"])
    data = Dataset.from_list([{k: v.tolist() for k, v in row.items()} for row in rows])
    return SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=corpus_tokenizer(vocab_size=512),
        peft_config=peft_config, callbacks=trl_callbacks(setup),
    )  # fmt: skip


ADAPTER_SEED = 2  # the seed the adapters are initialised with (SFTTrainer: its `args.seed`)


def trl_reference_model(model):
    """What `SFTTrainer` does to a model before training, on the reference: the router loss settings it derives from
    the config, and TRL's fused LM head (per-token log-probabilities, its loss)."""
    from trl.trainer.utils import add_fused_lm_head

    config = model.config.get_text_config()
    if hasattr(config, "router_aux_loss_coef"):  # SFTConfig.router_aux_loss_coef=None: the architecture's own
        config.output_router_logits = config.router_aux_loss_coef != 0.0
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    return model


def reference_loss(setup: Setup, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The cell's training loss on `batch`: the model's own, or TRL's fused one (its load-balancing term included)."""
    if setup.trl:
        return model(**batch, fused_lm_head=True).loss
    return model(**batch).loss
