"""The P-tuning v1 prompt encoder: trainable virtual-token inputs reparameterised by an MLP or a bidirectional LSTM."""

from __future__ import annotations

import torch
from torch import nn


class PromptEncoder(nn.Module):
    """Maps the virtual tokens' own input embeddings through an MLP or LSTM to `[num_virtual_tokens, token_dim]`.

    The input embeddings are a plain Parameter on this module (not an nn.Embedding called by index) so DeepSpeed
    ZeRO-3 gathers them with this module's forward.
    """

    def __init__(
        self,
        *,
        num_virtual_tokens: int,
        token_dim: int,
        hidden_size: int,
        kind: str,
        num_layers: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.embedding = nn.Parameter(torch.empty(num_virtual_tokens, token_dim))
        nn.init.normal_(self.embedding, std=0.02)
        if kind == "LSTM":
            self.lstm = nn.LSTM(
                input_size=token_dim,
                hidden_size=hidden_size,
                num_layers=num_layers,
                dropout=dropout if num_layers > 1 else 0.0,
                bidirectional=True,
                batch_first=True,
            )
            self.head = nn.Sequential(
                nn.Linear(2 * hidden_size, 2 * hidden_size), nn.ReLU(), nn.Linear(2 * hidden_size, token_dim)
            )
        elif kind == "MLP":
            self.head = nn.Sequential(
                nn.Linear(token_dim, hidden_size),
                nn.ReLU(),
                nn.Dropout(dropout),
                nn.Linear(hidden_size, hidden_size),
                nn.ReLU(),
                nn.Linear(hidden_size, token_dim),
            )
        else:
            raise ValueError(f"unknown prompt encoder {kind!r}; use 'MLP' or 'LSTM'")

    def forward(self) -> torch.Tensor:
        x = self.embedding  # [N, D]
        if self.kind == "LSTM":
            x = self.lstm(x.unsqueeze(0))[0].squeeze(0)  # [N, 2H]
        return self.head(x)  # [N, D]
