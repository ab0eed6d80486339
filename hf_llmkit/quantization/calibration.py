"""Activation-aware rounding for DKM: GPTQ's error-compensated rounding onto the layers' lookup tables.

k-means fits each table to the weights alone, and nearest-entry rounding ignores which input features matter.
`calibrate(model, batches)` runs the batches through the model with its latent (unclustered) weights, collects each DKM
Linear's input second moments `H = X^T X / n`, and rounds every weight column by column to its nearest table entry
(times its block scale, with `scale_block_size`), the most active input features first, while the columns not yet
rounded absorb the error of the layer's output (GPTQ, Frantar et al. 2023, with its act-order and a lookup table in
place of a uniform grid). The latent weights become the compensated values just before their rounding, so their hard
assignment is that rounding; the tables (and scales) stay as trained, unless `DKMConfig(calibration_refit=True)` first
refits each table by k-means weighting every weight by its share of the output error (SqueezeLLM's sensitivity-weighted
k-means, for post-training use). Each layer keeps its inputs' energy `H_jj` (`importance`), by which DKM's centroid
updates then weigh every weight as that refit does (`H_jj s^2`). The layers go in model order, in chunks whose
moments fit `max_moment_bytes` (float32 `H` is `4 in_features^2` bytes a layer: a LLaMA-7B holds about 28 GB of
them): one pass over the batches per chunk (each batch after the first stops after the chunk's last layer), the
chunks after the first seeing the inputs of the layers already rounded (GPTQ's sequential order). A model whose
moments fit takes one pass. Run it after DKM training:
training from calibrated weights moves the tables away from the rounding they were calibrated for.

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=DKMConfig(bits=3))
    Trainer(model=model, ...).train()
    calibrate(model, [tokenizer(texts, return_tensors="pt")])   # e.g. 128 sequences, as GPTQ uses

`DKMConfig(calibration_samples=N)` does it at the end of every Trainer run, on the first `N` training examples
(`DKMTrainingStateCallback`).

Batches are whole sequences. A sequence-parallel model (`apply_sequence_parallel`) runs each one as every rank's
shard of it (`shard_sequence_batch`) and each layer's moments are taken over the whole sequence, its inputs gathered
over the group: every rank of the group rounds as a single process given the same batches does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from hf_llmkit.compat.torch import version_counter
from hf_llmkit.quantization._dkm import expand_scales, weighted_kmeans_1d
from hf_llmkit.quantization.layers import DKMLinear

DAMP = 0.01  # added to H's diagonal, relative to its mean (GPTQ's dampening)
REFIT_ITERS = 50  # iterations of the weighted k-means of `calibration_refit` (it stops once converged)
MOMENT_BYTES = 1 << 30  # input moments held at once by default (a chunk of layers; one layer may exceed it)
BLOCK = 128  # columns rounded per block before the rest of the weight is updated


class _Shards:
    """A sequence-parallel model's calibration: each batch cut into this rank's shard, each layer input gathered back
    into the whole sequence (padding to a multiple of the group's size dropped)."""

    def __init__(self, group) -> None:
        import torch.distributed as dist

        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)
        self.length = 0  # the whole sequence length of the batch being run

    @classmethod
    def of(cls, model: nn.Module) -> _Shards | None:
        from transformers import PreTrainedModel

        from hf_llmkit.parallel.sequence.ulysses import sequence_parallel_group

        if not any(isinstance(m, PreTrainedModel) for m in model.modules()):
            return None  # attention layers wrap transformers models only
        group = sequence_parallel_group(model)
        return None if group is None else cls(group)

    def shard(self, batch):
        from hf_llmkit.parallel.sequence.data import shard_sequence_batch

        if not isinstance(batch, Mapping):
            batch = {"input_ids": batch}
        batch = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}  # no loss needed
        self.length = batch["input_ids"].shape[1]
        return shard_sequence_batch(batch, sp_rank=self.rank, sp_size=self.size)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[..., S/P, H]` of every rank, as `[..., S, H]`; a flattened `[tokens, H]` input is concatenated."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if x.dim() < 3:
            return torch.cat(parts, dim=0)
        return torch.cat(parts, dim=-2)[..., : self.length, :]


class _ChunkDone(Exception):
    """Raised by `_inputs`' hook once every layer of the chunk has seen this batch's inputs: the rest of the forward
    cannot add to the moments."""


def _inputs(
    model: nn.Module, layers: dict[str, DKMLinear], batches: Iterable, whole: bool = False
) -> dict[str, torch.Tensor]:
    """`H = X^T X / n` (float32) of the inputs of each of `layers` (DKM Linears of `model`) over `batches`; only
    those run with their latent weights, the others with their hard assignment.

    The first batch runs the whole model and counts each layer's calls; every later batch stops (`_ChunkDone`) once
    each layer has had as many calls, at least one, so a chunk early in a deep model costs a fraction of a pass
    (a layer the first batch never reached, such as an expert no token was routed to, keeps later batches whole).
    `whole=True` runs every batch to the end (the same moments, bit for bit)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    shards = _Shards.of(model)
    calls = dict.fromkeys(layers, 0)
    expected: dict[str, int] = {}
    pending = 0  # layers still short of their expected calls in this batch

    last: list = [None, -1, None, 0]  # (input, its version, X^T X, rows): layers fed the same tensor (q/k/v) share it

    def hook(name):
        def record(module, args):
            nonlocal pending
            inp = args[0]
            if inp is not last[0] or version_counter(inp) != last[1]:
                x = inp.detach() if shards is None else shards.gather(inp.detach())  # SP: the whole sequence
                x = x.reshape(-1, x.shape[-1]).float()
                with torch.autocast(x.device.type, enabled=False):  # a Trainer's bf16 autocast wraps model.forward
                    last[:] = [inp, version_counter(inp), x.t() @ x, x.shape[0]]
            product = last[2]
            sums[name] = sums[name].add_(product) if name in sums else product.clone()
            counts[name] = counts.get(name, 0) + last[3]
            calls[name] += 1
            if expected and calls[name] == expected[name]:
                pending -= 1
                if pending == 0 and not whole:
                    raise _ChunkDone

        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    training = model.training
    device = next(model.parameters()).device
    try:
        model.eval()
        for layer in layers.values():
            layer.dense_forward = True
        with torch.no_grad():
            for batch in batches:
                batch = batch if shards is None else shards.shard(batch)
                try:
                    if isinstance(batch, Mapping):
                        model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
                    else:
                        model(batch.to(device))
                except _ChunkDone:
                    pass
                if not expected:
                    expected.update({name: max(1, n) for name, n in calls.items()})
                calls.update(dict.fromkeys(calls, 0))
                pending = len(expected)
    finally:
        last.clear()
        for handle in handles:
            handle.remove()
        for layer in layers.values():
            layer.dense_forward = False
        model.train(training)
    return {name: sums[name] / counts[name] for name in sums}


def factor(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(GPTQ's column order, the upper Cholesky factor of the inverse of the dampened moments in that order) of input
    moments `h` `[cols, cols]`: what the rounding of every layer fed these inputs shares."""
    h = h.float().clone()
    cols = h.shape[0]
    dead = torch.diag(h) == 0  # features never seen: their weights cannot matter
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diag(h), descending=True)  # GPTQ's act-order: the most active inputs first
    h = h[order][:, order]
    h += DAMP * torch.diag(h).mean() * torch.eye(cols, device=h.device)
    return order, torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


@torch.no_grad()
def round_onto_table(
    weight: torch.Tensor,
    table: torch.Tensor,
    h: torch.Tensor,
    scales: torch.Tensor | None = None,
    factored: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The compensated weight `[rows, cols]` whose nearest entries in `table` (`[rows, K]`, each row's own table, or
    `[1, K]`, one for all rows) are GPTQ's rounding under input moments `h` `[cols, cols]` (`factored`: their
    `factor(h)`, computed once for the layers that share them); float32. With `scales` `[rows, cols]` (block scales
    spread over the columns) a weight's candidates are its row's table times its scale: it is rounded as the hard
    assignment does, `w / s` to the nearest entry (a search among the midpoints of the sorted table, a value exactly
    at a midpoint taking the smaller entry). The weight is walked column by column in its transpose, so every column
    the loop reads and updates is contiguous, and each column keeps the value it had when it was rounded."""
    order, u = factor(h) if factored is None else factored
    cols = u.shape[0]
    w = weight.detach().float().t()[order].contiguous()  # [cols, rows], updated in place
    spread = None if scales is None else scales.float().t()[order].contiguous()
    ranked = table.float().sort(dim=1).values  # [rows or 1, K]
    mid = ((ranked[:, 1:] + ranked[:, :-1]) / 2).contiguous()
    shared = ranked.shape[0] == 1
    if shared:
        ranked, mid = ranked[0], mid[0]
    for start in range(0, cols, BLOCK):
        stop = min(start + BLOCK, cols)
        block, u_block = w[start:stop], u[start:stop, start:stop]
        diag = u_block.diagonal().unsqueeze(1)
        absorb = u_block / diag  # row i: what the later columns take of column i's raw error
        errors = torch.empty_like(block)
        columns, raw = block.unbind(0), errors.unbind(0)
        units = None if spread is None else spread[start:stop].unbind(0)
        with _one_thread(w.device):
            for i, col in enumerate(columns):
                unit = col if units is None else col / units[i]
                if shared:
                    nearest = ranked.index_select(0, torch.searchsorted(mid, unit))
                else:
                    nearest = ranked.gather(1, torch.searchsorted(mid, unit.unsqueeze(1))).squeeze(1)
                if units is not None:
                    nearest.mul_(units[i])
                torch.sub(col, nearest, out=raw[i])
                block[i + 1 :].addr_(absorb[i, i + 1 :], raw[i], alpha=-1)  # the later columns absorb the error
        w[stop:].addmm_(u[start:stop, stop:].t(), errors.div_(diag), alpha=-1)
    return w[torch.argsort(order)].t()


@contextmanager
def _one_thread(device: torch.device):
    """One torch thread on CPU for the column loop: its operations are a few thousand elements each, too small to
    share out (a search among the table's midpoints splits from 200 elements), and each one split waits for the other
    threads to be scheduled, milliseconds an operation on a loaded machine."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def refit_tables(layer: DKMLinear, h: torch.Tensor, spread: torch.Tensor | None) -> None:
    """`calibration_refit`: replace `layer`'s tables by k-means of its (normalised) weights, each counted by its share
    of the output error, `H_jj s^2` (its input feature's energy, its block scale squared), from the current tables."""
    w = layer.weight.detach().float()
    energy = torch.diag(h).float().clamp_min(0).expand_as(w)
    units, importance = (w, energy) if spread is None else (w / spread, energy * spread.square())
    groups = layer.settings.groups
    table = weighted_kmeans_1d(
        units.reshape(groups, -1), importance.reshape(groups, -1), layer.centroids[..., 0], REFIT_ITERS
    )
    layer.centroids.copy_(table.unsqueeze(-1))


def check_calibratable(model: nn.Module) -> None:
    """Raise a ValueError naming the fix unless every DKM Linear has scalar tables and whole (unsharded) weights."""
    for name, layer in model.named_modules():
        if not isinstance(layer, DKMLinear):
            continue
        if layer.settings.cluster_dim != 1:
            raise ValueError(
                f"calibrate rounds onto scalar tables; {name!r} has cluster_dim={layer.settings.cluster_dim}: "
                "use cluster_dim=1 or calibration_samples=0."
            )
        if hasattr(layer.weight, "full_tensor") or layer.weight.numel() == 0:
            raise ValueError(
                f"{name!r} is sharded (FSDP2 / ZeRO-3) and calibrate needs whole weights: set "
                "calibration_samples=0 and call hf_llmkit.quantization.calibrate on the gathered model."
            )


def _whole_sequences(collate):
    """`collate` without a sequence-parallel collator's split (calibrate cuts whole sequences itself), also inside a
    Trainer's column-removing wrapper."""
    from hf_llmkit.parallel.sequence.data import SequenceParallelCollator

    if isinstance(collate, SequenceParallelCollator):
        return collate.collator
    inner = getattr(collate, "data_collator", None)
    if isinstance(inner, SequenceParallelCollator):
        collate = copy.copy(collate)
        collate.data_collator = inner.collator
    return collate


def first_examples(dataloader, samples: int, batch_size: int) -> list:
    """Batches of the first `samples` examples of a DataLoader's dataset, in dataset order, collated as it collates
    them, whole sequences (no sampler is touched, so the training order is not disturbed)."""
    dataset, collate = dataloader.dataset, _whole_sequences(dataloader.collate_fn)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        items = [item for _, item in zip(range(samples), dataset)]
    else:
        items = [dataset[i] for i in range(min(samples, len(dataset)))]
    step = max(1, batch_size)
    return [collate(items[i : i + step]) for i in range(0, len(items), step)]


def chunks(layers: dict[str, DKMLinear], max_bytes: int) -> list[dict[str, DKMLinear]]:
    """`layers` in order, cut into runs whose float32 input moments take at most `max_bytes` (a layer alone may)."""
    out: list[dict[str, DKMLinear]] = []
    size = 0
    for name, layer in layers.items():
        need = 4 * layer.in_features**2
        if not out or size + need > max_bytes:
            out.append({})
            size = 0
        out[-1][name] = layer
        size += need
    return out


def calibrate(model: nn.Module, batches: Iterable, max_moment_bytes: int = MOMENT_BYTES) -> int:
    """Move the latent weights of every DKM Linear of `model` to GPTQ's rounding onto their tables, under the input
    moments of `batches` (model keyword dicts such as a tokenizer's output, or input-id tensors); returns the number
    of layers. At most `max_moment_bytes` of moments are held at once (one pass over `batches` per chunk of layers
    that fits, each batch after the first stopping after the chunk's last layer). Scalar tables only
    (`cluster_dim=1`); before any sharding (FSDP2, ZeRO-3)."""
    check_calibratable(model)
    if max_moment_bytes <= 0:
        raise ValueError(f"calibrate's max_moment_bytes must be > 0 (try {MOMENT_BYTES}), got {max_moment_bytes!r}.")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, DKMLinear)}
    batches = list(batches)  # one pass per chunk
    done = 0
    for chunk in chunks(layers, max_moment_bytes):
        moments = _inputs(model, chunk, batches)
        shared: tuple = (None, None)  # (moments, their factor): q/k/v (gate/up) see the same inputs
        for name, h in moments.items():
            layer = chunk[name]
            rows = layer.weight.shape[0]
            device = layer.weight.device
            scales = layer.lookup_scales()
            spread = None if scales is None else expand_scales(scales, layer.weight.shape[1]).to(device)
            if layer.settings.config.calibration_refit:
                refit_tables(layer, h.to(device), spread)
            table = layer.lookup_table()[..., 0]  # [G, K]: one table for all rows stays [1, K]
            if table.shape[0] > 1:
                table = table.repeat_interleave(rows // table.shape[0], 0)
            if shared[0] is None or not torch.equal(shared[0], h):
                shared = (h, factor(h.to(device)))
            new = round_onto_table(layer.weight, table.to(device), h.to(device), spread, shared[1])
            with torch.no_grad():  # in place: the version counter moves, so cached hard weights are rebuilt
                layer.weight.copy_(new.to(layer.weight.dtype))
            layer.start = "calibrated"  # training keeps its scales; DKM's iterations weigh by the importance:
            layer.importance = torch.diag(h).float().clamp_min(0).to(device)  # H_jj, as `refit_tables` counts it
        done += len(moments)
    if not done:
        raise ValueError("calibrate got no batches, or none reached a DKM layer: pass model inputs.")
    return done
