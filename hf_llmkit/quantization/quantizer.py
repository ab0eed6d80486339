"""`DKMHfQuantizer`: the transformers 5.x `HfQuantizer` of the "dkm" method (the work is in `integration.py`).

On-the-fly (`from_pretrained(path, quantization_config=DKMConfig(...))`): target modules become trainable DKM layers
while the model is on the meta device, and each layer's k-means runs as its weight loads (`DKMInitTables`). Saving
writes packed indices + lookup tables (and the training state during Trainer runs). Reloading a DKM checkpoint
builds, per layer, what the checkpoint holds: packed inference layers, or trainable layers for a Trainer checkpoint's
training state; the tensor names are checked against the config before any weight is read (`layout.py`).

A sharded model (FSDP2, ZeRO-3) packs from the full state dict the Trainer gathers on every rank before its main
process writes: `exporting_from` hands it to the save (`LLMKitTrainer._save` does; transformers' `save_pretrained`
only asks the quantizer for the state dict to write, it does not pass on the one it was given).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from transformers.quantizers.base import HfQuantizer

from hf_llmkit.compat.transformers import get_module_from_name, keep_in_fp32_modules
from hf_llmkit.quantization import integration, tied
from hf_llmkit.quantization.config import DKMConfig
from hf_llmkit.quantization.layout import LOADED_NAMES, read_layout
from hf_llmkit.quantization.training_state import guard_training_state


class DKMHfQuantizer(HfQuantizer):
    """DKM / eDKM train-time weight clustering (quantization-aware training; trainable with or without PEFT)."""

    requires_calibration = False
    quantization_config: DKMConfig

    def __init__(self, quantization_config: DKMConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []
        self._full_state: dict | None = None
        self._model: weakref.ref | None = None  # the model it quantized: `is_serializable` checks it before a save

    @contextlib.contextmanager
    def exporting_from(self, full_state: dict | None) -> Iterator[None]:
        """While inside, `save_pretrained` packs the DKM layers from `full_state` (the model's full state dict,
        gathered from its shards on every rank) instead of the model's own, possibly sharded, tensors."""
        previous, self._full_state = self._full_state, full_state
        try:
            yield
        finally:
            self._full_state = previous

    @property
    def quantized_element_size(self) -> float:
        return self.quantization_config.bits / 8

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        self._model = weakref.ref(model)
        integration.check_not_quantized(model)
        config = self.quantization_config
        # an embedding clustered with its tied head stays tied (`tied.py`); other tied modules are never clustered
        ties = tied.clustered_ties(model, config, list(config.modules_to_not_convert) + keep_in_fp32_modules(model))
        skip = [m for m in integration.tied_modules(model) if m not in ties.values()]
        skip = list(config.modules_to_not_convert) + skip
        self.modules_to_not_convert = sorted(self.get_modules_to_not_convert(model, skip, keep_in_fp32_modules(model)))
        packed: bool | dict = self.pre_quantized
        if self.pre_quantized:
            targets = list(integration.dkm_targets(model, self.quantization_config, self.modules_to_not_convert))
            layout = read_layout(model, checkpoint_files, targets, self.quantization_config)
            if layout is not None:
                packed = layout
        integration.replace_with_dkm_layers(model, self.quantization_config, self.modules_to_not_convert, packed)
        tied.attach_tied_heads(model, ties)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, tensor_name = get_module_from_name(model, param_name)
        if self.pre_quantized:
            # Lets packed tensors of any shape reach `_process_model_after_weight_loading`, which names the problem.
            return isinstance(module, integration.PACKED) and tensor_name in LOADED_NAMES
        return isinstance(module, integration.TRAINABLE) and tensor_name == "weight"

    def get_quantize_ops(self):
        return integration.DKMInitTables(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        integration.initialise_missing_biases(model)  # transformers' own init knows nn.Linear only
        integration.verify_loaded(model, self.pre_quantized)
        if any(isinstance(m, integration.TRAINABLE) for m in model.modules()):
            guard_training_state(model)  # training without DKMTrainingStateCallback does not go unnoticed
        return model

    def get_state_dict_and_metadata(self, model):
        return integration.dkm_state_dict(model, self._full_state), {}

    def is_serializable(self) -> bool:
        """True; first (save_pretrained asks before it creates the folder) a model whose tables cannot be saved is
        refused in one line, leaving nothing behind."""
        model = self._model() if self._model is not None else None
        if model is not None:
            integration.check_saveable(model)
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        """`generate` may compile the forward (static cache): the packed layers' CPU kernel is a torch operator
        there, the other paths are torch code."""
        return True


def quantize_model(model, config: DKMConfig):
    """Apply DKM to a model that is already built (e.g. from a config): what `from_pretrained` does on load.

    Returns the same model with DKM layers initialised by k-means, `hf_quantizer` attached and the config in
    `model.config.quantization_config`, ready for the Trainer and `save_pretrained`.
    """
    quantizer = DKMHfQuantizer(config, pre_quantized=False)
    quantizer.preprocess_model(model)
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return model


def exporting_from(model, full_state: dict | None):
    """`DKMHfQuantizer.exporting_from(full_state)` of a DKM model, for a save of the full state dict a Trainer
    gathered (FSDP2, ZeRO-3); a null context for any other model or when none was gathered (None, or the empty
    placeholder the Trainer writes and deletes when ZeRO-3 cannot gather)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if not full_state or not isinstance(quantizer, DKMHfQuantizer):
        return contextlib.nullcontext()
    return quantizer.exporting_from(full_state)
