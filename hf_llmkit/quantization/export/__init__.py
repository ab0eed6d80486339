"""Exports of a DKM model to where palettized weights are deployed: Core ML (`export_coreml`) and ONNX
(`export_onnx`). Both take a reloaded compact checkpoint (`PalettizedLinear` / `PalettizedEmbedding`) or a live DKM
model, keep the packed indices and lookup tables, and decode them exactly as our layers do (`_dkm.decode`).
`onnxruntime_session` opens an exported ONNX file with our C kernel for its palettized nodes; `greedy_generate`
generates from it. `python -m hf_llmkit.quantization.export {coreml,onnx} CHECKPOINT OUTPUT` runs them on a saved
checkpoint.
"""

from hf_llmkit.quantization.export._common import PaletteWeight, palettized_weights
from hf_llmkit.quantization.export.coreml import export_coreml
from hf_llmkit.quantization.export.onnx import export_onnx
from hf_llmkit.quantization.export.onnx_runtime import greedy_generate, onnxruntime_session

__all__ = [
    "PaletteWeight",
    "export_coreml",
    "export_onnx",
    "greedy_generate",
    "onnxruntime_session",
    "palettized_weights",
]
