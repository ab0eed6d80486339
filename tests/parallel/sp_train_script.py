"""Train a tiny Llama with `LLMKitTrainer(sequence_parallel_size=P)` and compare with single-rank training.

Run on several ranks (`accelerate launch` / `torchrun` / `deepspeed`). Every rank also replays the same global
batches in a plain single-process loop (HF loss, SGD) on its own copy of the model; rank 0 writes the largest
parameter difference, the logged vs reference losses and the eval losses to `--out` as JSON.

`--cases '{"name": [flags]}'` runs several configurations in turn (one JSON entry each), and `--run_clm FLAGS` then
runs `examples/run_clm.py` with those flags in the same processes: one start-up of the ranks serves every check
(tests/one_launch.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
from transformers import default_data_collator

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.compat.transformers import configured_attention
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import LLMKitTrainer

SEQ, BATCH, STEPS, LR = 13, 2, 3, 0.5


def make_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Fixed-length rows with left or right padding and a masked prompt (SFT-style labels)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 512, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        pad = int(torch.randint(0, 5, (1,), generator=g))
        left = i % 2 == 0
        if pad:
            mask[slice(0, pad) if left else slice(SEQ - pad, SEQ)] = 0
        ids[mask == 0] = 0
        labels = ids.clone()
        labels[mask == 0] = -100
        labels[: (pad if left else 0) + 2] = -100  # prompt tokens carry no loss
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def build_model(args):
    model = tiny_llama(seed=0, num_key_value_heads=args.kv_heads).train()
    if args.peft == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    elif args.peft == "bottleneck":
        from peft import get_peft_model

        from hf_llmkit import BottleneckConfig

        torch.manual_seed(1)
        model = get_peft_model(model, BottleneckConfig(bottleneck_size=8, init_weights=False))
    if args.gradient_checkpointing:
        model.config.use_cache = False
    return model


def reference(args, train, evals):
    """Single-process training on the same global batches: HF's own loss, plain SGD."""
    model = build_model(args)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        batch = default_data_collator(train[step * BATCH : (step + 1) * BATCH])
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        eval_loss = sum(model(**default_data_collator(evals[i : i + BATCH])).loss.item() for i in (0, BATCH)) / 2
    return model, losses, eval_loss


def parse(flags: list[str]) -> argparse.Namespace:
    """One configuration's flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--peft", choices=["none", "lora", "bottleneck"], default="none")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--zero", type=int, default=0, help="DeepSpeed ZeRO stage (0 = DDP)")
    parser.add_argument("--long_sequence", action="store_true", help="tiled loss + tiled MLP (+ offload with GC)")
    return parser.parse_args(flags)


def check(args: argparse.Namespace, out_dir: str) -> dict | None:
    """Train one configuration with the Trainer (output in `out_dir`) and against the reference; rank 0's result
    (None on the other ranks)."""
    train, evals = make_rows(STEPS * BATCH, 0), make_rows(2 * BATCH, 1)
    ds_config = None  # LLMKitTrainingArguments starts DeepSpeed on gloo when there is no accelerator
    if args.zero:
        ds_config = {
            "zero_optimization": {"stage": args.zero},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
        }
    long_sequence = {}
    if args.long_sequence:  # chunks that do not divide the 7-token shards
        long_sequence = dict(tiled_loss=True, tiled_loss_chunk_size=3, tiled_mlp=True, tiled_mlp_chunk_size=2)
        long_sequence["offload_activation_checkpoints"] = args.gradient_checkpointing
    targs = LLMKitTrainingArguments(
        output_dir=out_dir,
        sequence_parallel_size=args.sp,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        train_sampling_strategy="sequential",
        gradient_checkpointing=args.gradient_checkpointing,
        deepspeed=ds_config,
        disable_tqdm=True,
        seed=0,
        **long_sequence,
    )
    model = build_model(args)
    trainer = LLMKitTrainer(
        model=model, args=targs, train_dataset=train, eval_dataset=evals, data_collator=default_data_collator
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    logged = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    trained = trainer.accelerator.unwrap_model(trainer.model)
    if args.zero == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(trained.parameters())):
            ours = {n: p.detach().clone() for n, p in trained.named_parameters()}
    else:
        ours = {n: p.detach().clone() for n, p in trained.named_parameters()}
    ref_model, ref_losses, ref_eval = reference(args, train, evals)
    diff = max((ours[n] - p.detach()).abs().max().item() for n, p in ref_model.named_parameters())
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return {
        "param_diff": diff,
        "losses": logged,
        "ref_losses": ref_losses,
        "eval_loss": eval_loss,
        "ref_eval_loss": ref_eval,
        "world": trainer.args.world_size,
        "engine": type(trainer.model_wrapped).__name__,
        "attn": configured_attention(trained.config),
    }


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tests package, under a launcher
    from tests.one_launch import fresh_trainer_state, run_example

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="{}", help='JSON {"name": [flags of `parse`]}: run in turn')
    parser.add_argument("--run_clm", help="JSON list: then examples/run_clm.py's flags, run in these processes")
    ns = parser.parse_args()
    environ = dict(os.environ)
    results = {}
    for name, flags in json.loads(ns.cases).items():
        fresh_trainer_state(environ)
        results[name] = check(parse(flags), os.path.join(os.path.dirname(ns.out), name))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(ns.out, "w") as f:
            json.dump(results, f)
    if ns.run_clm:
        fresh_trainer_state(environ)
        run_example("run_clm", json.loads(ns.run_clm))
    # The interpreter still exits as usual (atexit, module teardown), without a last full collection walking the whole
    # imported stack: 2-3 s per rank on 2 busy cores, more than the checks trained.
    gc.freeze()


if __name__ == "__main__":
    main()
