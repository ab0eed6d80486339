"""A clustered embedding and the LM head tied to it stay one weight: `DKMConfig(quantize_embeddings=True)` on a model
with `tie_word_embeddings` (SmolLM2, Llama 3.2, Gemma, ...).

transformers ties such a head by sharing the embedding's `weight` parameter. A clustered embedding has no dense weight
to share (a trainable `DKMEmbedding` multiplies by its *clustered* weight, not its latent one; a packed
`PalettizedEmbedding` holds only indices and a table), so the head becomes a `TiedDKMHead` that multiplies by the
embedding's own clustered weight: the same table, the same indices, saved once (under the embedding's name; the head
saves nothing), trained through both ends. The tie transformers would make is dropped from the model's tied-weights
mapping (`compat.transformers.untie`), so that loading does not look for a dense weight to share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_llmkit.compat.transformers import should_convert_module, tied_parameters, untie
from hf_llmkit.quantization import lut_gemv
from hf_llmkit.quantization.config import DKMConfig
from hf_llmkit.quantization.layers import DKMEmbedding
from hf_llmkit.quantization.palettized import PalettizedEmbedding


class TiedDKMHead(nn.Module):
    """`Linear(embedding_dim -> num_embeddings, bias=False)` whose weight is `embedding`'s clustered weight.

    Training (a `DKMEmbedding` with a weight that requires grad): the embedding's soft-clustered weight (its gradient
    reaches the latent weight from both ends); evaluation: its hard-assigned weight, bit for bit the decoded one;
    a `PalettizedEmbedding`: multiplied from its indices by `lut_gemv` (the C kernel on CPU). The embedding is
    referenced, not registered: its tensors belong to the embedding module alone.
    """

    def __init__(self, embedding: DKMEmbedding | PalettizedEmbedding):
        super().__init__()
        self.tie_to(embedding)

    def tie_to(self, embedding: DKMEmbedding | PalettizedEmbedding) -> None:
        """Multiply by `embedding` from now on (the module that replaced the embedding, e.g. made trainable)."""
        self.__dict__["embedding"] = embedding  # not a submodule: saved, moved and counted once, as the embedding
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.embedding
        if isinstance(embedding, PalettizedEmbedding):
            return lut_gemv.linear(embedding, x, None)
        dtype = lut_gemv.compute_dtype(x)
        return F.linear(x.to(dtype), embedding.clustered_weight(dtype).to(dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tied to the clustered embedding"


def clustered_ties(model: nn.Module, config: DKMConfig, skip: list[str]) -> dict[str, str]:
    """`{head module: embedding module}` of the model's tied pairs that `config` clusters together: the source an
    `nn.Embedding` (clustered: `quantize_embeddings`, not skipped), the target an `nn.Linear` without bias."""
    if not config.quantize_embeddings:
        return {}
    pairs = {}
    for target, source in tied_parameters(model).items():
        head, _, head_tensor = target.rpartition(".")
        embedding, _, embedding_tensor = source.rpartition(".")
        if head_tensor != "weight" or embedding_tensor != "weight" or not should_convert_module(embedding, skip):
            continue
        head_module, embedding_module = model.get_submodule(head), model.get_submodule(embedding)
        if type(embedding_module) is nn.Embedding and type(head_module) is nn.Linear and head_module.bias is None:
            pairs[head] = embedding
    return pairs


def tied_heads(model: nn.Module) -> dict[str, str]:
    """`{head: embedding}`: the names of the model's `TiedDKMHead`s and of the embeddings they multiply by."""
    by_id = {id(m): n for n, m in model.named_modules()}
    return {n: by_id[id(m.embedding)] for n, m in model.named_modules() if isinstance(m, TiedDKMHead)}


def attach_tied_heads(model: nn.Module, pairs: dict[str, str]) -> None:
    """After the embeddings of `pairs` became DKM layers: each head becomes a `TiedDKMHead` of its embedding, and
    transformers' tie of the two dense weights is dropped."""
    for head, embedding in pairs.items():
        module = model.get_submodule(embedding)
        if not isinstance(module, (DKMEmbedding, PalettizedEmbedding)):
            raise ValueError(f"{embedding!r} was to be clustered with its tied head {head!r} but is {type(module)}")
        model.set_submodule(head, TiedDKMHead(module))
        untie(model, f"{head}.weight")
