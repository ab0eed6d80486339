"""`export_onnx`: an ONNX decoder with a key/value cache, a padding mask and positions, whose palettized nodes decode
bit for bit to our weights with standard ops (any runtime) and with our C kernel (`onnxruntime_session`); greedy
generation from it equals ours token for token on a slice of the real SmolLM2, optimum's `ORTModelForCausalLM`
generates from the folder, a left-padded prompt's last logits equal the unpadded prompt's, the file holds the
checkpoint's own tensors, onnxruntime folds nothing weight-sized, large models go to external data; bad input is one
ValueError before any work."""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import export_onnx, quantize_model
from hf_llmkit.quantization.export import __main__ as command
from hf_llmkit.quantization.export import _onnx_lut as lut_op
from hf_llmkit.quantization.export import greedy_generate, onnxruntime_session, palettized_weights
from hf_llmkit.quantization.export import onnx as onnx_export
from hf_llmkit.quantization.export.onnx import cache_shapes
from hf_llmkit.quantization.integration import IMPORT_MARKER
from hf_llmkit.testing import tiny_llama

onnx = pytest.importorskip("onnx", reason="ONNX export needs onnx, onnxscript and onnxruntime (the `export` extra)")
ort = pytest.importorskip("onnxruntime", reason="ONNX export needs onnxruntime (the `export` extra)")
pytest.importorskip("onnxscript", reason="torch.onnx's exporter needs onnxscript (the `export` extra)")
pytest.importorskip("onnxruntime_extensions", reason="the ONNX kernels need onnxruntime-extensions (`export` extra)")

DECODE_CASES = {
    "3bit-per-tensor": DKMConfig(bits=3),
    "4bit-per-grouped-channel-bf16": DKMConfig(
        bits=4, granularity="per_grouped_channel", group_size=16, lut_dtype="bfloat16"
    ),
    "3bit-block-scales-fp16": DKMConfig(bits=3, scale_block_size=16, lut_dtype="float16"),
    "5bit-vectors": DKMConfig(bits=5, cluster_dim=2),
    "8bit-embeddings-7bit": DKMConfig(bits=7, quantize_embeddings=True, embedding_bits=8),
}


def _node_model(layer: lut_op.OnnxPalettized, gather: bool):
    """An ONNX model of one palettized node (its function inside) whose output is the whole decoded weight:
    the rows 0..rows-1 (`LutGather`) or the identity times W^T (`LutMatMul`), both exact."""
    from onnx import TensorProto, helper, numpy_helper

    packed, table, meta, *rest = layer.tensors()
    names = lut_op.INPUTS[1:] + (["scale"] if rest[-1] is not None else [])
    values = [packed, table, meta, *rest[:-1]] + ([rest[-1]] if rest[-1] is not None else [])
    inits = [numpy_helper.from_array(v.numpy(), n) for n, v in zip(names, values)]
    name = lut_op.op_name(gather, rest[-1] is not None)
    node = helper.make_node(name, ["x", *names], ["y"], domain=lut_op.DOMAIN)
    x_type = TensorProto.INT64 if gather else TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "one_node",
        [helper.make_tensor_value_info("x", x_type, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(lut_op.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, functions=lut_op.function_protos({name}))


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_nodes_decode_bitwise_to_ours_with_standard_ops_and_with_our_kernel(case, tmp_path):
    model = quantize_model(tiny_llama(num_hidden_layers=1), DECODE_CASES[case]).eval()
    weights = palettized_weights(model)
    picks = [weights[0], weights[-1]] if weights[0].kind == "embedding" else [weights[-1]]  # down_proj: [64, 128]
    for weight in picks:
        layer = lut_op.OnnxPalettized(model.get_submodule(weight.name), weight)
        ours = weight.decoded().numpy()
        for gather in (True, False):
            path = tmp_path / f"{weight.name}-{gather}.onnx"
            onnx.save(_node_model(layer, gather), str(path))
            x = np.arange(ours.shape[0]) if gather else np.eye(ours.shape[1], dtype=np.float32)
            for session in (ort.InferenceSession(str(path)), onnxruntime_session(path)):
                (value,) = session.run(None, {"x": x})
                value = value if gather else value.T
                assert value.dtype == np.float32 and np.array_equal(value.view(np.int32), ours.view(np.int32)), (
                    weight.name,
                    gather,
                )


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-layer checkpoint with fp16 tables and block scales, exported as an optimum folder once, by the command
    (`python -m hf_llmkit.quantization.export onnx ckpt exported`: its `main`, run in this process, in the folder that
    holds the checkpoint); the reloaded model, the folder, the checkpoint and the command's exit code and output."""
    folder = tmp_path_factory.mktemp("onnx")
    config = DKMConfig(bits=3, scale_block_size=16, lut_dtype="float16")
    torch.manual_seed(0)
    quantize_model(tiny_llama(num_hidden_layers=2), config).eval().save_pretrained(folder / "ckpt")
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(folder)
        code = command.main(["onnx", "ckpt", "exported"])
    assert code == 0, err.getvalue()[-2000:]
    model = AutoModelForCausalLM.from_pretrained(folder / "ckpt")
    assert model.generation_config.pad_token_id == 0
    return model, folder / "exported", folder / "ckpt", (code, out.getvalue())


def _feed(model, ids, mask, positions):
    layers, heads, head_dim = cache_shapes(model.config)
    past = {f"past_key_values.{i}.{t}": np.zeros((ids.shape[0], heads, 0, head_dim), np.float32)
            for i in range(layers) for t in ("key", "value")}  # fmt: skip
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}


def test_left_padded_prompts_give_the_unpadded_prompts_last_logits(exported):
    model, folder, *_ = exported
    session = ort.InferenceSession(str(folder / "model.onnx"))
    ids = np.array([[0, 0, 0, 7, 81, 300, 12], [5, 9, 33, 2, 7, 400, 18]])
    mask = np.array([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    (logits, *_) = session.run(None, _feed(model, ids, mask, positions))
    for row, start in ((0, 3), (1, 0)):
        alone = ids[row : row + 1, start:]
        (single, *_) = session.run(None, _feed(model, alone, np.ones_like(alone), np.arange(alone.shape[1])[None]))
        assert np.abs(logits[row, -1] - single[0, -1]).max() <= 1e-5
        with torch.no_grad():
            ours = model(torch.from_numpy(alone)).logits[0, -1].numpy()
        assert np.abs(single[0, -1] - ours).max() <= 1e-5


def test_greedy_generate_refuses_a_file_without_a_cache_negative_lengths_and_empty_prompts(exported, tmp_path):
    """Issue 52: an empty prompt was onnxruntime's Reshape error; it is one ValueError naming the fix."""
    from onnx import TensorProto, helper

    model, folder, *_ = exported
    node = helper.make_node("Identity", ["input_ids"], ["logits"])
    ids_type = helper.make_tensor_value_info("input_ids", TensorProto.INT64, None)
    graph = helper.make_graph(
        [node], "old", [ids_type], [helper.make_tensor_value_info("logits", TensorProto.INT64, None)]
    )
    onnx.save(helper.make_model(graph), str(tmp_path / "old.onnx"))
    with pytest.raises(ValueError, match="no key/value cache inputs"):
        greedy_generate(ort.InferenceSession(str(tmp_path / "old.onnx")), np.ones((1, 2), np.int64), max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        greedy_generate(ort.InferenceSession(str(folder / "model.onnx")), np.ones((1, 2), np.int64), max_new_tokens=-1)
    session = ort.InferenceSession(str(folder / "model.onnx"))
    for empty in (np.zeros((1, 0), np.int64), np.zeros((0, 3), np.int64), []):
        with pytest.raises(ValueError, match=r"one row and one token, got shape \[.*pass a prompt of one") as info:
            greedy_generate(session, empty, max_new_tokens=2)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"attention_mask has shape \[1, 2\], input_ids \[1, 3\]"):
        greedy_generate(session, np.ones((1, 3), np.int64), np.ones((1, 2), np.int64), max_new_tokens=2)


def test_cached_steps_match_the_model_and_the_kernel_session(exported):
    model, folder, *_ = exported
    ids = torch.tensor([[5, 9, 33, 2, 7], [0, 0, 11, 4, 90]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.no_grad():
        ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False).numpy()
    for session in (ort.InferenceSession(str(folder / "model.onnx")), onnxruntime_session(folder / "model.onnx")):
        got = greedy_generate(session, ids.numpy(), mask.numpy(), max_new_tokens=6)
        assert np.array_equal(got, ours)


def test_the_file_holds_the_checkpoint_tensors_and_onnxruntime_folds_nothing_weight_sized(exported, tmp_path):
    model, folder, ckpt, _ = exported
    graph = onnx.load(str(folder / "model.onnx")).graph
    stored = {i.name.removeprefix("m."): onnx.numpy_helper.to_array(i) for i in graph.initializer}
    with safe_open(ckpt / "model.safetensors", "np") as saved:
        checkpoint_tensors = {name: saved.get_tensor(name) for name in saved.keys()}  # noqa: SIM118
    # the one-byte stand-ins for the dense weights (integration.stand_in_weight) have nothing to do in the graph
    # and neither has the marker that names the import a load without hf_llmkit needs (integration.IMPORT_MARKER)
    checkpoint_tensors = {n: t for n, t in checkpoint_tensors.items()
                          if not (n.endswith(".weight") and t.size == 1) and n != IMPORT_MARKER}  # fmt: skip
    for name, tensor in checkpoint_tensors.items():
        assert stored[name].tobytes() == tensor.tobytes(), name  # reshaped at most ([n / 8, bits] bytes)
    extra = sum(v.nbytes for name, v in stored.items() if name not in checkpoint_tensors)
    assert extra <= 160 * len(palettized_weights(model)) + 512  # the decode constants (132 bytes a layer), RoPE
    for weight in palettized_weights(model):
        assert weight.name + ".weight" not in stored  # no dense copy of a clustered weight
    # onnxruntime's optimized graph (constant folding on) holds no more initializer bytes than the file
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(folder / "model.onnx"), options)
    optimized = onnx.load(str(tmp_path / "optimized.onnx")).graph.initializer
    total = sum(v.nbytes for v in stored.values())
    assert sum(onnx.numpy_helper.to_array(i).nbytes for i in optimized) <= total * 1.05


def test_optimum_ort_model_generates_from_the_folder_with_its_cache(exported, tmp_path):
    from tests.quantization.optimum_peer import optimum_python

    model, folder, *_ = exported
    peer, why = optimum_python()
    if peer is None:
        pytest.skip(why)
    python, env = peer
    ids = torch.tensor([[5, 9, 33, 2, 7], [0, 0, 11, 4, 90]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.no_grad():
        ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    script = (
        "import sys, torch\n"
        "from optimum.onnxruntime import ORTModelForCausalLM\n"
        "m = ORTModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "assert m.can_use_cache, 'no cache'\n"
        f"ids = torch.tensor({ids.tolist()}); mask = torch.tensor({mask.tolist()})\n"
        "out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=True)\n"
        "print(out.tolist())\n"
    )
    done = subprocess.run([*python, "-c", script, str(folder)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(ours.tolist())


def test_generation_round_trips_on_the_real_model_slice(tmp_path):
    """Issue 42 part 3: SmolLM2-135M's first two layers, DKM 4-bit, reloaded, exported; greedy generation from
    onnxruntime (our kernel; the standard-op nodes are checked bitwise above) equals ours token for token on a
    left-padded batch of real prompts."""
    from transformers import AutoTokenizer

    from hf_llmkit.testing import smollm2_path

    path = smollm2_path(num_hidden_layers=2)
    config = DKMConfig(bits=4, kmeans_iters=3)
    AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval().save_pretrained(tmp_path / "dkm")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dkm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(
        ["The capital of France is", "Python is a"], return_tensors="pt", padding=True, padding_side="left"
    )
    assert batch["attention_mask"].min() == 0  # the second prompt is padded
    with torch.no_grad():
        ours = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    file = export_onnx(model, tmp_path / "model.onnx")
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    got = greedy_generate(onnxruntime_session(file), ids, mask, max_new_tokens=6)
    assert np.array_equal(got, ours.numpy())


def test_external_data_above_the_threshold(tmp_path, monkeypatch):
    """The path models above protobuf's 2 GiB take (`EXTERNAL_DATA_ABOVE`), with a threshold of 0 bytes."""
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_ABOVE", 0)
    model = quantize_model(tiny_llama(num_hidden_layers=1), DKMConfig(bits=3)).eval()
    file = export_onnx(model, tmp_path / "out" / "model.onnx")
    data = tmp_path / "out" / "model.onnx.data"
    assert data.is_file() and data.stat().st_size > file.stat().st_size
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.onnx", "model.onnx.data"]
    ids = np.array([[3, 17, 99, 4]])
    (logits, *_) = ort.InferenceSession(str(file)).run(None, _feed(model, ids, np.ones_like(ids), np.arange(4)[None]))
    with torch.no_grad():
        assert np.abs(logits - model(torch.from_numpy(ids)).logits.numpy()).max() <= 1e-5


@pytest.mark.parametrize("dense", [False, True], ids=["palettized", "dense"])
def test_a_head_tied_to_the_clustered_embedding_exports_as_that_embedding(tmp_path, dense):
    """tie_word_embeddings + quantize_embeddings: the LM head (TiedDKMHead) multiplies by the embedding's own table
    and indices, stored once in the file; the logits are the reloaded checkpoint's."""
    config = DKMConfig(bits=3, quantize_embeddings=True, embedding_bits=8)
    model = quantize_model(tiny_llama(num_hidden_layers=1, tie_word_embeddings=True), config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    file = export_onnx(model, tmp_path / "model.onnx", dense=dense)
    graph = onnx.load(str(file)).graph
    names = {i.name for i in graph.initializer}
    assert not any("lm_head" in name for name in names)  # one copy, the embedding's: packed (or decoded)
    embedding = {"weight"} if dense else {"weight_packed", "weight_lut"}
    assert {n.rsplit(".", 1)[-1] for n in names if ".embed_tokens." in n} >= embedding
    ids = np.array([[3, 17, 99, 4, 250, 8]])
    (logits, *_) = ort.InferenceSession(str(file)).run(None, _feed(model, ids, np.ones_like(ids), np.arange(6)[None]))
    with torch.no_grad():
        assert np.abs(logits - model(torch.from_numpy(ids)).logits.numpy()).max() <= 1e-5


def test_bad_input_is_one_value_error_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="has no DKM layers"):
        export_onnx(tiny_llama(), tmp_path / "m.onnx")
    model = quantize_model(tiny_llama(num_hidden_layers=1), DKMConfig(bits=3)).eval()
    with pytest.raises(ValueError, match="must be an .onnx file or a new folder"):
        export_onnx(model, tmp_path / "m.pt")
    with pytest.raises(ValueError, match="opset must be an integer >= 18"):
        export_onnx(model, tmp_path / "m.onnx", opset=11)
    with pytest.raises(ValueError, match="expected a transformers causal LM"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "m.onnx")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        export_onnx(model, tmp_path / "full")
    (tmp_path / "dir.onnx").mkdir()
    with pytest.raises(ValueError, match="is a folder: name the file"):
        export_onnx(model, tmp_path / "dir.onnx")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        export_onnx(model, tmp_path / "file" / "m.onnx")
    with pytest.raises(ValueError, match="external_data must be True or False"):
        export_onnx(model, tmp_path / "m.onnx", external_data="yes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.onnx", "file", "full"]  # nothing written


@pytest.mark.parametrize("folder", [True, False])
def test_an_interrupted_write_leaves_nothing_and_a_finished_one_replaces_the_target(tmp_path, folder):
    """`staging`, which every export writes through: an error half-way leaves nothing under the target's name."""
    from hf_llmkit.quantization.export._common import staging

    target = tmp_path / ("served" if folder else "model.onnx")
    with pytest.raises(RuntimeError, match="disk full"), staging(target, folder=folder) as tmp:
        (tmp / "model.onnx").write_bytes(b"half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    with staging(target, folder=folder) as tmp:
        (tmp / "model.onnx").write_bytes(b"whole")
        (tmp / "model.onnx.data").write_bytes(b"data")
    written = target / "model.onnx" if folder else target
    assert written.read_bytes() == b"whole" and not list(tmp_path.glob(".*partial*"))
    if folder:  # another writer filled the folder meanwhile: refused, the other's files kept
        (tmp_path / "again").mkdir()
        with (
            pytest.raises(ValueError, match="written by something else"),
            staging(tmp_path / "again", folder=True) as t,
        ):
            (t / "model.onnx").write_bytes(b"mine")
            (tmp_path / "again" / "theirs").write_text("x")
        assert [p.name for p in (tmp_path / "again").iterdir()] == ["theirs"]


def test_command_exports_a_folder_that_generates_like_the_model(exported):
    """`python -m hf_llmkit.quantization.export onnx CHECKPOINT FOLDER` on a compact checkpoint (the fixture's
    export): it prints the folder, and the folder (model, config, tokenizer-free here) generates what the reloaded
    model generates."""
    model, folder, _, (code, stdout) = exported
    assert code == 0 and Path(stdout.strip().splitlines()[-1]) == Path("exported")
    assert {"model.onnx", "config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    ids = np.array([[3, 17, 99, 4]])
    got = greedy_generate(onnxruntime_session(folder / "model.onnx"), ids, max_new_tokens=4)
    with torch.no_grad():
        ours = model.generate(input_ids=torch.from_numpy(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert np.array_equal(got, ours.numpy())


def test_prefill_decodes_above_the_switch_and_keeps_the_fused_tokens(exported, monkeypatch):
    """Issue 53: above `lut_gemv.MAX_FUSED_TOKENS` tokens (`lut_gemv.decodes`, the PyTorch layers' switch too) the
    kernel session's `LutMatMul` nodes decode their weight into the reused buffer, a few rows at a time here
    (`DECODE_CHUNK`), and multiply with one GEMM; greedy tokens from a short prompt (fused) and a long one (decoded)
    equal the model's and the all-fused session's (the kernel before the switch), the long prompt's logits within
    1e-5 of the fused ones (the tolerance of the padded-prompt test above). The file is unchanged: no dense weight in
    it (`test_the_file_holds_the_checkpoint_tensors_and_onnxruntime_folds_nothing_weight_sized`)."""
    from hf_llmkit.quantization import lut_gemv
    from hf_llmkit.quantization.export import onnx_runtime

    model, folder, *_ = exported
    session = onnxruntime_session(folder / "model.onnx")
    monkeypatch.setattr(onnx_runtime, "DECODE_CHUNK", 1000)  # blocks of 15 rows of 64 weights, 7 of 128: uneven
    short = np.array([[5, 9, 33, 2, 7]])
    long = np.random.default_rng(0).integers(3, model.config.vocab_size, (1, 3 * lut_gemv.MAX_FUSED_TOKENS + 5))
    assert not lut_gemv.decodes(short.shape[1]) and lut_gemv.decodes(long.shape[1])
    feed = _feed(model, long, np.ones_like(long), np.arange(long.shape[1])[None])
    decoded = {prompt.shape[1]: greedy_generate(session, prompt, max_new_tokens=6) for prompt in (short, long)}
    (decoded_logits, *_) = session.run(None, feed)
    with torch.no_grad():
        for prompt in (short, long):
            ours = model.generate(input_ids=torch.from_numpy(prompt), max_new_tokens=6, do_sample=False).numpy()
            assert np.array_equal(decoded[prompt.shape[1]][:, : ours.shape[1]], ours)  # generate stops at EOS
    monkeypatch.setattr(lut_gemv, "MAX_FUSED_TOKENS", 10**9)  # every product fused, as before the switch
    for prompt in (short, long):
        assert np.array_equal(greedy_generate(session, prompt, max_new_tokens=6), decoded[prompt.shape[1]])
    (fused_logits, *_) = session.run(None, feed)
    assert np.abs(decoded_logits - fused_logits).max() <= 1e-5


def _kernel_layer(model, weight):
    """What the `LutMatMul` kernel reads of one palettized weight: its node's arrays as onnxruntime hands them over."""
    from hf_llmkit.quantization.export import onnx_runtime

    packed, table, meta, *_, offsets, scale = lut_op.OnnxPalettized(model.get_submodule(weight.name), weight).tensors()
    scale = None if scale is None else scale.numpy()
    return onnx_runtime._layer(packed.numpy(), table.numpy(), meta.numpy(), offsets.shape[0], scale)


def test_the_decoded_product_reads_whole_row_groups_in_blocks():
    """`onnx_runtime._decoded_product` over tables per group of 16 rows, in blocks of whole groups: the whole decoded
    weight's GEMM within float32 rounding (the BLAS kernel may differ with the block's width), and the fused kernel's
    product too (the node's arrays as onnxruntime hands them to the kernel)."""
    from hf_llmkit.quantization import _lut_native as native
    from hf_llmkit.quantization.export import onnx_runtime

    model = quantize_model(tiny_llama(num_hidden_layers=1), DECODE_CASES["4bit-per-grouped-channel-bf16"]).eval()
    weight = next(w for w in palettized_weights(model) if w.name.endswith("up_proj"))  # [128, 64]: 8 tables
    layer = _kernel_layer(model, weight)
    if not native.supports(layer):
        pytest.skip(f"the DKM CPU kernel does not serve the layer here ({native.unavailable_reason()})")
    x = torch.randn(20, layer.weight_shape[1])
    whole = x @ native.decode(layer, torch.float32).t()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_runtime, "DECODE_CHUNK", 40 * 64)  # 40 rows fit: blocks of 32 rows (2 groups), 4 blocks
        assert [(a, b) for _, a, b in onnx_runtime._row_blocks(layer)] == [(0, 32), (32, 64), (64, 96), (96, 128)]
        blocks = onnx_runtime._decoded_product(layer, x)
    assert torch.allclose(blocks, whole, rtol=0, atol=1e-6)
    assert torch.allclose(blocks, native.gemv(layer, x, torch.float32), rtol=0, atol=1e-5)


def test_sessions_in_two_threads_decode_into_buffers_of_their_own():
    """The decode and the GEMM release the GIL: two threads prefilling at once (two sessions, or onnxruntime's
    parallel executor) each decode into a buffer of their own, and each gets its own layer's product."""
    import threading

    from hf_llmkit.quantization import _lut_native as native
    from hf_llmkit.quantization.export import onnx_runtime

    model = quantize_model(tiny_llama(num_hidden_layers=1), DECODE_CASES["3bit-block-scales-fp16"]).eval()
    layers = [_kernel_layer(model, weight) for weight in palettized_weights(model)[-2:]]
    if not all(native.supports(layer) for layer in layers):
        pytest.skip(f"the DKM CPU kernel does not serve the layers here ({native.unavailable_reason()})")
    xs = [torch.randn(32, layer.weight_shape[1]) for layer in layers]
    wrong, start = [], threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        for _ in range(200):
            if not torch.equal(onnx_runtime._decoded_product(layers[i], xs[i]), expected[i]):
                wrong.append(i)
                return

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_runtime, "DECODE_CHUNK", 512)  # many blocks: many chances to overwrite a shared buffer
        expected = [onnx_runtime._decoded_product(layer, x) for layer, x in zip(layers, xs)]  # one thread
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert wrong == []
