"""What every exporter needs: the palettized weights of a DKM model, a traceable dense twin, a causal wrapper.

`palettized_weights(model)` reads the packed indices, lookup table and block scales of every DKM layer, from a
reloaded compact checkpoint (`PalettizedLinear` / `PalettizedEmbedding` buffers) or a live model (`DKMLinear` /
`DKMEmbedding`, through their `export()`, what `save_pretrained` writes); `PaletteWeight.decoded()` is the weight our
layers compute (`_dkm.decode`), the reference every export is checked against bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization._packing import unpack_indices
from hf_llmkit.quantization.layers import DKMEmbedding, DKMLinear
from hf_llmkit.quantization.palettized import PalettizedEmbedding, PalettizedLinear

EXPORT_ATTENTION = "llmkit_export_causal"
_DKM_LAYERS = (PalettizedLinear, PalettizedEmbedding, DKMLinear, DKMEmbedding)


@dataclass
class PaletteWeight:
    """One clustered weight `[rows, cols]`: packed `bits`-bit indices, a table `[G, K, d]` per group of rows and the
    block scales `[rows, cols / block]` (None without), tables and scales in the checkpoint's `lut_dtype`."""

    name: str  # the module's path in the model
    kind: str  # "linear" or "embedding"
    shape: tuple[int, int]
    bits: int
    packed: torch.Tensor
    lut: torch.Tensor
    scale: torch.Tensor | None

    @property
    def groups(self) -> int:
        return self.lut.shape[0]

    @property
    def cluster_dim(self) -> int:
        return self.lut.shape[2]

    @property
    def count(self) -> int:
        return self.shape[0] * self.shape[1] // self.cluster_dim

    def indices(self) -> torch.Tensor:
        """Table index of every weight vector, `[rows, cols / d]` (int64): group g holds rows g*rows/G onwards."""
        return unpack_indices(self.packed, self.bits, self.count).reshape(self.shape[0], -1)

    def decoded(self) -> torch.Tensor:
        """The float32 weight our layers compute from these tensors (`_dkm.decode`)."""
        idx = self.indices().reshape(self.groups, -1)
        return dkm.decode(self.lut, idx, self.shape, None if self.scale is None else self.scale.float())


def palettized_weights(model: nn.Module, *, caller: str = "export") -> list[PaletteWeight]:
    """The palettized weight of every DKM layer of `model`, in module order; a ValueError when it has none."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, _DKM_LAYERS):
            continue
        kind = "linear" if isinstance(module, PalettizedLinear | DKMLinear) else "embedding"
        if isinstance(module, DKMLinear | DKMEmbedding):
            saved = module.export()
            shape = tuple(module.weight.shape)
        else:
            saved = {"weight_packed": module.weight_packed, "weight_lut": module.weight_lut}
            saved["weight_scale"] = module.weight_scale
            shape = tuple(module.weight_shape)
        bits = module.settings.bits
        found.append(
            PaletteWeight(
                name,
                kind,
                shape,
                bits,
                saved["weight_packed"].detach().cpu(),
                saved["weight_lut"].detach().cpu(),
                _cpu(saved.get("weight_scale")),
            )
        )
    if not found:
        raise ValueError(
            f"{caller}: the model has no DKM layers (DKMLinear / PalettizedLinear ...): quantize it with "
            "quantization_config=DKMConfig(...) or load a saved DKM checkpoint with from_pretrained."
        )
    return found


def _cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().cpu()


def check_causal_lm(model: nn.Module, caller: str) -> None:
    """The exporters take a transformers causal LM (input_ids -> logits) whose attention they can swap."""
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise ValueError(
            f"{caller}: expected a transformers causal LM (e.g. AutoModelForCausalLM.from_pretrained(<DKM "
            f"checkpoint>)), got {type(model).__name__}."
        )
    if any(type(m).__module__.startswith("hf_llmkit.parallel.moe") for m in model.modules()):
        raise ValueError(
            f"{caller}: the model holds hf_llmkit MoELayer blocks (a live upcycled model), whose dropless dispatch "
            "does not trace: save it with save_pretrained and export AutoModelForCausalLM.from_pretrained(<folder>) "
            "(transformers' native MoE class)."
        )


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with standard ops only (key/value heads repeated by expand + reshape,
    `F.scaled_dot_product_attention`), the kernel of the exported programs: causal over unpadded sequences without
    a mask, else the additive 4-D mask `[B, 1, S, >= keys]` the export wrapper builds (padding and causality)."""
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        b, h, s, d = key.shape  # [B, H_kv, S, D]
        key = key[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)
        value = value[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # [B, S, H, D]


def register_export_attention() -> None:
    """Register `causal_attention` with transformers (its name has no mask builder: models skip mask creation)."""
    from transformers import AttentionInterface

    if EXPORT_ATTENTION not in AttentionInterface():
        AttentionInterface.register(EXPORT_ATTENTION, causal_attention)


class CausalLogits(nn.Module):
    """`input_ids [B, S] -> logits [B, S, V]` of a causal LM, no cache, no mask (what the exporters trace)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, use_cache=False, return_dict=False)[0]


def export_copy(model: nn.Module, weights: list[PaletteWeight], swap) -> CausalLogits:
    """A float32 eval copy of `model` with each DKM layer replaced by `swap(module, weight)` and the export
    attention installed, wrapped as `CausalLogits` (the model itself is left as it was)."""
    register_export_attention()
    dkm_layers = {w.name: model.get_submodule(w.name) for w in weights}
    memo = {id(m): None for m in dkm_layers.values()}  # not copied: replaced below
    twin = copy.deepcopy(model, memo).eval()
    for tensor in (*twin.parameters(), *twin.buffers()):  # not .float(): transformers refuses it on a quantized model
        tensor.requires_grad_(False)
        tensor.data = (tensor.data.float() if tensor.is_floating_point() else tensor.data).cpu()
    for w in weights:  # after the cast: the palettized tensors keep their saved dtypes
        parent, _, leaf = w.name.rpartition(".")
        setattr(twin.get_submodule(parent), leaf, swap(dkm_layers[w.name], w))
    from hf_llmkit.quantization.tied import tied_heads

    for head, embedding in tied_heads(model).items():  # the copies' heads: the exported embedding, as a Linear
        twin.set_submodule(head, tied_export_head(twin.get_submodule(embedding)))
    twin.set_attn_implementation(EXPORT_ATTENTION)
    text = twin.config.get_text_config(decoder=True)
    if getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None):
        # MoE experts: the batched product is standard ops (grouped_mm's CPU fallback and histc do not convert)
        twin.set_experts_implementation("batched_mm")
    return CausalLogits(twin).eval()


def tied_export_head(embedding: nn.Module) -> nn.Module:
    """The export of a `TiedDKMHead` from its embedding's export module (`dense_module`'s `nn.Embedding`, or a
    palettized export module): a bias-less Linear over the same tensors."""
    return _TiedExportHead(embedding)


class _TiedExportHead(nn.Module):
    """An export embedding multiplied as a Linear (`x @ W^T`); it references the embedding without registering it,
    so the exported file holds (and names) its tensors once, under the embedding's name."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.__dict__["embedding"] = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.embedding
        if isinstance(embedding, nn.Embedding):
            return nn.functional.linear(x, embedding.weight)
        return embedding.multiply(x)


def dense_module(module: nn.Module, weight: PaletteWeight) -> nn.Module:
    """`nn.Linear` / `nn.Embedding` holding the decoded float32 weight (and the layer's bias)."""
    w = weight.decoded()
    if weight.kind == "embedding":
        dense = nn.Embedding(*weight.shape, padding_idx=module.padding_idx)
        dense.weight = nn.Parameter(w, requires_grad=False)
        return dense
    bias = getattr(module, "bias", None)
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    dense.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        dense.bias = nn.Parameter(bias.detach().float().cpu(), requires_grad=False)
    return dense


def check_output(path: Path, caller: str, *, kind: str) -> None:
    """A ValueError, before any work, for an output that cannot be written whole or would replace what is there.
    `kind`: "folder" (a new or empty folder), "file" (a new file; with `<file>.data` beside it, the external data
    file, new too) or "package" (a new Core ML package folder, or an empty one); every kind needs its nearest
    existing ancestor to be a writable folder. Nothing is ever overwritten: remove the old output or name another."""
    if kind == "folder" and _taken(path) and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{caller}: {str(path)!r} exists and is not an empty folder: name a new folder.")
    if kind == "file" and path.is_dir():
        raise ValueError(f"{caller}: {str(path)!r} is a folder: name the file to write.")
    if kind == "package" and _taken(path) and not path.is_dir():
        raise ValueError(f"{caller}: {str(path)!r} is a file, not a package folder: name a new package.")
    if kind == "package" and path.is_dir() and any(path.iterdir()):
        raise ValueError(
            f"{caller}: {str(path)!r} exists and is not empty (the export would replace what it holds): remove it "
            "or name a new package."
        )
    if kind == "file":
        for taken in (path, path.with_name(path.name + ".data")):
            if _taken(taken):
                raise ValueError(
                    f"{caller}: {str(taken)!r} exists (the export would overwrite it): remove it or name a new file."
                )
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{caller}: cannot write {str(path)!r}: {str(ancestor)!r} is not a folder.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{caller}: cannot write {str(path)!r}: {str(ancestor)!r} is not writable.")


def _taken(path: Path) -> bool:
    """Something is at `path` (a dangling symlink included)."""
    return path.exists() or path.is_symlink()


@contextlib.contextmanager
def staging(path: Path, *, folder: bool):
    """Yield a private folder beside `path` to write the export into; on success it is renamed into place (`folder`:
    it becomes `path`; else each entry lands beside `path`, `path` itself last), on any error it is removed: an
    interrupted export leaves nothing under the target's name. What appeared under an entry's name during the export
    is never replaced (a ValueError; only an empty folder gives way)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if folder:
            if path.exists() and (not path.is_dir() or any(path.iterdir())):
                raise ValueError(f"{str(path)!r} was written by something else during the export: name a new folder.")
            if path.is_dir():
                path.rmdir()  # empty
            os.replace(tmp, path)
            return
        items = sorted(tmp.iterdir(), key=lambda p: p.name == path.name)
        for item in items:
            target = path.parent / item.name
            if _taken(target) and not (item.is_dir() and target.is_dir() and not any(target.iterdir())):
                raise ValueError(
                    f"{str(target)!r} was written by something else during the export: remove it or name a new path."
                )
        for item in items:
            target = path.parent / item.name
            if item.is_dir() and target.is_dir():
                target.rmdir()  # empty
            os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
