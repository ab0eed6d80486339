"""hf_llmkit.cli.folders: output, cache, model, tokenizer and checkpoint folders are checked before any work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_llmkit.cli.folders import (
    check_checkpoint_folder,
    check_model_folder,
    check_tokenizer_folder,
    check_writable_folder,
)
from hf_llmkit.testing import tiny_llama
from tests.cli.permissions import honour_permissions


def test_writable_folder_probe_leaves_nothing_behind(tmp_path):
    check_writable_folder(tmp_path / "new" / "out", flag="--output_dir")
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []
    check_writable_folder(tmp_path, flag="--output_dir")
    assert list(tmp_path.iterdir()) == []


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="--output_dir .*f is a file; pass a folder"):
        check_writable_folder(tmp_path / "f", flag="--output_dir")
    with pytest.raises(ValueError, match="is inside .*f, which is a file"):
        check_writable_folder(tmp_path / "f" / "sub", flag="--output_dir")


def test_unwritable_folder_is_found_by_writing(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    code = (
        "from hf_llmkit.cli.folders import check_writable_folder\n"
        f"for path, flag in [({str(locked / 'out')!r}, '--output_dir'), ({str(locked)!r}, '--data_cache_dir')]:\n"
        "    try:\n"
        "        check_writable_folder(path, flag=flag)\n"
        "    except ValueError as err:\n"
        "        print(err)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, **honour_permissions()
    )
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all("is not writable (Permission denied" in line for line in lines), proc.stderr[-2000:]
    assert lines[0].startswith("--output_dir") and lines[1].startswith("--data_cache_dir")


def test_model_folder_checks(tmp_path):
    with pytest.raises(ValueError, match="does not exist; pass a local model folder"):
        check_model_folder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        check_model_folder(tmp_path / "empty")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match="config.json is corrupt"):
        check_model_folder(corrupt)
    (corrupt / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="names no model_type"):
        check_model_folder(corrupt)
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    check_model_folder(model_dir)
    weights = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has a config.json but no weights"):
        check_model_folder(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\xff" * 8 + weights[8:100])
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        check_model_folder(model_dir)


def test_tokenizer_and_checkpoint_folders(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer_name_or_path .* does not exist"):
        check_tokenizer_folder(tmp_path / "missing")
    (tmp_path / "tok").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        check_tokenizer_folder(tmp_path / "tok")
    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"is not a checkpoint: no trainer_state.json \(it holds checkpoint-4: pass"):
        check_checkpoint_folder(run)
    (run / "checkpoint-4" / "trainer_state.json").write_text("{garbage")
    with pytest.raises(ValueError, match="trainer_state.json is corrupt"):
        check_checkpoint_folder(run / "checkpoint-4")
    (run / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    check_checkpoint_folder(run / "checkpoint-4")
