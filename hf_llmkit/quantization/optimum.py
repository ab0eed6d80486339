"""Post-training DKM (k-means palettization, no fine-tuning) behind optimum's `OptimumQuantizer` interface.

quantizer = DKMOptimumQuantizer.from_pretrained("path/to/model")
quantizer.quantize(save_dir="out", quantization_config=DKMConfig(bits=4))
model = AutoModelForCausalLM.from_pretrained("out")  # packed inference layers (with hf_llmkit imported)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import transformers
from optimum.quantization_base import OptimumQuantizer

from hf_llmkit.quantization.config import DKMConfig


class DKMOptimumQuantizer(OptimumQuantizer):
    """Clusters a saved transformers model's weights with k-means only and writes a packed DKM checkpoint."""

    def __init__(self, model_or_path):
        self.model_or_path = model_or_path

    @classmethod
    def from_pretrained(cls, model_or_path, file_name: str | None = None) -> DKMOptimumQuantizer:
        """`model_or_path`: a folder written by `save_pretrained`, or a `PreTrainedModel` instance."""
        if file_name is not None:
            raise ValueError("DKMOptimumQuantizer loads a save_pretrained folder; pass file_name=None.")
        return cls(model_or_path)

    def quantize(
        self, save_dir: str | Path, file_prefix: str | None = None, quantization_config: DKMConfig | None = None
    ) -> Path:
        """Load the model with `quantization_config` (k-means initialised tables) and save it packed to `save_dir`."""
        if file_prefix is not None:
            raise ValueError("DKM checkpoints use transformers' file names; pass file_prefix=None.")
        config = quantization_config or DKMConfig()
        if not isinstance(config, DKMConfig):
            raise TypeError(f"quantization_config must be a DKMConfig, got {type(config).__name__}")
        with tempfile.TemporaryDirectory(prefix="dkm_ptq_") as tmp:
            path = self.model_or_path
            if not isinstance(path, (str, Path)):
                path.save_pretrained(tmp)
                path = tmp
            model_config = transformers.AutoConfig.from_pretrained(path)
            arch = (model_config.architectures or [None])[0]
            model_cls = getattr(transformers, arch, None) if arch else None
            if model_cls is None:
                raise ValueError(f"Cannot tell which transformers class to load from {path!r}: no 'architectures'.")
            model = model_cls.from_pretrained(path, quantization_config=config)
            model.save_pretrained(save_dir)
        return Path(save_dir)
