"""`python -m hf_llmkit.quantization.export`: every failure is one `error:` line naming the fix, exit 2, checked
before the checkpoint is read where it can be, and nothing is left under the output's name (issue 46's cases)."""

from __future__ import annotations

import pytest
import torch

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import quantize_model
from hf_llmkit.quantization.export import __main__ as command
from hf_llmkit.testing import tiny_llama

pytest.importorskip("onnxscript", reason="the ONNX export needs the `export` extra")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export_command") / "dkm"
    quantize_model(tiny_llama(num_hidden_layers=1), DKMConfig(bits=3)).eval().save_pretrained(folder)
    return folder


def _run(capsys, *argv) -> tuple[int, list[str]]:
    code = command.main([str(a) for a in argv])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    return code, errors


def test_missing_export_extra_names_the_install_before_any_work(tmp_path, capsys, monkeypatch, checkpoint):
    monkeypatch.setattr(command, "_installed", lambda name: name != "onnxscript")
    code, errors = _run(capsys, "onnx", checkpoint, tmp_path / "out")
    assert code == 2 and errors == [
        "error: the onnx export needs onnxscript (not installed): pip install 'hf_llmkit[export]'"
    ]
    assert list(tmp_path.iterdir()) == []  # no empty output folder left behind


def test_damaged_checkpoint_is_one_line(tmp_path, capsys, checkpoint):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    code, errors = _run(capsys, "onnx", damaged, tmp_path / "out.onnx")
    assert code == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: cannot load the checkpoint {str(damaged)!r} (SafetensorError")
    assert "save it again" in errors[0] and not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["onnx", "{ckpt}", "{tmp}/m.mlpackage"], "path must be an .onnx file or a new folder"),
        (["coreml", "{ckpt}", "{tmp}/m.onnx"], "path must end in .mlpackage"),
        (["onnx", "{ckpt}", "{tmp}/full"], "exists and is not an empty folder"),
        (["onnx", "{ckpt}", "{tmp}/file/m.onnx"], "is not a folder"),
        (["onnx", "{ckpt}", "{tmp}/m.onnx", "--seq_len", "128"], "apply to coreml only"),
        (["coreml", "{ckpt}", "{tmp}/m.mlpackage", "--seq_len", "0"], "seq_len must be an integer in"),
        (["coreml", "{ckpt}", "{tmp}/m.mlpackage", "--seq_len", "100000"], "seq_len must be an integer in"),
        (["coreml", "{ckpt}", "{tmp}/m.mlpackage", "--batch_size", "0"], "batch_size must be an integer in"),
        (["coreml", "{ckpt}", "{tmp}/file"], "path must end in .mlpackage"),
        (["onnx", "{ckpt}", "{tmp}/model.v1.2"], "must be an .onnx file or a new folder (no suffix)"),
        (["onnx", "{tmp}/nowhere", "{tmp}/m.onnx"], "does not exist: pass the folder save_pretrained wrote"),
        (["onnx", "{tmp}", "{tmp}/m.onnx"], "has no config.json"),
        # issue 52: a file form over an existing output replaced it without a word (a user's notes.txt deleted)
        (["coreml", "{ckpt}", "{tmp}/notes.mlpackage"], "notes.mlpackage' exists and is not empty (the export would"),
        (["onnx", "{ckpt}", "{tmp}/mine.onnx"], "mine.onnx' exists (the export would overwrite it): remove it or"),
        (["onnx", "{ckpt}", "{tmp}/ext.onnx"], "ext.onnx.data' exists (the export would overwrite it): remove it"),
    ],
)
def test_bad_output_or_option_is_refused_before_the_checkpoint_is_read(argv, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes.mlpackage").mkdir()
    (tmp_path / "notes.mlpackage" / "notes.txt").write_text("the user's notes")
    (tmp_path / "mine.onnx").write_text("the user's model")
    (tmp_path / "ext.onnx.data").write_text("the user's weights")
    ckpt = tmp_path / "ckpt"  # a config and nothing loadable: the checks must not need it
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", never)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, errors = _run(capsys, *[a.format(ckpt=ckpt, tmp=tmp_path) for a in argv])
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "notes.mlpackage" / "notes.txt").read_text() == "the user's notes"
    assert (tmp_path / "mine.onnx").read_text() == "the user's model"


def test_an_unreadable_config_is_one_line(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    code, errors = _run(capsys, "onnx", tmp_path / "ckpt", tmp_path / "out.onnx")
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: cannot load the checkpoint"), errors
    assert not (tmp_path / "out.onnx").exists()


def test_a_session_without_onnxruntime_extensions_names_the_package(monkeypatch):
    import sys

    from hf_llmkit.quantization.export import onnx_runtime

    monkeypatch.setattr(onnx_runtime, "_REGISTERED", False)
    monkeypatch.setitem(sys.modules, "onnxruntime_extensions", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install onnxruntime-extensions"):
        onnx_runtime.onnxruntime_session("model.onnx")


def test_a_converter_failure_of_any_type_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, checkpoint):
    import hf_llmkit.quantization.export as export

    def crash(*args, **kwargs):
        raise KeyError("an exporter bug")

    monkeypatch.setattr(export, "export_onnx", crash)
    code, errors = _run(capsys, "onnx", checkpoint, tmp_path / "out")
    assert code == 2 and len(errors) == 1
    assert errors[0].startswith("error: the onnx conversion failed (KeyError: 'an exporter bug'); nothing was written")
    assert list(tmp_path.iterdir()) == []


def test_dkm_upcycled_moe_exports_to_onnx_and_core_ml(tmp_path):
    """A DKM + upcycled-MoE output (saved, reloaded as transformers' Mixtral) exports: ONNX generates our tokens
    (experts traced with batched_mm), Core ML converts; a live model with hf_llmkit's MoELayer blocks (upcycled with a
    capacity factor: transformers' blocks cannot drop tokens) is one ValueError."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from hf_llmkit.parallel import upcycle_to_moe
    from hf_llmkit.quantization.export import export_coreml, export_onnx, greedy_generate, onnxruntime_session

    torch.manual_seed(0)
    moe = upcycle_to_moe(tiny_llama(num_hidden_layers=1), num_experts=4, top_k=2, capacity_factor=4.0)  # drops nothing
    live = quantize_model(moe, DKMConfig(bits=3))
    with pytest.raises(ValueError, match="save it with save_pretrained and export"):
        export_onnx(live.eval(), tmp_path / "live.onnx")
    live.eval().save_pretrained(tmp_path / "moe")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert type(model).__name__ == "MixtralForCausalLM"
    file = export_onnx(model, tmp_path / "moe.onnx")
    ids = np.array([[3, 17, 99, 4]])
    got = greedy_generate(onnxruntime_session(file), ids, max_new_tokens=4)
    with torch.no_grad():
        ours = model.generate(input_ids=torch.from_numpy(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert np.array_equal(got, ours.numpy())
    pytest.importorskip("coremltools")
    assert export_coreml(model, tmp_path / "moe.mlpackage", seq_len=16).is_dir()


def test_a_torch_onnx_failure_shows_its_cause_not_the_exporters_banner(tmp_path, capsys, monkeypatch, checkpoint):
    """Issue 52: the line was torch.onnx's "Failed to export ... step 1/3 ... Next steps:" banner with ANSI colour
    codes; it is the tracer's own error, the one the banner wraps (a real `torch.onnx.export` failure here)."""
    import hf_llmkit.quantization.export as export

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # torch.export cannot trace a branch on a tensor's value

    def failing_export(model, path, **kwargs):
        torch.onnx.export(DataDependent(), (torch.ones(3),), dynamo=True, verbose=False)

    monkeypatch.setattr(export, "export_onnx", failing_export)
    code, errors = _run(capsys, "onnx", checkpoint, tmp_path / "out")
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("error: the onnx conversion failed (GuardOnDataDependentSymNode: Could not guard on")
    assert "\x1b" not in errors[0] and "step 1/3" not in errors[0] and "nothing was written" in errors[0]
    assert list(tmp_path.iterdir()) == []
