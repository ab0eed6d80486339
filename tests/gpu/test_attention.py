"""Attention kernels on CUDA: P-tuning v2 prefixes over sdpa's fused kernels and flash-attention (when installed),
and Ulysses sequence parallelism (with and without the prefixes) on 2 GPUs over NCCL.

CPU counterparts: tests/tuners/test_ptuning_v2.py (sdpa == eager == a KV-cache reference) and
tests/parallel/test_sequence.py (sequence parallel == one rank, on gloo ranks).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from peft import get_peft_model
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_llmkit import PTuningV2Config
from hf_llmkit.compat.transformers import configured_attention
from hf_llmkit.parallel import new_sequence_parallel_groups, sequence_parallel_loss, shard_sequence_batch
from hf_llmkit.testing import distributed_backend, launch, tiny_llama
from tests.parallel.test_sequence import build, make_batch

pytestmark = pytest.mark.gpu

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])  # row 0 left-padded


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; inf when not finite (a NaN would otherwise pass `max(...)` and `<` checks unseen)."""
    value = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    return value if math.isfinite(value) else math.inf


def prefix_run(implementation: str, *, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the prefix gradients of a P-tuning v2 tiny Llama (the same weights for every implementation)."""
    model = tiny_llama(attn_implementation=implementation)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, PTuningV2Config(num_virtual_tokens=3)).to(device=device, dtype=dtype)
    assert configured_attention(peft_model.config) == f"ptuning_v2_{implementation}"
    logits = peft_model(input_ids=IDS.to(device), attention_mask=MASK.to(device)).logits
    logits.float().square().mean().backward()
    grads = [p.grad.flatten() for p in peft_model.parameters() if p.requires_grad]
    return logits.detach()[MASK.bool()], torch.cat(grads)


def test_ptuning_v2_sdpa_equals_eager_on_cuda_in_fp32():
    eager_logits, eager_grad = prefix_run("eager", device="cuda", dtype=torch.float32)
    sdpa_logits, sdpa_grad = prefix_run("sdpa", device="cuda", dtype=torch.float32)
    assert rel(sdpa_logits, eager_logits) < 1e-4 and rel(sdpa_grad, eager_grad) < 1e-4


def test_ptuning_v2_on_sdpas_memory_efficient_kernel_in_bf16():
    """Only the fused kernel is allowed (the prefixes need an explicit mask, which sdpa's flash kernel does not take):
    a mask or shape it cannot handle fails instead of falling back to the math kernel."""
    eager_logits, eager_grad = prefix_run("eager", device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        logits, grad = prefix_run("sdpa", device="cuda", dtype=torch.bfloat16)
    assert rel(logits, eager_logits) < 3e-2 and rel(grad, eager_grad) < 5e-2  # bf16: 8 significant bits


def test_ptuning_v2_on_flash_attention_2_in_bf16():
    pytest.importorskip("flash_attn", reason="flash-attention is not installed (`pip install flash-attn`)")
    eager_logits, eager_grad = prefix_run("eager", device="cuda", dtype=torch.bfloat16)
    logits, grad = prefix_run("flash_attention_2", device="cuda", dtype=torch.bfloat16)
    assert rel(logits, eager_logits) < 3e-2 and rel(grad, eager_grad) < 5e-2


def sp_matches_one_rank(attn: str, dtype_name: str) -> dict[str, tuple[float, float]]:
    """On each rank (its own GPU when there is one): (relative loss difference, relative gradient difference) of
    sequence parallel 2 against the same model on one rank, without and with P-tuning v2 prefixes."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    groups = new_sequence_parallel_groups(sp_size=2)
    batch = make_batch(14)
    out = {}
    for ptuning in (None, "sp_first", "peft_first"):
        reference = build(attn, 2, 4, ptuning="peft_first" if ptuning else None).to(device=device, dtype=dtype)
        ref_loss = reference(**{k: v.to(device) for k, v in batch.items()}).loss
        ref_loss.backward()
        model = build(attn, 2, 4, ptuning=ptuning, group=groups.sp_group).to(device=device, dtype=dtype)
        shard = shard_sequence_batch(batch, sp_rank=groups.sp_rank, sp_size=groups.sp_size)
        inputs = {k: shard[k].to(device) for k in ("input_ids", "attention_mask", "position_ids") if k in shard}
        loss = sequence_parallel_loss(model(**inputs).logits, shard["shift_labels"].to(device), group=groups.sp_group)
        loss.backward()
        worst = 0.0
        for ref, ours in zip(reference.parameters(), model.parameters()):
            if ours.requires_grad:
                grad = ours.grad.float().clone()
                dist.all_reduce(grad)  # what DDP does: the ranks' gradients averaged
                worst = max(worst, rel(grad / dist.get_world_size(), ref.grad))
        out[str(ptuning)] = (abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), worst)
    return out


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices for 2 NCCL ranks, found {torch.cuda.device_count()}")


def _cuda_all_reduce() -> tuple[str, str, float]:
    value = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(value)
    return dist.get_backend(), str(value.device), value[0].item()


def test_launch_uses_nccl_with_a_gpu_per_rank():
    _two_gpus()
    assert distributed_backend(2) == "cpu:gloo,cuda:nccl"
    results = launch(_cuda_all_reduce, nprocs=2, timeout=180)
    assert [(device, value) for _, device, value in results] == [("cuda:0", 3.0), ("cuda:1", 3.0)]
    assert all("nccl" in backend for backend, _, _ in results)


@pytest.mark.parametrize(("attn", "dtype", "tol"), [("sdpa", "float32", 1e-4), ("sdpa", "bfloat16", 5e-2)])
def test_sequence_parallel_on_two_gpus_matches_one(attn, dtype, tol):
    _two_gpus()
    for name, (loss_diff, grad_diff) in launch(sp_matches_one_rank, attn, dtype, nprocs=2, timeout=300)[0].items():
        assert loss_diff < tol and grad_diff < tol, (name, loss_diff, grad_diff)


def test_sequence_parallel_on_flash_attention_2_matches_one():
    _two_gpus()
    pytest.importorskip("flash_attn", reason="flash-attention is not installed (`pip install flash-attn`)")
    results = launch(sp_matches_one_rank, "flash_attention_2", "bfloat16", nprocs=2, timeout=300)[0]
    for name, (loss_diff, grad_diff) in results.items():
        assert loss_diff < 5e-2 and grad_diff < 5e-2, (name, loss_diff, grad_diff)
