"""Ulysses sequence parallelism: loss and gradients equal single-rank training on real gloo ranks (also with
P-tuning v2 prefixes inside, added before or after, with the ALST switches, and for packed documents against the
same documents run one by one); bad input fails.

Each multi-rank test is one launch that checks several configurations (process start-up dominates on CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from peft import get_peft_model
from torch.distributed.device_mesh import init_device_mesh

from hf_llmkit import PTuningV2Config
from hf_llmkit.compat.transformers import configured_attention
from hf_llmkit.parallel import (
    apply_sequence_parallel,
    new_sequence_parallel_groups,
    remove_sequence_parallel,
    sequence_parallel_group,
    sequence_parallel_loss,
    shard_sequence_batch,
)
from hf_llmkit.parallel.sequence import TiledLoss, TiledMLP, offload_saved_activations, sequence_parallel_mean
from hf_llmkit.parallel.sequence.tiled_loss import TARGETS_KWARG
from hf_llmkit.parallel.sequence.ulysses import kv_replication
from hf_llmkit.testing import tiny_llama
from tests.warm import launch

TOL = 1e-5


def make_batch(seq: int, *, seed: int = 1, padding: str = "both") -> dict[str, torch.Tensor]:
    """Two rows: a masked prompt, then left padding on row 0 and right padding on row 1 (as requested)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (2, seq), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    if padding != "none":
        mask = torch.ones_like(ids)
        if padding == "both":
            mask[0, :4] = 0
        mask[1, -3:] = 0
        ids[mask == 0] = 0
        labels[mask == 0] = -100
        batch["attention_mask"] = mask
    return batch


def build(attn: str, kv_heads: int, heads: int, *, ptuning: str | None, group=None, long: bool = False):
    """A tiny Llama; with `ptuning`, P-tuning v2 prefixes added before (`"peft_first"`) or after (`"sp_first"`)
    the Ulysses layer (`group`); without it, just the Ulysses layer (or nothing when `group` is None). `long` adds
    activation checkpointing, the tiled loss and the tiled MLP (chunks that do not divide the shard)."""
    model = tiny_llama(seed=0, num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation=attn)
    model.train()
    if long:
        model.activation_checkpointing_enable()
        TiledLoss(model, chunk_size=3)
        TiledMLP(model, chunk_size=4)
    if group is not None and ptuning != "peft_first":
        apply_sequence_parallel(model, group=group)
    if ptuning is not None:
        torch.manual_seed(1)
        model = get_peft_model(model, PTuningV2Config(num_virtual_tokens=3))
    if group is not None and ptuning == "peft_first":
        apply_sequence_parallel(model, group=group)
    return model


def compare(
    attn: str, kv_heads: int, batch: dict, groups, *, heads: int = 4, ptuning: str | None = None, long: bool = False
):
    """|loss - reference| and max |grad - reference| over the trainable parameters (grads averaged over the world,
    as DDP does). The reference is single-process HF training on every DP group's batch; DDP averages over DP
    groups. With `ptuning`, both are P-tuning v2 models (same prefixes), in the given order of application. With
    `long`, ours also runs the ALST switches (checkpointing, tiled loss and MLP, offload's copy path); the reference
    stays untiled.
    """
    reference = build(attn, kv_heads, heads, ptuning="peft_first" if ptuning else None)
    ref_losses = []
    for dp_rank in range(groups.dp_size):
        own = batch if groups.dp_size == 1 else make_batch(batch["input_ids"].shape[1], seed=dp_rank)
        loss = reference(**own).loss / groups.dp_size
        loss.backward()
        ref_losses.append(loss.item() * groups.dp_size)
    model = build(attn, kv_heads, heads, ptuning=ptuning, group=groups.sp_group, long=long)
    shard = shard_sequence_batch(batch, sp_rank=groups.sp_rank, sp_size=groups.sp_size)
    inputs = {k: shard[k] for k in ("input_ids", "attention_mask", "position_ids") if k in shard}
    targets, group = shard["shift_labels"], groups.sp_group
    if long:
        with offload_saved_activations(include_cpu=True, min_bytes=0):
            total = model(**inputs, **{TARGETS_KWARG: targets}).loss  # this rank's summed token losses
        loss = sequence_parallel_mean(total, targets, group=group)
    else:
        loss = sequence_parallel_loss(model(**inputs).logits, targets, group=group)
    loss.backward()
    worst = 0.0
    pairs = [(r, o) for r, o in zip(reference.parameters(), model.parameters()) if o.requires_grad]
    assert pairs and all(r.shape == o.shape for r, o in pairs)
    for ref, ours in pairs:
        grad = ours.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, (grad / dist.get_world_size() - ref.grad).abs().max().item())
    return abs(loss.item() - ref_losses[groups.dp_rank]), worst


DOCUMENTS = [[5, 7, 4], [9, 7]]  # document lengths packed into each of two rows of 16 tokens


def packed_batch() -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Two rows of packed documents (no attention mask, `position_ids` restarting at each document, the first token
    of each document unlabelled so that no target crosses a boundary) and the documents themselves."""
    g = torch.Generator().manual_seed(5)
    rows, positions, labels, docs = [], [], [], []
    for lengths in DOCUMENTS:
        row = [torch.randint(3, 512, (n,), generator=g) for n in lengths]
        docs += row
        rows.append(torch.cat(row))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        labels.append(torch.cat([torch.cat([torch.tensor([-100]), doc[1:]]) for doc in row]))
    batch = {"input_ids": torch.stack(rows), "position_ids": torch.stack(positions), "labels": torch.stack(labels)}
    return batch, docs


def compare_packed(attn: str, kv_heads: int, groups) -> tuple[float, float]:
    """A packed batch under SP against the same documents run one by one on one rank: |loss diff|, max |grad diff|.
    The reference loss is the token mean over all documents (what the packed batch's loss is)."""
    batch, docs = packed_batch()
    reference = build(attn, kv_heads, 4, ptuning=None)
    targets = sum(len(doc) - 1 for doc in docs)
    total = sum(reference(input_ids=doc[None], labels=doc[None]).loss * (len(doc) - 1) for doc in docs)
    (total / targets).backward()
    model = build(attn, kv_heads, 4, ptuning=None, group=groups.sp_group)
    shard = shard_sequence_batch(batch, sp_rank=groups.sp_rank, sp_size=groups.sp_size)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    loss = sequence_parallel_loss(logits, shard["shift_labels"], group=groups.sp_group)
    loss.backward()
    worst = 0.0
    for ref, ours in zip(reference.parameters(), model.parameters()):
        grad = ours.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, (grad / dist.get_world_size() - ref.grad).abs().max().item())
    return abs(loss.item() - (total / targets).item()), worst


def stacked_cases(groups) -> dict:
    """P-tuning v2 + SP = P-tuning v2 on one rank, in both orders of application (GQA split and replicated); SP +
    the ALST switches = the untiled model on one rank."""
    out = {
        "ptv2_sp_first_gqa_sdpa_padded": compare("sdpa", 2, make_batch(13), groups, ptuning="sp_first"),
        "ptv2_peft_first_gqa_sdpa_padded": compare("sdpa", 2, make_batch(13), groups, ptuning="peft_first"),
        "ptv2_peft_first_replicated_kv_sdpa": compare("sdpa", 1, make_batch(12), groups, ptuning="peft_first"),
        "ptv2_sp_first_mha_eager_right_padded": compare(
            "eager", 4, make_batch(13, padding="right"), groups, ptuning="sp_first"
        ),
        "ptv2_sp_first_no_mask": compare("sdpa", 2, make_batch(12, padding="none"), groups, ptuning="sp_first"),
        "alst_switches_gqa_sdpa_padded": compare("sdpa", 2, make_batch(23), groups, long=True),
        "alst_switches_ptv2_replicated_kv": compare("sdpa", 1, make_batch(22), groups, ptuning="sp_first", long=True),
    }
    return out


def stack_names(groups) -> list[str]:
    """The attention implementation names through adding and removing both layers."""
    model = build("sdpa", 2, 4, ptuning="sp_first", group=groups.sp_group)
    names = [configured_attention(model.config)]
    with model.disable_adapter():
        names.append(configured_attention(model.config))
    names.append(configured_attention(model.config))
    remove_sequence_parallel(model)
    names.append(configured_attention(model.config))
    apply_sequence_parallel(model, group=groups.sp_group)
    base = model.unload()
    names.append(configured_attention(base.config))
    return [name.split("@")[0] for name in names]


def equivalence_two_ranks() -> dict:
    groups = new_sequence_parallel_groups(sp_size=2)
    out = {
        "mha_sdpa_padded": compare("sdpa", 4, make_batch(13), groups),
        "gqa_sdpa_padded": compare("sdpa", 2, make_batch(13), groups),
        "gqa_replicated_kv_sdpa": compare("sdpa", 1, make_batch(12), groups),
        "mha_eager_right_padded": compare("eager", 4, make_batch(13, padding="right"), groups),
        "gqa_eager_left_padded": compare("eager", 2, make_batch(12), groups),
    }
    # rank 1 holds no valid target at all: the loss is still the group's token mean
    batch = make_batch(16, padding="none")
    batch["labels"][:, 7:] = -100
    out["rank_without_tokens"] = compare("sdpa", 2, batch, groups)
    # packed documents (position_ids restart, no mask) stay apart, as when each runs alone
    out["packed_gqa_sdpa"] = compare_packed("sdpa", 2, groups)
    out["packed_mha_eager"] = compare_packed("eager", 4, groups)
    out.update(stacked_cases(groups))
    out["errors"] = error_messages(groups)
    out["errors"]["names"] = stack_names(groups)
    return out


def error_messages(groups) -> dict:
    """Each bad input's ValueError message ('' when nothing was raised)."""
    cases = {
        "heads": lambda: apply_sequence_parallel(
            tiny_llama(num_attention_heads=3, num_key_value_heads=3, hidden_size=48), group=groups.sp_group
        ),
        "kv_heads": lambda: kv_replication(12, 3, 2),
        "short": lambda: shard_sequence_batch(
            {"input_ids": torch.ones(1, 1, dtype=torch.long)}, sp_rank=groups.sp_rank, sp_size=2
        ),
        "implementation": lambda: apply_sequence_parallel(
            tiny_llama(attn_implementation="flex_attention"), group=groups.sp_group
        ),
        "group_and_mesh": lambda: apply_sequence_parallel(tiny_llama(), group=groups.sp_group, mesh=object()),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
            messages[name] = ""
        except ValueError as err:
            messages[name] = str(err)
    model = apply_sequence_parallel(tiny_llama(), group=groups.sp_group)
    wrapped = sequence_parallel_group(model) is groups.sp_group
    remove_sequence_parallel(model)
    messages["round_trip"] = wrapped and configured_attention(model.config) == "sdpa"
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "sp"))
    model = apply_sequence_parallel(tiny_llama(attn_implementation="eager"), mesh=mesh)
    messages["mesh"] = sequence_parallel_group(model) is mesh.get_group("sp")
    return messages


def equivalence_four_ranks() -> dict:
    sp4 = new_sequence_parallel_groups(sp_size=4)
    sp2 = new_sequence_parallel_groups(sp_size=2)
    members = [None] * 4
    dist.all_gather_object(members, (sp2.sp_rank, sp2.dp_rank))
    return {
        "members": members,
        "gqa_replicated_kv_padded": compare("sdpa", 2, make_batch(13), sp4),  # 2 kv heads copied to 4 ranks
        "mha_eager": compare("eager", 4, make_batch(16), sp4),
        "dp2_x_sp2_gqa_padded": compare("sdpa", 2, make_batch(13, seed=sp2.dp_rank), sp2),
    }


def stacked_four_ranks() -> dict:
    sp4 = new_sequence_parallel_groups(sp_size=4)
    sp2 = new_sequence_parallel_groups(sp_size=2)
    return {
        "ptv2_sp_first_replicated_kv_sp4": compare("sdpa", 2, make_batch(13), sp4, ptuning="sp_first"),
        "ptv2_peft_first_dp2_x_sp2": compare("sdpa", 2, make_batch(13, seed=sp2.dp_rank), sp2, ptuning="peft_first"),
        "alst_switches_sp4": compare("sdpa", 2, make_batch(29), sp4, long=True),
    }


def test_two_ranks_match_single_rank_and_reject_bad_input():
    result = launch(equivalence_two_ranks, nprocs=2)[0]
    errors = result.pop("errors")
    for name, (loss_diff, grad_diff) in result.items():
        assert loss_diff < TOL and grad_diff < TOL, (name, loss_diff, grad_diff)
    assert "num_attention_heads=3 is not divisible by sequence_parallel_size=2" in errors["heads"]
    assert "num_key_value_heads=3" in errors["kv_heads"]
    assert "shorter than sequence_parallel_size=2" in errors["short"]
    assert "'flex_attention' cannot be wrapped" in errors["implementation"]
    assert "exactly one of group=" in errors["group_and_mesh"]
    assert errors["round_trip"] is True
    assert errors["mesh"] is True
    assert errors["names"] == [
        "llmkit_ulysses_ptuning_v2_sdpa",
        "llmkit_ulysses_sdpa",  # disable_adapter() takes the prefix layer out, SP stays
        "llmkit_ulysses_ptuning_v2_sdpa",
        "ptuning_v2_sdpa",
        "llmkit_ulysses_sdpa",  # unload() after SP was re-applied outside the prefixes
    ]


@pytest.mark.slow  # 4 ranks (~40 s); the 2-rank test and the composition's SP cells stay in `make test`
def test_four_ranks_match_single_rank_and_dp_x_sp_groups():
    result = launch(equivalence_four_ranks, nprocs=4)[0]
    assert result.pop("members") == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for name, (loss_diff, grad_diff) in result.items():
        assert loss_diff < TOL and grad_diff < TOL, (name, loss_diff, grad_diff)


@pytest.mark.slow
def test_four_ranks_p_tuning_v2_and_alst_switches():
    """The 2-rank test's stacked cases on 4 ranks: replicated kv heads with prefixes, dp 2 x sp 2, tiles on sp 4."""
    for name, (loss_diff, grad_diff) in launch(stacked_four_ranks, nprocs=4)[0].items():
        assert loss_diff < TOL and grad_diff < TOL, (name, loss_diff, grad_diff)


def test_shard_shifts_labels_before_split_and_pads_to_multiple():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
        "labels": torch.tensor([[-100, 6, 7, 8, 9]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1]]),
    }
    shards = [shard_sequence_batch(batch, sp_rank=r, sp_size=2, pad_token_id=0) for r in range(2)]
    assert shards[0]["input_ids"].tolist() == [[5, 6, 7]] and shards[1]["input_ids"].tolist() == [[8, 9, 0]]
    # the target of position 2 (first token of the next shard) survives the split
    assert shards[0]["shift_labels"].tolist() == [[6, 7, 8]]
    assert shards[1]["shift_labels"].tolist() == [[9, -100, -100]]
    assert shards[1]["attention_mask"].tolist() == [[1, 1, 0]]
    assert shards[1]["position_ids"].tolist() == [[3, 4, 5]]
    with pytest.raises(ValueError, match="sp_rank=2 must be in"):
        shard_sequence_batch(batch, sp_rank=2, sp_size=2)


def test_kv_heads_replication_rule():
    assert kv_replication(8, 8, 4) == 1
    assert kv_replication(8, 2, 4) == 2
    assert kv_replication(8, 1, 8) == 8
    with pytest.raises(ValueError, match="one must divide the other"):
        kv_replication(12, 3, 2)


def test_training_arguments_validate_sequence_parallel_size(tmp_path, monkeypatch):
    from hf_llmkit import LLMKitTrainingArguments

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="must be >= 1 and divide the number of ranks"):
        LLMKitTrainingArguments(output_dir=str(tmp_path), sequence_parallel_size=2, report_to="none")
    with pytest.raises(ValueError, match="must be >= 1"):
        LLMKitTrainingArguments(output_dir=str(tmp_path), sequence_parallel_size=0, report_to="none")
