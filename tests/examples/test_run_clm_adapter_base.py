"""An adapter is reusable: output_dir/base holds the base it was trained on when that base exists nowhere else (built
from scratch; DKM-clustered, or upcycled into experts, after loading a model folder).

`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter")` in a fresh
process (a child of the warm interpreter, tests/warm.py: nothing of the run is in it) gives the evaluated model: its
loss on the held-out blocks equals the run's `eval_loss`. Under `--quantization dkm` (issue 46) the base keeps its
DKM layers' training state, so it reloads as layers every PEFT method wraps (a compact checkpoint's packed layers are
none: the reload failed for LoRA, bottleneck, BitFit and P-tuning v2), and a calibration that changed them during the
run is in it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_llmkit  # noqa: F401  (registers hf_llmkit's PEFT methods and DKM layers, also where reload_loss runs)
from hf_llmkit.data.blocks import build_lm_datasets
from hf_llmkit.data.corpus import corpus_texts
from tests import warm
from tests.examples.test_run_clm_peft import TINY


def reload_loss(out: str, held: str, samples: int) -> dict:
    """Run in a fresh process: the adapter on the saved base, and `AutoPeftModelForCausalLM` from the adapter alone
    (its base found from adapter_config.json), each one's loss on the first `samples` held-out blocks."""
    out, texts = Path(out), Path(held).read_text().splitlines()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "base")
    blocks = build_lm_datasets(tokenizer=tokenizer, block_size=32, texts=texts, validation_texts=texts)["validation"]
    ids = torch.tensor(blocks["input_ids"][:samples])  # the run's --max_eval_samples
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
        auto = AutoPeftModelForCausalLM.from_pretrained(out / "adapter").eval()
        auto_loss = auto(input_ids=ids, labels=ids).loss.item()
    return {"loss": loss, "auto_loss": auto_loss, "blocks": len(ids)}


DKM = ["--quantization", "dkm"]
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "flags",
    [
        ["--peft_method", "lora", "--lora_rank", "4"],
        pytest.param(["--peft_method", "bottleneck", "--bottleneck_size", "8"], marks=SLOW),
        [*DKM, "--peft_method", "lora", "--lora_rank", "4"],
        [*DKM, "--peft_method", "bottleneck", "--bottleneck_size", "8", "--dkm_recipe", "calibrated",
         "--dkm_calibration_samples", "4", "--dkm_scale_block_size", "16"],
        pytest.param([*DKM, "--peft_method", "bitfit", "--dkm_calibration_samples", "4"], marks=SLOW),
        pytest.param([*DKM, "--peft_method", "ptuning_v2", "--num_virtual_tokens", "4"], marks=SLOW),
        [*DKM, "--dkm_quantize_embeddings", "true", "--config_overrides", "tie_word_embeddings=true",
         "--peft_method", "lora", "--lora_rank", "4"],  # the LM head is the clustered embedding (TiedDKMHead)
    ],
    ids=["lora", "bottleneck", "dkm-lora", "dkm-recipe-bottleneck", "dkm-calibrated-bitfit", "dkm-ptuning_v2",
         "dkm-tied-embeddings-lora"],
)  # fmt: skip
def test_adapter_on_the_saved_base_reproduces_the_evaluated_model(run_clm, tmp_path, flags):
    held = tmp_path / "held_out.txt"
    held.write_text("\n".join(corpus_texts()[-12:]), encoding="utf-8")  # 20 blocks, the first 8 evaluated
    out = tmp_path / "out"
    results = run_clm.run([*TINY, *flags, "--output_dir", str(out), "--validation_file", str(held)])
    _check_reload(out, held, results)


def test_an_adapter_on_an_upcycled_model_folder_is_saved_with_its_experts(run_clm, tmp_path):
    """Issue 46 (found attacking it): with --model_name_or_path and --upcycle_moe true the adapter named no base
    (`base_model_name_or_path: null`) and the folder's dense model was no base for it."""
    dense = tmp_path / "dense"
    run_clm.run([*TINY, "--output_dir", str(dense), "--do_eval", "false", "--save_strategy", "no"])
    held = tmp_path / "held_out.txt"
    held.write_text("\n".join(corpus_texts()[-12:]), encoding="utf-8")
    out = tmp_path / "out"
    flags = ["--model_name_or_path", str(dense), "--upcycle_moe", "true", "--moe_num_experts", "2",
             "--peft_method", "lora", "--target_modules", "q_proj,v_proj"]  # fmt: skip
    results = run_clm.run([*TINY[10:], *flags, "--output_dir", str(out), "--validation_file", str(held)])
    _check_reload(out, held, results)


def _check_reload(out: Path, held: Path, results: dict) -> None:
    assert results["adapter_base"] == str(out / "base")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == (out / "base").resolve()
    assert (out / "base" / "model.safetensors").is_file() and (out / "base" / "tokenizer.json").is_file()
    reloaded = warm.call(reload_loss, str(out), str(held), 8, timeout=300)  # a child of tests/warm.py
    evaluated = json.loads((out / "eval_results.json").read_text())
    assert reloaded["blocks"] == evaluated["eval_samples"] == 8  # one batch: the Trainer's loss is this loss
    assert reloaded["loss"] == pytest.approx(evaluated["eval_loss"], abs=1e-5)
    assert reloaded["auto_loss"] == pytest.approx(evaluated["eval_loss"], abs=1e-5)
