"""`LLMKitTrainingArguments`: the HF `TrainingArguments` plus every knob hf_llmkit adds.

It is a plain dataclass subclass, so `HfArgumentParser` turns each field into a `--flag` and
`LLMKitTrainer` reads them. Fields are grouped by feature; each documents itself twice (docstring and
`help`), as transformers' own arguments do, and is validated in `__post_init__` with a `ValueError`
that names the fix.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import TrainingArguments

from hf_llmkit.checkpoints.exit_codes import EXIT_DIVERGED, EXIT_PREEMPTED
from hf_llmkit.compat.accelerate import launcher_parallelism_config
from hf_llmkit.parallel.dims import ParallelDims
from hf_llmkit.parallel.elastic import check_elastic_restarts
from hf_llmkit.parallel.host_clashes import check_sequence_parallel_config

logger = logging.getLogger(__name__)


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


def offload_pins_host_memory() -> bool:
    """Whether transformers' per-checkpoint activation offload runs here: it keeps what it moves in pinned host
    memory, which exists only next to an accelerator (a CPU-only torch build raises "pin_memory=True requires a CUDA
    or other accelerator backend" at the first checkpointed layer). Without one, activations already live in host
    memory: there is nothing to move."""
    return _has_accelerator()


def _deepspeed_state_on_gloo() -> None:
    """Without an accelerator, accelerate finds no DeepSpeed backend and reports one process: start it on gloo."""
    from accelerate import PartialState

    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous


@dataclass
class LLMKitTrainingArguments(TrainingArguments):
    """`TrainingArguments` extended with hf_llmkit's options.

    Beyond the added fields, one behaviour differs from `TrainingArguments`: launched on several ranks
    (`accelerate launch --multi_gpu`, `torchrun`) on a machine without an accelerator, the plain arguments
    leave accelerate in single-process mode and every rank trains its own copy of the model; here `use_cpu`
    is switched on so the ranks form one gloo data-parallel group (accelerate's MULTI_CPU). With a `deepspeed`
    config there, accelerate's DeepSpeed state is started on gloo (it would otherwise report a single process).
    DeepSpeed without an accelerator never JIT-compiles its CPU collective ops (`hf_llmkit.compat.deepspeed`);
    leave the `optimizer` block out of the DeepSpeed config so the Trainer's torch AdamW is used and no CPU Adam
    op is compiled either. Started by `torchrun --max-restarts N` (N > 0) whose agents share their store with the
    workers, it raises `ValueError` asking for `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: without it a restarted group
    cannot connect (`hf_llmkit.parallel.elastic`).

    Args:
        (every `transformers.TrainingArguments` argument)
        auto_resume: Fault tolerance. When `train()` gets no `resume_from_checkpoint`, resume from the latest
            *complete* checkpoint in `output_dir` (manifest-verified, see `FaultToleranceCallback`), so re-running
            the same command, a `torchrun --max-restarts` restart or a scheduler requeue continues the run.
        resume_verify_checksums: Fault tolerance. Verify every file's checksum (not only its size) when picking the
            checkpoint to resume from.
        save_retries: Fault tolerance. Re-run a checkpoint save this many times after a transient I/O error.
        save_retry_delay: Fault tolerance. Seconds before the first save retry; doubles at each retry.
        preemption_exit_code: Fault tolerance. Exit status of a run that a `FaultToleranceCallback` stopped on
            SIGTERM / SIGUSR1 once its checkpoint was complete (`TrainingInterrupted`); 143 is the SIGTERM convention
            that schedulers and `torchrun --max-restarts` read as "interrupted, run again".
        divergence_exit_code: Fault tolerance. Exit status of a run whose loss diverged beyond `max_rollbacks`
            (`TrainingDivergedError`).
        moe_aux_loss_coef: Mixture of experts. Weight of the Switch load-balancing loss (mean over the model's
            `MoELayer`s) that `LLMKitTrainer` adds to the training loss; 0 turns it off. Only models with
            `MoELayer`s (e.g. from `upcycle_to_moe`) are affected.
        moe_z_loss_coef: Mixture of experts. Weight of the router z-loss (mean over `MoELayer`s); 0 turns it off.
        expert_parallel_size: Mixture of experts. Ranks that split each MoE layer's experts (world = replicas x this);
            `LLMKitTrainer` shards the experts of a Mixtral / Qwen2-MoE / upcycled model over each group of this many
            consecutive ranks, moves tokens to their experts by all-to-all, reduces expert gradients only over the
            ranks holding the same experts and saves full native checkpoints (`hf_llmkit.trainers.expert_parallel`).
            1 = off. On a model transformers already distributed (loaded with `distributed_config`) `LLMKitTrainer`
            raises `ValueError` before building its Accelerator: that model trains with transformers' own plan.
        sequence_parallel_size: Sequence parallelism (Ulysses). Number of ranks that split each sample's sequence
            (world = data-parallel size x this); `LLMKitTrainer` shards batches along the sequence, wraps the model's
            attention with all-to-all head exchange and averages the loss over the group's tokens. 1 = off. With
            an accelerate `ParallelismConfig` that splits the sequence too (`sp_size` / `cp_size` > 1, given as
            `parallelism_config` or by `accelerate launch --parallelism_config_*`) it raises `ValueError` naming both.
        tiled_loss: Long sequences (ALST). Compute the LM head and the cross-entropy in chunks of
            `tiled_loss_chunk_size` positions under checkpointing, never materialising `[sequence, vocab]` logits;
            loss and gradients equal the untiled ones. With or without sequence parallelism; causal LMs whose head is
            a plain projection (models that soft-cap or scale logits are refused at the first step).
        tiled_loss_chunk_size: Long sequences. Positions (per rank) per tiled-loss chunk.
        tiled_mlp: Long sequences (ALST). Run each decoder layer's MLP in chunks of `tiled_mlp_chunk_size` positions,
            each under checkpointing, so the `[sequence, intermediate]` activations are never kept (dense MLPs and
            dropless MoE blocks; a `capacity_factor` is refused).
        tiled_mlp_chunk_size: Long sequences. Positions (per rank) per tiled-MLP chunk; 0 = the model's hidden size.
        offload_activation_checkpoints: Long sequences (ALST). Keep each checkpointed layer's input in pinned host
            memory instead of accelerator memory; needs `activation_checkpointing` (`gradient_checkpointing`). It is
            transformers' own per-checkpoint offload (`activation_checkpointing_kwargs={"offload": True}`, set
            here); without an accelerator activations already live in host memory, so it logs that and checkpoints
            without offload (pinning needs an accelerator).
    """

    # `--help` of a command built on `hf_llmkit.cli.CommandLineParser` lists these fields under these titles (a test
    # checks that every field added here is listed).
    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "fault tolerance": (
            "auto_resume", "resume_verify_checksums", "save_retries", "save_retry_delay", "preemption_exit_code",
            "divergence_exit_code",
        ),
        "mixture of experts": ("moe_aux_loss_coef", "moe_z_loss_coef", "expert_parallel_size"),
        "sequence parallel": ("sequence_parallel_size",),
        "long sequences": (
            "tiled_loss", "tiled_loss_chunk_size", "tiled_mlp", "tiled_mlp_chunk_size",
            "offload_activation_checkpoints",
        ),
    }  # fmt: skip

    auto_resume: bool = field(
        default=False,
        metadata={"help": "Resume from the latest complete (manifest-verified) checkpoint in output_dir."},
    )
    resume_verify_checksums: bool = field(
        default=True, metadata={"help": "Check file checksums, not only sizes, when choosing the resume checkpoint."}
    )
    save_retries: int = field(
        default=3, metadata={"help": "Retries of a checkpoint save that failed with a transient I/O error."}
    )
    save_retry_delay: float = field(
        default=1.0, metadata={"help": "Seconds before the first save retry (doubles at each retry)."}
    )
    preemption_exit_code: int = field(
        default=EXIT_PREEMPTED,
        metadata={"help": "Exit status after a SIGTERM/SIGUSR1 save (143: interrupted, run again)."},
    )
    divergence_exit_code: int = field(
        default=EXIT_DIVERGED, metadata={"help": "Exit status when the loss diverges beyond the allowed rollbacks."}
    )
    moe_aux_loss_coef: float = field(
        default=0.01,
        metadata={"help": "Weight of the MoE load-balancing loss added to the training loss (0 = off)."},
    )
    moe_z_loss_coef: float = field(
        default=0.001, metadata={"help": "Weight of the MoE router z-loss added to the training loss (0 = off)."}
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks that split each MoE layer's experts (expert parallelism); must divide the number of ranks "
            "and the experts per layer. 1 = off."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks that split each sequence (Ulysses sequence parallelism); must divide the number of "
            "ranks and the attention heads. 1 = off."
        },
    )

    tiled_loss: bool = field(
        default=False,
        metadata={"help": "Compute logits and cross-entropy in sequence chunks (never [sequence, vocab] at once)."},
    )
    tiled_loss_chunk_size: int = field(
        default=1024, metadata={"help": "Positions per rank in each tiled-loss chunk (with --tiled_loss)."}
    )
    tiled_mlp: bool = field(
        default=False,
        metadata={"help": "Apply each decoder layer's MLP in sequence chunks under checkpointing."},
    )
    tiled_mlp_chunk_size: int = field(
        default=0,
        metadata={"help": "Positions per rank in each tiled-MLP chunk (with --tiled_mlp); 0 = the hidden size."},
    )
    offload_activation_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "Keep activation-checkpoint inputs in pinned host memory (needs --gradient_checkpointing; "
            "transformers' per-checkpoint offload)."
        },
    )

    def __post_init__(self):
        if self.save_retries < 0:
            raise ValueError(f"save_retries must be >= 0 (0 disables retries), got {self.save_retries}")
        if self.save_retry_delay < 0:
            raise ValueError(f"save_retry_delay must be >= 0 seconds, got {self.save_retry_delay}")
        for name in ("preemption_exit_code", "divergence_exit_code"):
            if not 0 <= getattr(self, name) <= 255:
                raise ValueError(f"{name} must be an exit status in 0..255, got {getattr(self, name)}")
        for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables that MoE loss), got {getattr(self, name)}")
        if self.tiled_loss_chunk_size < 1:
            raise ValueError(f"tiled_loss_chunk_size must be >= 1 positions, got {self.tiled_loss_chunk_size}")
        if self.tiled_mlp_chunk_size < 0:
            raise ValueError(
                f"tiled_mlp_chunk_size must be >= 1 positions (or 0 for the hidden size), "
                f"got {self.tiled_mlp_chunk_size}"
            )
        if self.sequence_parallel_size > 1:  # one sequence splitter only: accelerate's or ours
            for config, source in (
                (self.parallelism_config, "the parallelism_config argument's"),
                (launcher_parallelism_config(), "accelerate launch's"),
            ):
                check_sequence_parallel_config(self.sequence_parallel_size, config, source=source)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        ParallelDims(world=world, sp=self.sequence_parallel_size, ep=self.expert_parallel_size)  # before any work
        multi_rank = int(os.environ.get("WORLD_SIZE", "1")) > 1
        check_elastic_restarts()  # a torchrun restart must not meet the previous round's process-group addresses
        if self.deepspeed and not _has_accelerator():
            from hf_llmkit.compat.deepspeed import skip_cpu_comm_op_builds

            skip_cpu_comm_op_builds()  # gloo does the collectives; no C++ build on a machine without an accelerator
        if multi_rank and not self.use_cpu and not self.deepspeed and not _has_accelerator():
            logger.info("no accelerator: training on %s CPU ranks with gloo", os.environ["WORLD_SIZE"])
            self.use_cpu = True
        if multi_rank and self.deepspeed and not self.use_cpu and not _has_accelerator():
            logger.info("no accelerator: DeepSpeed on %s CPU ranks with gloo", os.environ["WORLD_SIZE"])
            _deepspeed_state_on_gloo()
            if self.accelerator_config is None or isinstance(self.accelerator_config, dict):
                self.accelerator_config = {**(self.accelerator_config or {}), "use_configured_state": True}
        super().__post_init__()
        if self.offload_activation_checkpoints:
            self._delegate_offload()
        if (self.activation_checkpointing_kwargs or {}).get("offload") and not offload_pins_host_memory():
            logger.warning(
                "activation offload: no accelerator, so activations already live in host memory; "
                "checkpointing without offload (it pins host memory, which needs an accelerator)"
            )
            kwargs = {k: v for k, v in self.activation_checkpointing_kwargs.items() if k != "offload"}
            self.activation_checkpointing_kwargs = kwargs or None

    def _delegate_offload(self) -> None:
        """`offload_activation_checkpoints` is transformers' own per-checkpoint offload (`save_on_cpu` around each
        checkpointed layer's call: only the layers' inputs move), asked for in `activation_checkpointing_kwargs`."""
        if not self.activation_checkpointing:
            raise ValueError(
                "offload_activation_checkpoints moves activation-checkpoint inputs to host memory, so it needs "
                "checkpointing: add --gradient_checkpointing true (or drop --offload_activation_checkpoints)"
            )
        kwargs = dict(self.activation_checkpointing_kwargs or {})
        if kwargs.get("offload", True) is not True:
            raise ValueError(
                f"offload_activation_checkpoints=True and activation_checkpointing_kwargs offload="
                f"{kwargs['offload']!r} contradict each other; drop one of them"
            )
        self.activation_checkpointing_kwargs = {**kwargs, "offload": True}
