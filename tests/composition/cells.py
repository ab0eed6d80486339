"""Build, train, save and reload one composition cell; the single-rank reference it must match.

`run_cells` runs on every rank of a `hf_llmkit.testing.launch` (one launch serves every cell of a group): each cell
trains `STEPS` SGD steps of the real `LLMKitTrainer` (TRL cells: `SFTTrainer`) on the same global batch, records the
logged losses and the trained model's logits on a probe batch, and saves the model (`trainer.save_model`; TRL cells
with a PEFT method: the adapter our `SavePeftModelCallback` wrote). The test process then `reload`s the save in a
fresh model and replays the cell's single-rank equivalent with `reference`, under the same autocast (clients.py).
"""

from __future__ import annotations

import gc
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import default_data_collator

from tests.composition.clients import (
    ADAPTER_SEED,
    FSDP_CONFIG,
    autocast,
    enable_cpu_fp16,
    grad_scaler,
    llmkit_trainer_class,
    reference_loss,
    sharded,
    train_trl_cell,
    trl_reference_model,
)
from tests.composition.matrix import Setup, cell
from tests.one_launch import fresh_trainer_state

SEQ, ROWS, STEPS = 16, 4, 4
VIRTUAL_IDS = (500, 501)  # P-tuning v1's virtual tokens [P0][P1], at the start of every row (no loss there)


def learning_rate(setup: Setup) -> float:
    """SGD step size: DKM's soft assignment turns the sharded table's float32 rounding (relative 1e-6 in the
    gradients, tests/quantization/test_edkm_shard.py) into larger differences at big steps; 0.05 keeps them < 1e-5."""
    return 0.05 if setup.dkm else 0.3


def make_rows() -> list[dict[str, torch.Tensor]]:
    """`ROWS` fixed rows; every step trains on all of them (the loss must fall)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(ROWS):
        ids = torch.randint(3, 500, (SEQ,), generator=g)
        ids[: len(VIRTUAL_IDS)] = torch.tensor(VIRTUAL_IDS)
        labels = ids.clone()
        labels[: len(VIRTUAL_IDS)] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels})
    return rows


def probe_batch() -> dict[str, torch.Tensor]:
    batch = default_data_collator(make_rows()[:2])
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def peft_config(method: str):
    from peft import LoraConfig

    from hf_llmkit import BitFitConfig, BottleneckConfig, PTuningConfig, PTuningV2Config

    return {
        "lora": lambda: LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        "bottleneck": lambda: BottleneckConfig(bottleneck_size=8, init_weights=False),
        "bitfit": lambda: BitFitConfig(add_missing_biases=True, init_weights=False),
        "ptuning": lambda: PTuningConfig(num_virtual_tokens=len(VIRTUAL_IDS), virtual_token_start_id=VIRTUAL_IDS[0]),
        "ptuning_v2": lambda: PTuningV2Config(num_virtual_tokens=4),
    }[method]()


def bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def dkm_config(setup: Setup):
    """3-bit DKM; `setup.dkm_engine` forces an engine (`DKMConfig(engine=...)` where DKM has it, else the settings
    that select it: "naive" without uniquification, "table" for 2-value vectors)."""
    from hf_llmkit import DKMConfig

    kwargs: dict[str, Any] = {"bits": 3, "shard": setup.dkm_shard}
    if setup.dkm_engine and "engine" in DKMConfig.__dataclass_fields__:
        kwargs["engine"] = setup.dkm_engine
    elif setup.dkm_engine:
        kwargs.update({"naive": {"uniquify": False}, "table": {"cluster_dim": 2}}[setup.dkm_engine])
    return DKMConfig(**kwargs)


def build_model(setup: Setup, base_dir: str | os.PathLike, *, with_peft: bool = True):
    """The cell's model, as the main job composes it: load (bnb 4-bit) -> upcycle -> DKM -> PEFT. Deterministic."""
    from transformers import AutoModelForCausalLM

    from hf_llmkit.testing import tiny_llama

    if setup.bnb4:
        model = AutoModelForCausalLM.from_pretrained(Path(base_dir) / "tiny", quantization_config=bnb_config())
    else:
        model = tiny_llama(seed=0)
    if setup.moe:
        from hf_llmkit.parallel import upcycle_to_moe

        torch.manual_seed(1)  # the router's initialisation
        model = upcycle_to_moe(model, num_experts=4, top_k=2)
    if setup.dkm:
        from hf_llmkit.quantization import quantize_model

        model = quantize_model(model, dkm_config(setup))
    if setup.gc:
        model.config.use_cache = False
    if setup.peft and with_peft:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if setup.bnb4:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=setup.gc)
        torch.manual_seed(ADAPTER_SEED)  # the adapter's initialisation
        model = get_peft_model(model, peft_config(setup.peft))
    return model.train()


def _deepspeed(stage: int) -> dict | None:
    if not stage:
        return None
    zero = {"stage": stage}
    if stage == 3:  # as examples/ds_zero3_offload.json: save_model writes the gathered model, not only DeepSpeed's
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def _common_args(setup: Setup, out_dir: Path, device: str) -> dict[str, Any]:
    """The arguments every cell's Trainer gets (SGD at a constant rate, one batch per step, a log every step)."""
    return dict(
        output_dir=str(out_dir), per_device_train_batch_size=ROWS // setup.data_parallel, max_steps=STEPS,
        learning_rate=learning_rate(setup), optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, report_to=[], train_sampling_strategy="sequential", disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=setup.gc,
        **({setup.precision: True} if setup.precision else {}),
        **({"use_cpu": True} if device == "cpu" and (setup.precision or setup.fsdp or setup.trl) else {}),
    )  # fmt: skip


def train_cell(setup: Setup, out_dir: Path, base_dir: str, device: str = "cpu") -> dict[str, Any]:
    """Train the cell on this rank (on `device`: "cuda" for tests/gpu); save the model to `out_dir/final`."""
    from hf_llmkit import LLMKitTrainingArguments

    common = _common_args(setup, out_dir, device)
    saved = out_dir / "final"
    if setup.trl:
        model = build_model(setup, base_dir, with_peft=False)  # SFTTrainer applies the PEFT config itself
        peft = peft_config(setup.peft) if setup.peft else None
        trainer = train_trl_cell(setup, out_dir, common, model, make_rows() * STEPS, peft)
        saved = out_dir / "adapter" if setup.peft else saved  # SavePeftModelCallback's final adapter
    else:
        model = build_model(setup, base_dir)  # before the arguments: a live ZeRO-3 config would partition it
        args = LLMKitTrainingArguments(
            **common, save_strategy="no", seed=0, sequence_parallel_size=setup.sp, expert_parallel_size=setup.ep,
            moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0, deepspeed=_deepspeed(setup.zero),
            **({"fsdp": True, "fsdp_config": FSDP_CONFIG} if setup.fsdp else {}),
        )  # fmt: skip
        trainer = llmkit_trainer_class(setup)(
            model=model, args=args, train_dataset=make_rows() * STEPS, data_collator=default_data_collator
        )
    if setup.precision == "fp16":
        enable_cpu_fp16(trainer.accelerator)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    logits = None
    if setup.sp == 1:  # under sequence parallelism a forward takes each rank's shard, not the whole probe
        # The trained weights' outputs in fp32: without the autocast accelerate wrapped the forward in, so a reload
        # into another implementation (an upcycled MoE saves as native Mixtral) is compared without its roundings.
        model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()
        with torch.no_grad():
            logits = model(**_to(probe_batch(), device)).logits.float().cpu()
    drift = _rank_drift(trainer.model) if setup.ranks > 1 and setup.zero != 3 and not setup.fsdp else 0.0
    if not setup.trl or not setup.peft:
        trainer.save_model(str(saved))
    result = {
        "losses": losses, "logits": logits, "saved": str(saved), "engine": type(trainer.model_wrapped).__name__,
        "drift": drift, "sharded": sharded(trainer.model) if setup.fsdp else None,
        "scale": float(trainer.accelerator.scaler.get_scale()) if trainer.accelerator.scaler is not None else None,
    }  # fmt: skip
    del trainer, model
    gc.collect()
    return result


def _rank_drift(model) -> float:
    """Largest difference between this rank's and another rank's replicated parameters (their float64 sums): data
    parallelism must keep every replicated weight identical; only expert-parallel shards differ by design."""
    import torch.distributed as dist

    from hf_llmkit.parallel.moe.expert_parallel import expert_shards

    sharded = {id(shard.param) for shard in expert_shards(model).values()}
    sums = torch.stack([p.detach().double().sum() for p in model.parameters() if id(p) not in sharded])  # [P]
    gathered = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    return max((other - sums).abs().max().item() for other in gathered)


def run_cells(names: list[str], workdir: str, base_dir: str) -> dict[str, dict]:
    """Every cell in `names`, in order, on this rank (launched on the cells' ranks); a failure is recorded, not
    raised, so the group's other cells still run. Each cell starts with a fresh Trainer state (tests/one_launch.py)."""
    torch.set_num_threads(1)
    environ = dict(os.environ)
    results = {}
    for name in names:
        fresh_trainer_state(environ)
        try:
            results[name] = train_cell(cell(name).setup, Path(workdir) / name, base_dir)
        except Exception:  # noqa: BLE001 - reported by the cell's test
            results[name] = {"error": traceback.format_exc()}
    fresh_trainer_state(environ)
    return results


def _to(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def reference(setup: Setup, base_dir: str, device: str = "cpu") -> tuple[list[float], torch.Tensor]:
    """The single-rank equivalent in this process: the same model, a plain SGD loop on the same batches, under the
    same autocast (fp16: with a `GradScaler` of accelerate's settings) and loss (TRL: its fused LM-head loss)."""
    single = setup.single_rank()
    model = build_model(single, base_dir, with_peft=not setup.trl)
    if setup.trl:
        model = trl_reference_model(model)
        if setup.peft:
            from peft import get_peft_model

            torch.manual_seed(ADAPTER_SEED)
            model = get_peft_model(model, peft_config(setup.peft))
        model.train()
    model.to(device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=learning_rate(setup))
    scaler = grad_scaler(setup, device)
    batch = _to(default_data_collator(make_rows()), device)
    losses = []
    for _ in range(STEPS):
        with autocast(setup, device):
            loss = reference_loss(setup, model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():  # in fp32, as `train_cell` evaluates the trained model
        return losses, model(**_to(probe_batch(), device)).logits.float().cpu()


def reload(setup: Setup, base_dir: str, saved: str) -> torch.Tensor:
    """Probe logits of the saved model loaded fresh: an adapter onto a newly built base, else `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    if setup.peft:
        from peft import PeftModel

        base = build_model(setup.single_rank(), base_dir, with_peft=False)
        model = PeftModel.from_pretrained(base, saved)
    else:
        model = AutoModelForCausalLM.from_pretrained(saved)
    model.eval()
    with torch.no_grad():
        return model(**probe_batch()).logits.float()
