"""Long sequences (ALST): tiled loss, tiled MLP and activation-checkpoint offload give the loss and gradients of the
untiled model (fp32, 1e-5), never build the full `[S, vocab]` / `[S, intermediate]` tensors, refuse what they cannot
do, and train through `LLMKitTrainer` exactly like the plain Trainer (single rank; SP=2 is in test_sequence.py and
test_sequence_trainer.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import default_data_collator

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.args import offload_pins_host_memory
from hf_llmkit.parallel.sequence import TiledLoss, TiledMLP, offload_saved_activations
from hf_llmkit.parallel.sequence.tiled_loss import TARGETS_KWARG
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import LLMKitTrainer

TOL = 1e-5


def batch(seq: int = 29) -> dict[str, torch.Tensor]:
    """Two rows: a masked prompt, right padding on row 1."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (2, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def tiled_step(model, data: dict, *, offload: bool) -> torch.Tensor:
    targets = F.pad(data["labels"][:, 1:], (0, 1), value=-100)
    inputs = {k: v for k, v in data.items() if k != "labels"}
    context = offload_saved_activations(include_cpu=True, min_bytes=0) if offload else torch.enable_grad()
    with context:
        total = model(**inputs, **{TARGETS_KWARG: targets}).loss
    loss = total / (targets != -100).sum()
    loss.backward()
    return loss


def test_tiled_loss_mlp_checkpointing_and_offload_equal_the_untiled_model():
    data = batch()
    reference = tiny_llama().train()
    ref_loss = reference(**data).loss
    ref_loss.backward()
    expected = grads(reference)
    for checkpointing, offload in itertools.product([False, True], repeat=2):
        model = tiny_llama().train()
        if checkpointing:
            model.activation_checkpointing_enable()
        TiledLoss(model, chunk_size=5)  # 29 positions: 6 chunks, the last one short
        TiledMLP(model, chunk_size=7)
        loss = tiled_step(model, data, offload=offload)
        got = grads(model)
        assert got.keys() == expected.keys()
        worst = max((got[k] - expected[k]).abs().max().item() for k in got)
        assert abs(loss.item() - ref_loss.item()) < TOL and worst < TOL, (checkpointing, offload, worst)


def moe_step(blocks: str, *, tiled: bool) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """One forward + backward of an upcycled tiny Llama (transformers' blocks, or `MoELayer`s) with the MoE losses
    as `LLMKitTrainer` adds them; with `tiled`, checkpointed layers and the MLP in chunks of 7 of 29 positions.
    Returns the loss, the balancing and z-losses of a second forward after the backward, and the gradients."""
    from hf_llmkit.parallel import upcycle_to_moe, use_moe_layers
    from hf_llmkit.parallel.moe.routing_stats import watch_native_routers
    from hf_llmkit.trainers.moe_loss import MoELossTracker

    model = upcycle_to_moe(tiny_llama(), num_experts=4, top_k=2).train()
    with torch.no_grad():  # a router that prefers some experts, experts that differ
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    if blocks == "moe_layer":
        use_moe_layers(model)  # dropless
    if tiled:
        model.activation_checkpointing_enable()
        TiledMLP(model, chunk_size=7)
    watch_native_routers(model)  # what LLMKitTrainer does for transformers' blocks
    tracker, data = MoELossTracker(aux_loss_coef=0.5, z_loss_coef=0.25), batch()
    tracker.begin_forward(model)
    loss = tracker.add_aux_losses(model, model(**data).loss)
    loss.backward()
    first = tracker.logs()
    tracker.begin_forward(model)  # what the backward's recomputation recorded is forgotten
    with torch.no_grad():
        tracker.add_aux_losses(model, model(**data).loss)
    second = tracker.logs()
    losses = [log[name] for log in (first, second) for name in ("moe_aux_loss", "moe_z_loss")]
    return loss.item(), losses, grads(model)


@pytest.mark.parametrize("blocks", ["native", "moe_layer"])
def test_tiled_mlp_tiles_dropless_moe_blocks_exactly(blocks):
    """Dropless routing is per token: chunks give the block's output, and the losses of all chunks' routing are the
    losses of the whole sequence (not the last chunk's, nor a mean of per-chunk losses)."""
    ref_loss, ref_aux, expected = moe_step(blocks, tiled=False)
    loss, aux, got = moe_step(blocks, tiled=True)
    assert got.keys() == expected.keys()
    worst = max((got[k] - expected[k]).abs().max().item() for k in got)
    assert abs(loss - ref_loss) < TOL and worst < TOL, (loss, ref_loss, worst)
    assert aux == pytest.approx(ref_aux, abs=TOL) and aux[:2] == pytest.approx(aux[2:], abs=TOL)


class LargestOutputs(TorchDispatchMode):
    """The largest tensor every operator produced, per size of the last dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim():
                self.largest[t.shape[-1]] = max(self.largest.get(t.shape[-1], 0), t.numel())
        return out


def test_tiles_never_build_the_full_logits_or_mlp_activations():
    """512 positions, vocab 512, intermediate 128: no tensor of 512 x 512 logits or 512 x 128 activations, ever."""
    model = tiny_llama(max_position_embeddings=1024).train()
    model.activation_checkpointing_enable()
    TiledLoss(model, chunk_size=64)
    TiledMLP(model, chunk_size=32)
    data = {k: v[:1] for k, v in batch(512).items()}
    with LargestOutputs() as seen:
        tiled_step(model, data, offload=False)
    assert seen.largest[512] <= 64 * 512  # vocab-wide tensors: one chunk of logits (or the [V, H] weight grad)
    assert seen.largest[128] <= 512 * 64  # intermediate-wide: the [I, H] weight grad at most, never [S, I]
    with LargestOutputs() as seen:
        tiny_llama(max_position_embeddings=1024).train()(**data).loss.backward()
    assert seen.largest[512] >= 511 * 512 and seen.largest[128] >= 511 * 128  # the untiled model does build them


def test_offload_copies_checkpoint_inputs_and_never_parameters():
    data = batch()
    copied = {}
    for checkpointing in (False, True):
        model = tiny_llama().train()
        if checkpointing:
            model.activation_checkpointing_enable()
        TiledLoss(model, chunk_size=5)
        with offload_saved_activations(include_cpu=True, min_bytes=0) as offload:
            tiled_step(model, data, offload=False)
        copied[checkpointing] = offload.copied_bytes
    hidden = data["input_ids"].numel() * 64 * 4  # one [B, S, H] fp32 tensor
    assert 0 < copied[True] < copied[False] / 4  # with checkpointing only what lives between layers is saved
    assert copied[True] < 8 * hidden  # 2 layer inputs + what the final norm saves (~6 hidden-sized): no weights
    weight = torch.nn.Parameter(torch.ones(256, 256))
    with offload_saved_activations(include_cpu=True, min_bytes=0) as offload:
        (torch.ones(4, 256, requires_grad=True) @ weight.t()).sum().backward()
    assert offload.copied_bytes == 4 * 256 * 4  # the input was copied, the weight (and its transpose) were not
    with offload_saved_activations() as offload:  # default: CPU tensors stay put (a no-op without an accelerator)
        tiny_llama().train()(**data).loss.backward()
    assert offload.copied_bytes == 0


def test_what_tiling_cannot_do_is_refused_with_the_fix():
    from transformers import Gemma2Config, Gemma2ForCausalLM, MixtralConfig, MixtralForCausalLM

    from hf_llmkit.parallel import use_moe_layers

    moe = MixtralForCausalLM(
        MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    )  # fmt: skip
    use_moe_layers(moe, capacity_factor=1.0)
    with pytest.raises(ValueError, match="capacity_factor=1.0: the capacity is per call.*turn tiled_mlp off"):
        TiledMLP(moe)
    with pytest.raises(ValueError, match="found no decoder-layer MLP"):
        TiledMLP(torch.nn.Linear(2, 2))
    capped = Gemma2ForCausalLM(
        Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=16,
                     num_attention_heads=2, num_key_value_heads=1, final_logit_softcapping=3.0)
    ).train()  # fmt: skip
    TiledLoss(capped, chunk_size=4)
    ids = torch.randint(0, 64, (1, 9))
    with pytest.raises(ValueError, match="post-processes its logits.*turn tiled_loss off"):
        capped(input_ids=ids, **{TARGETS_KWARG: ids})
    plain = tiny_llama()
    TiledLoss(plain, chunk_size=4)
    with pytest.raises(ValueError, match="either labels or llmkit_loss_targets"):
        plain(input_ids=ids, labels=ids, **{TARGETS_KWARG: ids})
    with pytest.raises(ValueError, match="needs a transformers causal LM"):
        TiledLoss(torch.nn.Linear(2, 2), chunk_size=4)


def test_training_arguments_validate_the_switches(tmp_path):
    def make(**kwargs):
        return LLMKitTrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)

    with pytest.raises(ValueError, match="needs checkpointing: add --gradient_checkpointing true"):
        make(offload_activation_checkpoints=True)
    with pytest.raises(ValueError, match="tiled_loss_chunk_size must be >= 1"):
        make(tiled_loss=True, tiled_loss_chunk_size=0)
    with pytest.raises(ValueError, match="tiled_mlp_chunk_size must be >= 1"):
        make(tiled_mlp=True, tiled_mlp_chunk_size=-1)
    args = make(offload_activation_checkpoints=True, gradient_checkpointing=True, tiled_loss=True)
    assert args.offload_activation_checkpoints and args.tiled_loss and not args.tiled_mlp
    if offload_pins_host_memory():
        assert args.activation_checkpointing_kwargs == {"offload": True}  # transformers' per-checkpoint offload
    else:  # no accelerator: nothing to move, and transformers' offload would pin host memory
        assert not (args.activation_checkpointing_kwargs or {}).get("offload")
    with pytest.raises(ValueError, match="activation_checkpointing_kwargs offload=False contradict each other"):
        make(offload_activation_checkpoints=True, activation_checkpointing=True,
             activation_checkpointing_kwargs={"offload": False})  # fmt: skip


def test_offload_pins_host_memory_only_where_pinned_memory_exists():
    """The decision `offload_activation_checkpoints` rests on: pinned host memory exists with an accelerator only. On
    a CPU-only torch build pinning raises "pin_memory=True requires a CUDA or other accelerator backend"; on a CUDA
    build without a GPU "Found no NVIDIA driver"."""
    assert offload_pins_host_memory() == torch.accelerator.is_available()
    if offload_pins_host_memory():
        assert torch.empty(4, pin_memory=True).is_pinned()
    else:
        with pytest.raises(RuntimeError):
            torch.empty(4, pin_memory=True)


def test_offload_flag_trains_where_torch_has_no_accelerator(tmp_path, monkeypatch, caplog):
    """A CPU-only torch build reports no current accelerator, so transformers' offload pins host memory "for the
    cpu" and the first checkpointed layer raises (run_clm.py died after training started). Without an accelerator the
    flag says so in one log line and checkpoints without offload: training runs, as the plain trainer does."""
    if torch.accelerator.is_available():
        pytest.skip("with an accelerator the offload pins host memory (test_offload_on_cuda_... below)")
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "get_current_accelerator", lambda: None)  # a CPU-only build
    plain, plain_losses, _ = train(tmp_path)
    with caplog.at_level("WARNING", logger="hf_llmkit.args"):
        offloaded, losses, _ = train(tmp_path, gradient_checkpointing=True, offload_activation_checkpoints=True)
    assert [r.getMessage() for r in caplog.records if "activation offload" in r.getMessage()] == [
        "activation offload: no accelerator, so activations already live in host memory; checkpointing without "
        "offload (it pins host memory, which needs an accelerator)"
    ]
    assert losses == pytest.approx(plain_losses, abs=TOL)
    assert max((offloaded[n] - p).abs().max().item() for n, p in plain.items()) < TOL


def test_the_offload_the_flag_asks_for_moves_each_checkpointed_layers_input_only():
    """What `offload_activation_checkpoints` turns on (transformers' `offload=True`) copies 2 layer inputs of a
    2-layer model per step; `offload_saved_activations` around the whole forward moves far more (the logits...)."""
    if torch.accelerator.current_accelerator() is None:  # a CPU-only torch build (a CUDA build names cuda)
        pytest.skip("transformers' offload=True pins host memory, which CPU-only torch builds cannot (the flag skips)")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from areas.parallel.offload_bytes import moved_bytes

    data = batch()

    def step(offload: bool = False, around=None) -> None:
        model = tiny_llama().train()
        model.activation_checkpointing_enable(offload=offload)
        with around if around is not None else torch.enable_grad():
            loss = model(**data).loss
        loss.backward()

    layer_input = data["input_ids"].numel() * 64 * 4  # [B, S, H] fp32
    assert moved_bytes(step, lambda: step(offload=True)) == 2 * layer_input
    whole = moved_bytes(step, lambda: step(around=offload_saved_activations(include_cpu=True, min_bytes=0)))
    assert whole > 8 * layer_input


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    """Training rows of 21 tokens, every other one right-padded."""
    data, out = batch(21), []
    for i in range(n):
        row = {k: v[i % 2].clone() for k, v in data.items()}
        row["input_ids"] = (row["input_ids"] + i) % 500 + 3
        row["labels"] = torch.where(row["labels"] == -100, -100, row["input_ids"])
        out.append(row)
    return out


def train(tmp_path, **switches) -> tuple[dict, list[float], float]:
    args = LLMKitTrainingArguments(
        output_dir=str(tmp_path / ("tiled" if switches else "plain")), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none",
        train_sampling_strategy="sequential", prediction_loss_only=True, disable_tqdm=True, seed=0, **switches,
    )  # fmt: skip
    trainer = LLMKitTrainer(
        model=tiny_llama().train(), args=args, train_dataset=rows(8), eval_dataset=rows(4),
        data_collator=default_data_collator,
    )  # fmt: skip
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return params, losses, trainer.evaluate()["eval_loss"]


def test_trainer_with_every_switch_trains_like_the_plain_trainer(tmp_path):
    """Gradient accumulation (num_items_in_batch), padding, evaluation: same parameters, losses, eval loss."""
    plain, plain_losses, plain_eval = train(tmp_path)
    switches = dict(tiled_loss=True, tiled_loss_chunk_size=4, tiled_mlp=True, tiled_mlp_chunk_size=5)
    tiled, losses, eval_loss = train(
        tmp_path, gradient_checkpointing=True, offload_activation_checkpoints=True, **switches
    )
    assert max((tiled[n] - p).abs().max().item() for n, p in plain.items()) < TOL
    assert losses == pytest.approx(plain_losses, abs=TOL) and eval_loss == pytest.approx(plain_eval, abs=TOL)


@pytest.mark.gpu
def test_offload_on_cuda_moves_checkpoint_inputs_to_pinned_host_memory_and_keeps_gradients():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: on CPU the offload hooks run but copy nothing (tested above)")
    data = {k: v.cuda() for k, v in batch().items()}
    reference = tiny_llama().cuda().train()
    reference(**data).loss.backward()
    model = tiny_llama().cuda().train()
    model.activation_checkpointing_enable()
    TiledLoss(model, chunk_size=5)
    TiledMLP(model, chunk_size=7)
    with offload_saved_activations(min_bytes=0) as offload:
        tiled_step(model, data, offload=False)
    assert offload.copied_bytes > 0
    worst = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    assert worst < TOL
