"""Next to what the host libraries ship: our sequence / expert parallelism refuses theirs on the same model in one line
before any work, and our expert compute runs under transformers' own expert parallelism.

One 2-rank launch checks what needs ranks: transformers' tensor + expert parallel plan (`DistributedConfig`) on a
model computing through `experts_implementation="llmkit"` gives the single-rank logits and gradients; our
`expert_parallel_size` on that distributed model is refused; and our `sequence_parallel_size` meets the
`ParallelismConfig` the Accelerator built from the launcher's environment and is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from accelerate.parallelism_config import ParallelismConfig

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.testing import tiny_llama, tiny_training_args
from tests.warm import launch

LAUNCHER_SP = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}


def _refusal(make) -> str:
    try:
        make()
    except ValueError as err:
        return str(err)
    return ""


def _upcycled_checkpoint(folder: str) -> None:
    from hf_llmkit.parallel import upcycle_to_moe

    moe = upcycle_to_moe(tiny_llama(), num_experts=4, top_k=2)
    with torch.no_grad():  # experts and router that differ, as after training
        for name, p in moe.named_parameters():
            if ".mlp." in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    moe.save_pretrained(folder)


def two_ranks(folder: str) -> dict:
    import os

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_llmkit.trainers import LLMKitTrainer

    # DeepSpeed: the engine accelerate runs its sequence parallelism with on CPU ranks; the launcher's environment
    # appears after the arguments were checked, so only the Accelerator's config can tell
    deepspeed = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto"}
    args = tiny_training_args(f"{folder}/sp", sequence_parallel_size=2, deepspeed=deepspeed, use_cpu=False)
    os.environ.update(LAUNCHER_SP)  # what `accelerate launch --parallelism_config_sp_size 2` exports
    result = {"sp": _refusal(lambda: LLMKitTrainer(model=tiny_llama(), args=args))}
    for name in LAUNCHER_SP:
        del os.environ[name]

    if dist.get_rank() == 0:
        _upcycled_checkpoint(folder)
    dist.barrier()
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="grouped_mm").train()
    want = reference(ids, labels=ids)
    want.loss.backward()
    config = DistributedConfig(tp_size=2, ep_size=2)  # transformers' TP plan + its expert-parallel plan
    model = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="llmkit", distributed_config=config)
    out = model.train()(ids, labels=ids)
    out.loss.backward()
    ours, theirs = model.model.layers[0].mlp.experts, reference.model.layers[0].mlp.experts
    pairs = [(ours.gate_up_proj.grad, theirs.gate_up_proj.grad), (ours.down_proj.grad, theirs.down_proj.grad)]
    result["local_experts"] = ours.num_experts
    result["logits"] = (out.logits - want.logits).abs().max().item()
    result["grads"] = max((g.full_tensor() - r).abs().max().item() for g, r in pairs)
    args = tiny_training_args(f"{folder}/ep", expert_parallel_size=2)
    result["ep"] = _refusal(lambda: LLMKitTrainer(model=model, args=args))
    return result


def test_transformers_expert_parallelism_runs_our_experts_and_our_parallelism_refuses_theirs(tmp_path):
    result = launch(two_ranks, str(tmp_path), nprocs=2, timeout=300)[0]
    assert result["local_experts"] == 2  # transformers sharded the experts: 4 over 2 ranks
    assert result["logits"] < 1e-5 and result["grads"] < 1e-5, result
    assert "\n" not in result["ep"] and "expert_parallel_size=2 (hf_llmkit's expert parallelism)" in result["ep"]
    assert "transformers already distributed it" in result["ep"] and "drop expert_parallel_size" in result["ep"]
    assert "\n" not in result["sp"] and "the Accelerator's ParallelismConfig(sp_size=2" in result["sp"], result
    assert "sequence_parallel_size=2 (hf_llmkit's Ulysses)" in result["sp"]


@pytest.mark.parametrize(
    "route, expected",
    [
        ("argument", "the parallelism_config argument's ParallelismConfig(sp_size=2, sp_backend='deepspeed')"),
        ("launcher", "accelerate launch's ParallelismConfig(sp_size=2"),
        ("launcher_cp", "accelerate launch's ParallelismConfig(cp_size=2) (torch context parallel)"),
    ],
)
def test_our_sequence_parallelism_refuses_accelerates_in_one_line(tmp_path, monkeypatch, route, expected):
    """Checked in the arguments, before the world size is (our sp=2 on one rank would be refused next)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kwargs = {}
    if route == "argument":
        kwargs["parallelism_config"] = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    else:
        monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
        monkeypatch.setenv(
            "PARALLELISM_CONFIG_CP_SIZE" if route == "launcher_cp" else "PARALLELISM_CONFIG_SP_SIZE", "2"
        )
    with pytest.raises(ValueError) as refused:
        LLMKitTrainingArguments(str(tmp_path), sequence_parallel_size=2, report_to="none", **kwargs)
    message = str(refused.value)
    assert expected in message and "\n" not in message and "keep one" in message
    # without ours, accelerate's own sequence parallelism is left alone
    assert LLMKitTrainingArguments(str(tmp_path), report_to="none", **kwargs).sequence_parallel_size == 1
