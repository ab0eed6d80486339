"""Train an upcycled tiny Mixtral with `LLMKitTrainer(expert_parallel_size=P)` and compare with P=1.

Run on several ranks (`torchrun`). In one launch every rank trains, from the same initial weights and batches:
1. expert_parallel_size=1 (plain data parallelism), 4 optimizer steps;
2. expert_parallel_size=P, 4 steps, saving checkpoints at steps 2 and 4;
3. expert_parallel_size=P resumed from step 2 of run 2, to step 4;
4. expert_parallel_size=1 resumed from step 2 of run 2 (a checkpoint does not depend on the EP size).
AdamW, a linear schedule, gradient clipping, gradient accumulation and the MoE auxiliary losses are all on.
Rank 0 writes the differences (full parameters, logged losses and gradient norms) to `--out` as JSON, plus the
logits of run 1 on a fixed batch, which the test compares with the native checkpoint loaded by plain transformers.

`--zero 0 2` runs all of it for each engine in turn (DDP, then ZeRO-2: one JSON entry per stage, each in its own
folder), and `--run_clm FLAGS` then runs `examples/run_clm.py` with those flags in the same processes: one start-up
of the ranks serves every check (tests/one_launch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import default_data_collator

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.compat.accelerate import reset_accelerator_state
from hf_llmkit.parallel import moe_layers, upcycle_to_moe
from hf_llmkit.parallel.moe.expert_parallel import expert_shards, gather_expert_state
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import LLMKitTrainer

SEQ, BATCH, ACCUM, STEPS, EXPERTS = 12, 2, 2, 4, 4


def make_rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 512, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[SEQ - i % 3 :] = 0  # some right padding
        labels = ids.masked_fill(mask == 0, -100)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def build_model():
    return upcycle_to_moe(tiny_llama(seed=0, vocab_size=512), num_experts=EXPERTS, top_k=2).train()


def train(args, ep: int, out: str, *, max_steps: int = STEPS, resume: str | None = None) -> LLMKitTrainer:
    ds_config = None
    if args.zero:
        # accelerate allows one DeepSpeed Accelerator per process; transformers' own DeepSpeed tests reset its
        # shared state the same way between trainers (a private accelerate method: hf_llmkit.compat.accelerate).
        reset_accelerator_state()
        ds_config = {
            "zero_optimization": {"stage": args.zero},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
        }
    targs = LLMKitTrainingArguments(
        output_dir=out,
        expert_parallel_size=ep,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        train_sampling_strategy="sequential",
        deepspeed=ds_config,
        disable_tqdm=True,
        seed=0,
    )
    world = int(os.environ["WORLD_SIZE"])
    trainer = LLMKitTrainer(
        model=build_model(),
        args=targs,
        train_dataset=make_rows(STEPS * BATCH * ACCUM * world),
        data_collator=default_data_collator,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def full_state(trainer: LLMKitTrainer) -> dict[str, torch.Tensor] | None:
    model = trainer.accelerator.unwrap_model(trainer.model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if trainer._expert_parallel is None or not trainer._expert_parallel.shards:
        return state
    totals = {name: shard.total for name, shard in expert_shards(model).items()}
    return gather_expert_state(state, groups=trainer._expert_parallel.groups, totals=totals)


def history(trainer: LLMKitTrainer, key: str) -> list[float]:
    return [log[key] for log in trainer.state.log_history if key in log]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bad_setups(args) -> dict[str, str]:
    """The one-line errors of setups expert parallelism cannot serve (checked before any work)."""
    errors = {}
    plain = LLMKitTrainingArguments(output_dir="unused", expert_parallel_size=args.ep, report_to="none")
    try:  # the degrees are validated together when the arguments are built (hf_llmkit.parallel.dims)
        LLMKitTrainingArguments(
            output_dir="unused", expert_parallel_size=args.ep, sequence_parallel_size=2, report_to="none"
        )
        errors["with_sp"] = "no error"
    except ValueError as err:
        errors["with_sp"] = str(err)
    for name, model, targs in (
        ("dense", tiny_llama(seed=0), plain),
        ("indivisible", upcycle_to_moe(tiny_llama(seed=0), num_experts=args.ep + 1, top_k=1), plain),
    ):
        if args.zero:
            reset_accelerator_state()
        try:
            LLMKitTrainer(model=model, args=targs, train_dataset=make_rows(4))
            errors[name] = "no error"
        except ValueError as err:
            errors[name] = str(err)
    return errors


def check(args, root: str) -> dict | None:
    """Every run of the module docstring with `args.zero`, in `root`; rank 0's result (None on the other ranks)."""
    dense = train(args, 1, os.path.join(root, "ep1"))
    ep = train(args, args.ep, os.path.join(root, "ep"))
    ep_model = ep.accelerator.unwrap_model(ep.model)
    layer = moe_layers(ep_model)[0]
    checkpoint = os.path.join(root, "ep", "checkpoint-2")
    resumed = train(args, args.ep, os.path.join(root, "ep_resumed"), resume=checkpoint)
    cross = train(args, 1, os.path.join(root, "ep1_from_ep"), resume=checkpoint)
    runs = {"dense": dense, "ep": ep, "resumed": resumed, "cross": cross}
    states = {name: full_state(trainer) for name, trainer in runs.items()}
    errors = bad_setups(args)
    if int(os.environ["RANK"]) != 0:
        return None
    model = dense.accelerator.unwrap_model(dense.model).eval()
    batch = default_data_collator(make_rows(2))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.save(logits, os.path.join(root, "ep1_logits.pt"))
    return {
        "world": ep.args.world_size,
        "engine": type(ep.model_wrapped).__name__,
        "ep_size": layer.ep_size,
        "local_experts": int(layer.experts.gate_up_proj.shape[0]),
        "param_diff": max_diff(states["dense"], states["ep"]),
        "losses": history(ep, "loss"),
        "ref_losses": history(dense, "loss"),
        "grad_norms": history(ep, "grad_norm"),
        "ref_grad_norms": history(dense, "grad_norm"),
        "resume_diff": max_diff(states["ep"], states["resumed"]),
        "cross_resume_diff": max_diff(states["dense"], states["cross"]),
        "moved": max_diff(states["dense"], {k: v for k, v in build_model().state_dict().items()}),
        "checkpoint": os.path.join(root, "ep", f"checkpoint-{STEPS}"),
        "logits": os.path.join(root, "ep1_logits.pt"),
        "errors": errors,
    }


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tests package, under a launcher
    from tests.one_launch import fresh_trainer_state, run_example

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--zero", type=int, nargs="*", default=[0], help="DeepSpeed ZeRO stages (0 = DDP), in turn")
    parser.add_argument("--run_clm", help="JSON list: then examples/run_clm.py's flags, run in these processes")
    args = parser.parse_args()
    environ = dict(os.environ)
    results = {}
    for stage in args.zero:
        fresh_trainer_state(environ)
        root = os.path.join(os.path.dirname(args.out), f"zero{stage}")
        results[stage] = check(argparse.Namespace(ep=args.ep, zero=stage), root)
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    if args.run_clm:
        fresh_trainer_state(environ)
        run_example("run_clm", json.loads(args.run_clm))


if __name__ == "__main__":
    main()
