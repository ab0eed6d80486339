"""An adapter trained on the built-in model is reusable: output_dir/base holds the base it was trained on.

`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter")` in a fresh
process gives the evaluated model: its loss on the held-out blocks equals the run's `eval_loss`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_llmkit.data.corpus import corpus_texts
from tests.examples.test_run_clm_peft import TINY

RELOAD = """
import json, sys
from pathlib import Path
import torch
import hf_llmkit
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_llmkit.data.blocks import build_lm_datasets

out, held = Path(sys.argv[1]), Path(sys.argv[2]).read_text().splitlines()
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter").eval()
tokenizer = AutoTokenizer.from_pretrained(out / "base")
blocks = build_lm_datasets(tokenizer=tokenizer, block_size=32, texts=held, validation_texts=held)["validation"]
ids = torch.tensor(blocks["input_ids"][: int(sys.argv[3])])  # the run's --max_eval_samples
with torch.no_grad():
    loss = model(input_ids=ids, labels=ids).loss.item()
    auto = AutoPeftModelForCausalLM.from_pretrained(out / "adapter").eval()  # base found from adapter_config.json
    auto_loss = auto(input_ids=ids, labels=ids).loss.item()
print(json.dumps({"loss": loss, "auto_loss": auto_loss, "blocks": len(ids)}))
"""


@pytest.mark.parametrize(
    "flags",
    [
        ["--peft_method", "lora", "--lora_rank", "4"],
        pytest.param(["--peft_method", "bottleneck", "--bottleneck_size", "8"], marks=pytest.mark.slow),
    ],
    ids=["lora", "bottleneck"],
)
def test_adapter_on_the_saved_base_reproduces_the_evaluated_model(run_clm, tmp_path, flags):
    held = tmp_path / "held_out.txt"
    held.write_text("\n".join(corpus_texts()[-12:]), encoding="utf-8")  # 20 blocks, the first 8 evaluated
    out = tmp_path / "out"
    results = run_clm.run([*TINY, *flags, "--output_dir", str(out), "--validation_file", str(held)])
    assert results["adapter_base"] == str(out / "base")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == (out / "base").resolve()
    assert (out / "base" / "model.safetensors").is_file() and (out / "base" / "tokenizer.json").is_file()
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD, str(out), str(held), "8"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reloaded = json.loads(proc.stdout.strip().splitlines()[-1])
    evaluated = json.loads((out / "eval_results.json").read_text())
    assert reloaded["blocks"] == evaluated["eval_samples"] == 8  # one batch: the Trainer's loss is this loss
    assert reloaded["loss"] == pytest.approx(evaluated["eval_loss"], abs=1e-5)
    assert reloaded["auto_loss"] == pytest.approx(evaluated["eval_loss"], abs=1e-5)
