"""The P-tuning v1 tuner layer: an input-embedding wrapper that embeds virtual token ids with the prompt encoder.

Virtual ids are a contiguous range `[start, start + num_virtual_tokens)` per adapter. The wrapper looks them up in
its own encoder output and never in the base matrix, so the range may lie past the base vocabulary: the embedding
matrix (and the LM head) keep their size, nothing of the base model is resized or saved, and the model can never
generate a virtual token. A range inside the base vocabulary (a tokenizer smaller than a padded vocabulary) works too:
those ids are simply intercepted.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from hf_llmkit.tuners.base import UnmergeableLayer
from hf_llmkit.tuners.ptuning.config import PTuningConfig
from hf_llmkit.tuners.ptuning.encoder import PromptEncoder

MERGE_ERROR = (
    "P-tuning adds virtual-token embeddings computed by a prompt encoder; there is no base weight to fold them "
    "into, so it cannot merge. Use `model.unload()` to get the base model back, or keep the adapter attached."
)


class PTuningLayer(BaseTunerLayer):
    adapter_layer_names = ("ptuning_encoder",)
    other_param_names = ("ptuning_start_id", "ptuning_num_tokens")

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.ptuning_encoder = nn.ModuleDict({})
        self.ptuning_start_id: dict[str, int] = {}
        self.ptuning_num_tokens: dict[str, int] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        base = self.get_base_layer()
        if not isinstance(base, nn.Embedding):
            raise TypeError(
                f"P-tuning wraps the input embedding (nn.Embedding), got {type(base).__name__}; set target_modules "
                "to the name of the model's input embedding module"
            )
        self.num_embeddings = base.num_embeddings
        self.embedding_dim = base.embedding_dim
        self.in_features, self.out_features = self.num_embeddings, self.embedding_dim  # peft's embedding convention

    def update_layer(self, adapter_name: str, config: PTuningConfig, *, key: str = "") -> None:
        if config.token_dim is not None and config.token_dim != self.embedding_dim:
            raise ValueError(
                f"token_dim={config.token_dim} but the embedding layer has dimension {self.embedding_dim}; "
                "leave token_dim=None"
            )
        config.token_dim = self.embedding_dim
        if config.virtual_token_start_id is None:
            config.virtual_token_start_id = self.num_embeddings
        start, count = config.virtual_token_start_id, config.num_virtual_tokens
        for other, other_start in self.ptuning_start_id.items():
            other_end = other_start + self.ptuning_num_tokens[other]
            if other != adapter_name and start < other_end and other_start < start + count:
                raise ValueError(
                    f"virtual token ids {start}..{start + count - 1} of adapter {adapter_name!r} overlap those of "
                    f"adapter {other!r} ({other_start}..{other_end - 1}); give each adapter its own tokens with "
                    "PTuningTemplate(tokenizer, config, token_format=...)"
                )
        self.ptuning_start_id[adapter_name] = start
        self.ptuning_num_tokens[adapter_name] = count
        self.ptuning_encoder[adapter_name] = PromptEncoder(
            num_virtual_tokens=count,
            token_dim=self.embedding_dim,
            hidden_size=config.encoder_hidden_size or self.embedding_dim,
            kind=config.encoder_reparameterization_type,
            num_layers=config.encoder_num_layers,
            dropout=config.encoder_dropout,
        )
        self._move_adapter_to_device_of_base_layer(adapter_name)  # skips meta (low_cpu_mem_usage) adapters
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)


class PTuningEmbedding(UnmergeableLayer, nn.Module, PTuningLayer):
    """An `nn.Embedding` whose virtual token ids are embedded by the active adapters' prompt encoders."""

    merge_error = MERGE_ERROR

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: PTuningConfig, *, key: str = "") -> None:
        super().__init__()
        PTuningLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, key=key)

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        active = [] if self.disable_adapters else [a for a in self.active_adapters if a in self.ptuning_encoder]
        if not active:
            stray = input_ids >= self.num_embeddings
            if stray.any():  # virtual tokens while no P-tuning adapter is on: the base lookup would fail to index
                raise ValueError(
                    f"token id {int(input_ids[stray][0])} is a virtual token (past the vocabulary of "
                    f"{self.num_embeddings}) but no P-tuning adapter is active (disable_adapter(), or another adapter "
                    "is set); leave the virtual tokens out of the input while the adapter is off, or set_adapter() it"
                )
            return self.base_layer(input_ids, *args, **kwargs)
        masks = []
        for name in active:
            start = self.ptuning_start_id[name]
            masks.append((input_ids >= start) & (input_ids < start + self.ptuning_num_tokens[name]))  # [B, S]
        any_virtual = torch.stack(masks).any(0)
        stray = (input_ids >= self.num_embeddings) & ~any_virtual
        if stray.any():  # e.g. another adapter's virtual tokens; the lookup below would fail with an index error
            raise ValueError(
                f"token id {int(input_ids[stray][0])} is outside the vocabulary ({self.num_embeddings}) and not a "
                f"virtual token of the active adapter(s) {active}; activate its adapter with set_adapter() or fix "
                "the tokenizer/template"
            )
        # Virtual ids may lie past the base matrix: look up id 0 there instead and overwrite those rows below.
        result = self.base_layer(input_ids.masked_fill(any_virtual, 0), *args, **kwargs)  # [B, S, D]
        for name, mask in zip(active, masks):
            start, count = self.ptuning_start_id[name], self.ptuning_num_tokens[name]
            prompts = self.ptuning_encoder[name]().to(result.dtype)  # [N, D]
            rows = prompts[(input_ids - start).clamp(0, count - 1)]  # [B, S, D]
            result = torch.where(mask.unsqueeze(-1), rows, result)
        return result

    def __repr__(self) -> str:
        return "ptuning." + super().__repr__()
