"""DKM's centroids advance once per optimizer step, and that state travels with training checkpoints.

A DKM layer's training forward runs a few differentiable k-means iterations and keeps the refined centroids (DKM
warm-starts every step from the last table). Every forward between two weight updates (gradient accumulation's
micro-batches, the recomputed forward of gradient checkpointing) must start from the same table, or accumulating
two half-batches is not one batch (each micro-batch would iterate further) and a recomputed forward differs from
the one whose loss was taken. So a layer remembers its step: the centroids the step started from and a fingerprint
of its weights, their exact per-group mean and standard deviation (equal across forwards of unchanged weights, also
when FSDP2 gathers them into fresh memory each time, where address and version counter cannot tell). Weights that
changed, or centroids written by anything but the layer's own forward (a load, `init_centroids`), start a new step.

A Trainer checkpoint (`keep_training_state`) stores the step as `step_start` + `step_key` next to `weight` and
`centroids`, so a resumed run makes the same choice as the uninterrupted one even after a step that left the weights
unchanged (a zero learning rate in warm-up, an fp16 step skipped on overflow), and where the layer's table and block
scales came from (`start_kind`, one of `STARTS`: see `layers._Clustered.start`), so a resumed run keeps or recomputes
its scales as the uninterrupted one does, and the input importance DKM's centroid updates weigh the weights by
(`importance`, `[in_features]`, where `calibrate` set one; a training checkpoint without it loads as uniform).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_llmkit.compat.torch import version_counter

# Where a layer's table and block scales came from: its own k-means of the weights (the only start whose block scales
# a training forward recomputes from the latent weights), a checkpoint, or `calibrate` (a table DKM's centroid
# iterations keep only weighted by the layer's importance).
STARTS = ("kmeans", "loaded", "calibrated")
START_NAME = "start_kind"
IMPORTANCE_NAME = "importance"
# what a training checkpoint holds per layer besides its tensors
STEP_NAMES = ("step_start", "step_key", START_NAME, IMPORTANCE_NAME)


@dataclass
class Step:
    """A layer's current optimizer step: weights' fingerprint, the table it started from, the (version, address) of
    the centroid buffer as the layer's forward last wrote it (None: not written since the step was restored)."""

    key: torch.Tensor
    start: torch.Tensor
    written: tuple[int, int] | None = None


def fingerprint(vectors: torch.Tensor) -> torch.Tensor:
    """`[2G]`: per-group mean and standard deviation of `[G, n, d]` weight vectors, in float32."""
    v = vectors.detach().reshape(vectors.shape[0], -1).float()
    return torch.cat([v.mean(1), v.std(1)])  # two reductions: several times faster than std_mean's single pass


def _buffer_id(centroids: torch.Tensor) -> tuple[int, int]:
    return version_counter(centroids), centroids.data_ptr()


def start_of_step(layer, vectors: torch.Tensor) -> torch.Tensor:
    """The table this forward's iterations start from (opening a new step when the weights or the table changed)."""
    key, step = fingerprint(vectors), layer.dkm_step
    if step is not None and step.written is None:  # restored from a checkpoint: the loaded table is the step's own
        step.written = _buffer_id(layer.centroids)
    if step is None or step.written != _buffer_id(layer.centroids) or not torch.equal(step.key, key):
        layer.dkm_step = step = Step(key, layer.centroids.detach().clone())
    return step.start


def finish_forward(layer, refined: torch.Tensor) -> None:
    """Keep the forward's refined table (the start of the next step)."""
    with torch.no_grad():
        layer.centroids.copy_(refined.detach())
    layer.dkm_step.written = _buffer_id(layer.centroids)


def step_state(layer, prefix: str) -> dict[str, torch.Tensor]:
    """The step's tensors for a training checkpoint (the step's none before the first training forward), the layer's
    start kind and its importance (where it has one)."""
    state = {prefix + START_NAME: torch.tensor(STARTS.index(layer.start), dtype=torch.int8)}
    if getattr(layer, "importance", None) is not None:
        state[prefix + IMPORTANCE_NAME] = layer.importance.detach().clone()
    step = layer.dkm_step
    if step is None:
        return state
    return {**state, prefix + "step_start": step.start.clone(), prefix + "step_key": step.key.clone()}


def take_step_state(layer, state_dict: dict, prefix: str) -> None:
    """From a load-state-dict pre-hook: pop a checkpoint's step tensors and restore the step (checked), the start
    kind (training tensors without one, such as another model's `state_dict()`, are a start "loaded") and the
    importance (training tensors without one: uniform)."""
    start, key, kind, importance = (state_dict.pop(prefix + name, None) for name in STEP_NAMES)
    if importance is not None:
        want = (layer.weight.shape[1],)
        valid = bool(torch.isfinite(importance).all()) and not bool((importance < 0).any())
        if tuple(importance.shape) != want or not valid:
            raise ValueError(
                f"{prefix + IMPORTANCE_NAME!r} (shape {tuple(importance.shape)}) is not a finite, non-negative tensor "
                f"of shape {want}: the checkpoint is corrupt; restore it from a good copy."
            )
        layer.importance = importance.detach().float().to(layer.weight.device)
    elif kind is not None or prefix + "centroids" in state_dict:
        layer.importance = None
    if kind is not None:
        if kind.numel() != 1 or not 0 <= int(kind) < len(STARTS):
            raise ValueError(
                f"{prefix + START_NAME!r} ({kind.tolist()}) is no index into {STARTS}: the checkpoint is corrupt; "
                "restore it from a good copy."
            )
        layer.start = STARTS[int(kind)]
    elif prefix + "centroids" in state_dict:
        layer.start = "loaded"
    layer.dkm_step = None
    if start is None and key is None:
        return
    shape, groups = tuple(layer.centroids.shape), layer.centroids.shape[0]
    for name, tensor, want in (("step_start", start, shape), ("step_key", key, (2 * groups,))):
        if tensor is None or tuple(tensor.shape) != want or not bool(torch.isfinite(tensor).all()):
            found = "missing" if tensor is None else f"shape {tuple(tensor.shape)}"
            raise ValueError(
                f"{prefix + name!r} ({found}) is not a finite tensor of shape {want}: the checkpoint is corrupt; "
                "restore it from a good copy."
            )
    layer.dkm_step = Step(key.float().to(layer.centroids.device), start.float().to(layer.centroids.device))
