"""DKM / eDKM train-time weight clustering as a transformers quantization method ("dkm").

`import hf_llmkit` registers `DKMConfig` and `DKMHfQuantizer` with transformers (once per process), so
`from_pretrained(..., quantization_config=DKMConfig(bits=3))` and reloading a saved DKM checkpoint just work.

Public modules: `config` (DKMConfig), `quantizer` (the HfQuantizer), `integration` (module replacement, the load
op, checks after loading), `layout` (a checkpoint's tensor names checked before loading), `layers` (the DKM layers;
the packed ones in `palettized`, both built from `layer_settings`), `training_state` (bitwise-resumable Trainer
checkpoints), `marshal` (eDKM's saved-tensor marshaling), `optimum` (post-training k-means), `calibration`
(`calibrate`: GPTQ's error-compensated rounding onto the tables), `export` (Core ML and ONNX exports). Modules
with a leading underscore are the engines behind the layers and may change without notice.
"""

from hf_llmkit.quantization.calibration import calibrate
from hf_llmkit.quantization.config import DKMConfig
from hf_llmkit.quantization.export import export_coreml, export_onnx
from hf_llmkit.quantization.integration import replace_with_dkm_layers, trainable_from_packed
from hf_llmkit.quantization.layer_settings import DKMSettings
from hf_llmkit.quantization.layers import DKMEmbedding, DKMLinear
from hf_llmkit.quantization.marshal import MarshalHooks
from hf_llmkit.quantization.optimum import DKMOptimumQuantizer
from hf_llmkit.quantization.palettized import PalettizedEmbedding, PalettizedLinear
from hf_llmkit.quantization.quantizer import DKMHfQuantizer, quantize_model
from hf_llmkit.quantization.training_state import DKMTrainingStateCallback, keep_training_state, scale_latent_lr


def register_dkm() -> None:
    """Register the "dkm" method with transformers; a no-op when it is already registered."""
    from transformers.quantizers import register_quantization_config, register_quantizer

    from hf_llmkit.compat.transformers import quantization_method_registered

    config_registered, quantizer_registered = quantization_method_registered("dkm")
    if not config_registered:
        register_quantization_config("dkm")(DKMConfig)
    if not quantizer_registered:
        register_quantizer("dkm")(DKMHfQuantizer)


register_dkm()

__all__ = [
    "DKMConfig",
    "DKMEmbedding",
    "DKMHfQuantizer",
    "DKMLinear",
    "DKMOptimumQuantizer",
    "DKMSettings",
    "DKMTrainingStateCallback",
    "MarshalHooks",
    "PalettizedEmbedding",
    "PalettizedLinear",
    "calibrate",
    "export_coreml",
    "export_onnx",
    "keep_training_state",
    "scale_latent_lr",
    "quantize_model",
    "register_dkm",
    "replace_with_dkm_layers",
    "trainable_from_packed",
]
