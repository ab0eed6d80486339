"""Packed inference and serving: `dkm_inference.py`'s variants, each measured in a process of its own (`worker`), its
parts (`loops`, `real`), onnxruntime (`onnxrt`, also `dkm_onnx.py`'s) and llama.cpp peers, tables and fragments."""
