"""Run on 2 gloo ranks by test_multirank.py (module top level, for `hf_llmkit.testing.launch`)."""

from __future__ import annotations

import json
import os


def _train(out_dir: str, max_steps: int):
    from peft import LoraConfig, get_peft_model

    from hf_llmkit.callbacks import FaultToleranceCallback, LossScaleCallback, SavePeftModelCallback
    from tests.callbacks.support import make_trainer, small_model

    model = get_peft_model(small_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    callbacks = [FaultToleranceCallback(), SavePeftModelCallback(), LossScaleCallback()]
    trainer = make_trainer(
        out_dir,
        model=model,
        callbacks=callbacks,
        max_steps=max_steps,
        save_steps=2,
        save_total_limit=1,
        auto_resume=True,
        per_device_train_batch_size=2,
    )
    return trainer, trainer.train()


def train_two_ranks(out_dir: str) -> dict:
    """LoRA + all three callbacks on 2 CPU ranks for 4 steps, then the same job with 6 steps (auto-resume)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {"rank": int(os.environ["RANK"])}
    for max_steps in (4, 6):
        trainer, output = _train(out_dir, max_steps)
        dist.barrier()  # rank 0 writes the manifest after the others have moved on
        result[max_steps] = {"world_size": trainer.args.world_size, "global_step": output.global_step}
        if result["rank"] == 0:
            with open(os.path.join(out_dir, f"checkpoint-{max_steps}", "llmkit_manifest.json")) as handle:
                manifest = json.load(handle)
            result[max_steps].update(
                manifest_files=sorted(manifest["files"]),
                manifest_world_size=manifest["world_size"],
                checkpoints=sorted(p for p in os.listdir(out_dir) if p.startswith("checkpoint-")),
            )
    from hf_llmkit.checkpoints.lock import lock_holder

    result.update(pid=os.getpid(), lock_pid=lock_holder(out_dir)["pid"])  # one holder for both ranks
    return result
