"""`SavePeftModelCallback`: a complete, verified PEFT adapter in every checkpoint and in the output dir.

At every save the adapter (and the tokenizer / processing class, and optionally the merged full model in
safetensors) goes into `checkpoint-N/<subfolder>`, and at the end of training into `output_dir/<subfolder>`.
Under DeepSpeed ZeRO-3 the adapter parameters are partitioned across ranks: they are gathered
(`deepspeed.zero.GatheredParameters`) before saving, on every rank, and only the main process writes. Each saved
tensor is then read back from disk and checked to be non-empty and of the parameter's full shape; a mismatch
raises `AdapterSaveError` instead of leaving an unusable adapter behind. Each folder is written under a temporary
name with a manifest (`verify_checkpoint` checks it) and renamed into place, so a kill never leaves a half-written
adapter. Works for every PEFT method saved through `PeftModel.save_pretrained`: peft's own (LoRA, IA3, ...) and
hf_llmkit's (bottleneck adapters, BitFit, P-tuning v1/v2).

A run stopped early (preemption, rollback, divergence) writes no final adapter: the `FaultToleranceCallback` ends it
before `on_train_end`, so `output_dir/<subfolder>` always holds the end of a finished run. Resuming a plain
`Trainer` loads every adapter subfolder of the checkpoint as an extra adapter, this callback's `<subfolder>`
included; the callback removes that stray copy before training starts, so it is never trained, saved or nested
(`LLMKitTrainer` does not load it).

Example:
    ```python
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments
    from hf_llmkit.callbacks import SavePeftModelCallback
    from hf_llmkit.testing import tiny_llama

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir="outputs/lora", max_steps=4, save_steps=2, report_to="none"),
        train_dataset=data,
        callbacks=[SavePeftModelCallback(save_merged=True)],
    )
    trainer.train()  # outputs/lora/checkpoint-2/adapter/, .../merged/, and outputs/lora/adapter/ at the end
    ```
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import TrainerCallback

from hf_llmkit.checkpoints.manifest import write_manifest
from hf_llmkit.checkpoints.names import CHECKPOINT_PREFIX, TMP_MARK, checkpoint_folder
from hf_llmkit.checkpoints.transaction import (
    CheckpointTransaction,
    PartWriter,
    attach_writer,
    detach_writer,
    register_contributor,
    transaction_of,
)
from hf_llmkit.tuners.merging import merge_for_saving, merge_problem

logger = logging.getLogger(__name__)


class AdapterSaveError(RuntimeError):
    """A saved adapter tensor is missing, empty or of the wrong shape (typically: ZeRO-3 shards not gathered)."""


def _peft_model(model):
    from peft import PeftModel

    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, PeftModel):
            return candidate
    return None


def _partitioned(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_shape")


def _gathered(params: list[torch.nn.Parameter]):
    """Full parameters for the duration of the block on every rank (ZeRO-3); a no-op otherwise."""
    partitioned = [p for p in params if _partitioned(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def expected_adapter_shapes(peft_model, adapter_name: str) -> dict[str, tuple[int, ...]]:
    """Key -> full shape of every tensor `save_pretrained` should write for `adapter_name` (ZeRO-3 aware)."""
    from peft import get_peft_model_state_dict

    full = {name: tuple(p.ds_shape) for name, p in peft_model.named_parameters() if _partitioned(p)}
    meta = {
        key: torch.empty(full.get(key, tuple(value.shape)), device="meta")
        for key, value in peft_model.state_dict().items()
    }
    expected = get_peft_model_state_dict(peft_model, state_dict=meta, adapter_name=adapter_name)
    return {key: tuple(value.shape) for key, value in expected.items()}


def verify_adapter_folder(folder: str | os.PathLike, expected: dict[str, tuple[int, ...]]) -> None:
    """Read the saved adapter back; raise `AdapterSaveError` naming every missing, empty or mis-shaped tensor."""
    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterSaveError(f"{path} was not written")
    problems = []
    with safe_open(path, framework="pt") as handle:
        saved = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    for key, shape in expected.items():
        if key not in saved:
            problems.append(f"{key}: missing")
        elif saved[key] != shape or 0 in saved[key]:
            problems.append(f"{key}: saved shape {saved[key]}, expected {shape}")
    if not saved:
        problems.append("no tensors at all")
    if problems:
        raise AdapterSaveError(
            f"adapter saved to {folder} is incomplete ({len(problems)} problem(s)): {'; '.join(problems[:8])}. "
            "Under DeepSpeed ZeRO-3 every rank must call the save (parameters are gathered collectively)."
        )


def _replace_folder(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


class SavePeftModelCallback(TrainerCallback, PartWriter):
    """Saves the PEFT adapter (+ processing class, optionally the merged model) at every save and at the end.

    Args:
        subfolder: Folder name for the adapter inside each checkpoint and inside `output_dir`.
        save_processing_class: Also save the tokenizer / processor handed to the Trainer next to the adapter.
        save_merged: Also save the base model with the adapter merged in (safetensors), for methods that can
            merge (LoRA, BitFit, ...), reloading equal to the adapter model (a LoRA on a tied embedding unties the
            output layer); skipped with a warning for methods that cannot, for a merge that would reload different
            (`hf_llmkit.tuners.merging.merge_problem`), and under ZeRO-3.
        merged_subfolder: Folder name for the merged model.
        save_at_train_end: Save into `output_dir/<subfolder>` when training ends.
    """

    def __init__(
        self,
        *,
        subfolder: str = "adapter",
        save_processing_class: bool = True,
        save_merged: bool = False,
        merged_subfolder: str = "merged",
        save_at_train_end: bool = True,
    ):
        for name, value in (("subfolder", subfolder), ("merged_subfolder", merged_subfolder)):
            if not value or os.sep in value or value.startswith((f"{CHECKPOINT_PREFIX}-", ".")) or TMP_MARK in value:
                raise ValueError(f"{name} must be a plain folder name such as 'adapter', got {value!r}")
        if subfolder == merged_subfolder:
            raise ValueError("subfolder and merged_subfolder must differ, e.g. 'adapter' and 'merged'")
        self.subfolder, self.merged_subfolder = subfolder, merged_subfolder
        self.save_processing_class, self.save_merged = save_processing_class, save_merged
        self.save_at_train_end = save_at_train_end
        self._warned: set[str] = set()
        self._adapters_at_init: set[str] | None = None
        # this callback's part of every checkpoint (hf_llmkit.checkpoints.transaction): its two folders
        files = (f"{subfolder}/*", f"{merged_subfolder}/*")
        self.checkpoint_part = register_contributor(
            f"adapter {subfolder}/ {merged_subfolder}/", files=files, writer=__name__
        ).name

    def _warn_once(self, key: str, message: str, *args, level: int = logging.WARNING) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.log(level, message, *args)

    def save(self, root: str | os.PathLike, *, model, processing_class=None, is_main_process: bool = True) -> bool:
        """Save into `root/<subfolder>` (and `root/<merged_subfolder>`); call on every rank. False if not PEFT."""
        peft_model = _peft_model(model)
        if peft_model is None:
            self._warn_once(
                "not-peft",
                "SavePeftModelCallback: %s is not a PeftModel; nothing to save",
                type(model).__name__,
                level=logging.INFO,
            )
            return False
        root = Path(root)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        zero3 = any(_partitioned(p) for p in peft_model.parameters())
        with _gathered(trainable):
            if is_main_process:
                self._write_adapter(peft_model, processing_class, root)
                if self.save_merged:
                    self._write_merged(peft_model, processing_class, root, zero3)
        return True

    def _write_adapter(self, peft_model, processing_class, root: Path) -> None:
        final = root / self.subfolder
        tmp = root / (self.subfolder + TMP_MARK)
        shutil.rmtree(tmp, ignore_errors=True)
        peft_model.save_pretrained(tmp, safe_serialization=True)
        for name in peft_model.peft_config:
            folder = tmp if name == "default" else tmp / name
            verify_adapter_folder(folder, expected_adapter_shapes(peft_model, name))
        if self.save_processing_class and processing_class is not None:
            processing_class.save_pretrained(tmp)
        write_manifest(tmp)
        _replace_folder(tmp, final)

    def _write_merged(self, peft_model, processing_class, root: Path, zero3: bool) -> None:
        if zero3:
            self._warn_once("merged-zero3", "save_merged is skipped under ZeRO-3 (the base model is partitioned)")
            return
        method = type(peft_model.base_model).__name__
        problem = merge_problem(peft_model)
        if problem is not None:
            self._warn_once("merged-reload", "save_merged: %s; skipped (the adapter is saved)", problem)
            return
        try:  # on a copy: the training model keeps its adapter
            merged = merge_for_saving(copy.deepcopy(peft_model))
        except (AttributeError, NotImplementedError, ValueError, TypeError) as err:
            self._warn_once("merged-method", "save_merged: %s adapters cannot be merged (%s); skipped", method, err)
            return
        tmp = root / (self.merged_subfolder + TMP_MARK)
        shutil.rmtree(tmp, ignore_errors=True)
        merged.save_pretrained(tmp, safe_serialization=True)
        if self.save_processing_class and processing_class is not None:
            processing_class.save_pretrained(tmp)
        del merged
        write_manifest(tmp)
        _replace_folder(tmp, root / self.merged_subfolder)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        peft_model = _peft_model(model)
        self._adapters_at_init = set(peft_model.peft_config) if peft_model is not None else None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Write the adapter into every checkpoint's transaction from now on; drop the copy of our checkpoint
        subfolder a plain Trainer's resume loaded as an extra adapter."""
        attach_writer(args.output_dir, self)
        peft_model = _peft_model(model)
        if peft_model is None:
            return
        for name in (self.subfolder, self.merged_subfolder):
            known = self._adapters_at_init is not None and name in self._adapters_at_init
            if name in peft_model.peft_config and not known and name not in peft_model.active_adapters:
                peft_model.delete_adapter(name)
                logger.info("removed the adapter %r the Trainer loaded from checkpoint/%s/ on resume", name, name)

    def write_checkpoint_part(self, transaction: CheckpointTransaction, *, model=None, processing_class=None) -> None:
        """The checkpoint's transaction asks for the adapter (every rank, before the checkpoint is complete)."""
        with transaction.part(self.checkpoint_part) as folder:
            self.save(folder, model=model, processing_class=processing_class, is_main_process=transaction.main)

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        """A checkpoint written without a transaction (a plain Trainer without a guard) gets the adapter here; one
        with a transaction got it from the transaction (or was skipped or abandoned)."""
        checkpoint = checkpoint_folder(args.output_dir, state.global_step)
        if transaction_of(checkpoint) is None:
            self.save(
                checkpoint, model=model, processing_class=processing_class, is_main_process=state.is_world_process_zero
            )

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        detach_writer(args.output_dir, self)
        if self.save_at_train_end:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            self.save(
                args.output_dir,
                model=model,
                processing_class=processing_class,
                is_main_process=state.is_world_process_zero,
            )
