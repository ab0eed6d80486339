"""What a DKM layer is built from and checked against, shared by the trainable layers (`layers.py`) and the packed
inference layers (`palettized.py`): `DKMSettings`, the table / block-scale checks a loaded checkpoint goes through,
and `TABLES`, the buffers a dtype cast leaves in their dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_llmkit.quantization.config import DKMConfig

__all__ = ["TABLES", "DKMSettings", "check_scales", "check_table"]

# Buffers a dtype cast of the model (`.to(torch.float16)`) leaves in their dtype: the tables and block scales, as
# `from_pretrained(..., dtype=...)` leaves them (the saved checkpoint must match its config's `lut_dtype`).
TABLES = ("centroids", "scales", "importance", "weight_lut", "weight_scale")


@dataclass(frozen=True)
class DKMSettings:
    """What one DKM layer clusters with: its `DKMConfig` (where every option is declared, once) and what the layer's
    kind and shape decide, its index bits (embeddings have their own) and number of tables."""

    config: DKMConfig
    bits: int
    groups: int

    @classmethod
    def from_config(cls, config: DKMConfig, kind: str, rows: int) -> DKMSettings:
        """Settings of a `kind` ("linear" / "embedding") layer with `rows` output channels (embedding rows)."""
        return cls(config=config, bits=config.bits_for(kind), groups=config.num_groups(rows))

    @classmethod
    def build(cls, rows: int, *, groups: int = 1, kind: str = "linear", **options) -> DKMSettings:
        """Settings of a standalone layer with `rows` output channels, `groups` tables (`rows / groups` channels
        each) and the `DKMConfig` options given (e.g. `DKMSettings.build(64, bits=4, cluster_dim=2)`)."""
        if groups > 1:
            options.update(granularity="per_grouped_channel", group_size=rows // groups)
        return cls.from_config(DKMConfig(**options), kind, rows)

    @property
    def cluster_dim(self) -> int:
        return self.config.cluster_dim

    @property
    def scale_block(self) -> int:
        """Input features per block scale (0: the weights are clustered unscaled)."""
        return self.config.scale_block_size

    def scales_shape(self, shape) -> tuple[int, int] | None:
        """Shape of the block scales of a `[rows, cols]` weight (None without scales)."""
        return (shape[0], shape[1] // self.scale_block) if self.scale_block else None


def check_table(name: str, table: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A lookup table / centroid table must have the layer's shape and only finite values."""
    if tuple(table.shape) != shape:
        raise ValueError(f"{name!r} has shape {tuple(table.shape)}, expected {shape}; the checkpoint does not match.")
    if not bool(torch.isfinite(table).all()):
        raise ValueError(f"{name!r} holds NaN/Inf values: the checkpoint is corrupt; restore it from a good copy.")


def check_scales(name: str, scales: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """Block scales must be present (the config has `scale_block_size`), of the layer's shape, finite and > 0."""
    if scales is None:
        raise ValueError(
            f"The DKM checkpoint has no {name!r} but its quantization_config sets scale_block_size: set it to 0 "
            "in config.json if the checkpoint was saved without block scales."
        )
    check_table(name, scales, shape)
    if not bool((scales > 0).all()):
        raise ValueError(f"{name!r} holds scales <= 0: the checkpoint is corrupt; restore it from a good copy.")
