"""`export_onnx`: the ONNX file keeps the checkpoint's packed indices, tables and scales as initializers, decodes
them with standard ops bit for bit to ours, runs in onnxruntime with our logits within 1e-5, and is no larger than
the compact checkpoint plus its unquantized parts; bad input is one ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import export_onnx, quantize_model
from hf_llmkit.quantization.export import palettized_weights
from hf_llmkit.quantization.export.onnx import OnnxPalettized
from hf_llmkit.testing import tiny_llama

onnx = pytest.importorskip("onnx", reason="ONNX export needs onnx, onnxscript and onnxruntime (the `export` extra)")
ort = pytest.importorskip("onnxruntime", reason="ONNX export needs onnxruntime (the `export` extra)")
pytest.importorskip("onnxscript", reason="torch.onnx's exporter needs onnxscript (the `export` extra)")


class _Weight(torch.nn.Module):
    """The decoded weight of one exported layer as the graph's output (`x` only gives the graph an input)."""

    def __init__(self, layer: OnnxPalettized) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.decoded_weight() + x


DECODE_CASES = {
    "3bit-per-tensor": DKMConfig(bits=3),
    "4bit-per-grouped-channel-bf16": DKMConfig(
        bits=4, granularity="per_grouped_channel", group_size=16, lut_dtype="bfloat16"
    ),
    "3bit-block-scales-fp16": DKMConfig(bits=3, scale_block_size=16, lut_dtype="float16"),
    "5bit-vectors": DKMConfig(bits=5, cluster_dim=2),
    "8bit-embeddings-7bit": DKMConfig(bits=7, quantize_embeddings=True, embedding_bits=8),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_graph_decodes_bitwise_to_ours(case, tmp_path):
    model = quantize_model(tiny_llama(num_hidden_layers=1), DECODE_CASES[case]).eval()
    weights = palettized_weights(model)
    picks = [weights[0], weights[-1]] if weights[0].kind == "embedding" else [weights[-1]]  # down_proj: [64, 128]
    for weight in picks:
        layer = OnnxPalettized(model.get_submodule(weight.name), weight)
        path = tmp_path / f"{weight.name}.onnx"
        torch.onnx.export(_Weight(layer), (torch.zeros(()),), str(path), dynamo=True, optimize=False)
        (value,) = ort.InferenceSession(str(path)).run(None, {"x": np.zeros((), np.float32)})
        ours = weight.decoded().numpy()
        assert value.dtype == np.float32 and np.array_equal(value.view(np.int32), ours.view(np.int32)), weight.name


def test_logits_match_and_the_file_is_compact(tmp_path):
    config = DKMConfig(bits=3, scale_block_size=16, lut_dtype="float16")
    quantize_model(tiny_llama(num_hidden_layers=1), config).eval().save_pretrained(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    path = export_onnx(model, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path))
    for shape in ((1, 5), (3, 17)):  # batch and sequence are dynamic
        ids = torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(0))
        (logits,) = session.run(None, {"input_ids": ids.numpy()})
        with torch.no_grad():
            ours = model(ids).logits
        assert np.abs(logits - ours.numpy()).max() <= 1e-5

    # The initializers are the checkpoint's tensors, in their saved dtypes (plus a few bytes of decode constants).
    graph = onnx.load(str(path)).graph
    stored = {i.name.removeprefix("m."): onnx.numpy_helper.to_array(i) for i in graph.initializer}
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "np") as saved:
        checkpoint_tensors = {name: saved.get_tensor(name) for name in saved.keys()}  # noqa: SIM118
    # the one-byte stand-ins for the dense weights (integration.stand_in_weight) have nothing to do in the graph
    checkpoint_tensors = {n: t for n, t in checkpoint_tensors.items() if not (n.endswith(".weight") and t.size == 1)}
    for name, tensor in checkpoint_tensors.items():
        assert stored[name].tobytes() == tensor.tobytes(), name  # reshaped at most
    extra = sum(v.nbytes for name, v in stored.items() if name not in checkpoint_tensors)
    assert extra <= 128 * len(palettized_weights(model))
    # No dense copy of a clustered weight: its only weight-sized tensors are the packed ones.
    for weight in palettized_weights(model):
        assert weight.name + ".weight" not in stored
    # File bound of the issue: the compact checkpoint plus the unquantized parts.
    checkpoint = (tmp_path / "ckpt" / "model.safetensors").stat().st_size
    unquantized = sum(p.numel() * p.element_size() for p in model.parameters())
    assert path.stat().st_size <= checkpoint + unquantized, (path.stat().st_size, checkpoint, unquantized)


def test_bad_input_is_one_value_error(tmp_path):
    with pytest.raises(ValueError, match="has no DKM layers"):
        export_onnx(tiny_llama(), tmp_path / "m.onnx")
    model = quantize_model(tiny_llama(num_hidden_layers=1), DKMConfig(bits=3)).eval()
    with pytest.raises(ValueError, match="must end in .onnx"):
        export_onnx(model, tmp_path / "m.pt")
    with pytest.raises(ValueError, match="opset must be an integer >= 18"):
        export_onnx(model, tmp_path / "m.onnx", opset=11)
    with pytest.raises(ValueError, match="expected a transformers causal LM"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "m.onnx")


def test_command_refuses_a_model_without_dkm_layers(tmp_path):
    import subprocess
    import sys

    tiny_llama(num_hidden_layers=1).save_pretrained(tmp_path / "dense")
    cmd = [sys.executable, "-m", "hf_llmkit.quantization.export", "onnx", str(tmp_path / "dense"), "m.onnx"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: export_onnx: the model has no DKM layers")
    assert not (tmp_path / "m.onnx").exists()


def test_command_exports_a_saved_checkpoint_that_runs_like_the_model(tmp_path):
    """The documented command on a compact checkpoint: `python -m hf_llmkit.quantization.export onnx CHECKPOINT
    model.onnx` writes a file onnxruntime runs to the reloaded model's logits."""
    import subprocess
    import sys

    quantize_model(tiny_llama(num_hidden_layers=1), DKMConfig(bits=3)).eval().save_pretrained(tmp_path / "dkm")
    cmd = [sys.executable, "-m", "hf_llmkit.quantization.export", "onnx", str(tmp_path / "dkm"), "model.onnx"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = torch.randint(0, 512, (1, 8))
    (logits,) = ort.InferenceSession(str(tmp_path / "model.onnx")).run(None, {"input_ids": ids.numpy()})
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dkm")(ids).logits.numpy()
    assert np.abs(logits - ours).max() <= 1e-5
