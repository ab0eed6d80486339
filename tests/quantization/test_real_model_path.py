"""The whole path of docs/dkm.md's recipe on a two-layer slice of the real SmolLM2-135M-Instruct (issue 43): SFT with
LoRA on instruction records, the adapter merged by the job (`--merge_adapter`), DKM 3-bit from the calibrated start
plus training by distillation from the merged model (`--dkm_recipe calibrated --distill_from_source true`) with its
compact save, reload, generate, and the ONNX export, whose greedy
generation in onnxruntime equals ours. The same commands `benchmarks/areas/dkm/recipe.py` times on the whole model.

At this size the slice is no language model (its next-token losses are far above the whole model's), so the
ordering asserted is the one that holds here: on held-out text, the saved DKM model stays closer to the model it
was quantized from (KL of the next-token distributions) than plain k-means tables of the same width with
nearest-entry rounding (no block scales, refit or calibration).
"""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import PalettizedLinear, export_onnx, quantize_model
from hf_llmkit.quantization.export import greedy_generate
from hf_llmkit.testing import corpus_texts, smollm2_path
from tests.conftest import load_example

SIZES = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--max_seq_length", "32", "--max_train_samples",
         "8", "--do_eval", "false", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
         "--warmup_steps", "0"]  # fmt: skip


def _kl(reference: torch.Tensor, model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logq = F.log_softmax(model(ids).logits.float(), -1)
    return (reference.exp() * (reference - logq)).sum(-1).mean().item()


@pytest.mark.slow  # a minute on two quiet cores, most of it the ONNX export's tracing
@pytest.mark.timeout(1800)
def test_sft_merge_dkm_reload_generate_export_on_a_slice_of_the_real_model(tmp_path):
    run_sft = load_example("run_sft")
    source = str(smollm2_path(num_hidden_layers=2))
    sft = run_sft.run(["--model_name_or_path", source, "--peft_method", "lora", "--merge_adapter",
                       "--learning_rate", "2e-3", "--output_dir", str(tmp_path / "sft"), *SIZES])  # fmt: skip
    merged = tmp_path / "sft" / "merged"
    assert sft["merged_model"] == str(merged) and sft["global_step"] == 1
    dkm = run_sft.run(["--model_name_or_path", str(merged), "--quantization", "dkm", "--dkm_bits", "3",
                       "--dkm_recipe", "calibrated", "--distill_from_source", "true", "--dkm_calibration_samples", "4",
                       "--learning_rate", "2e-5", "--output_dir", str(tmp_path / "dkm"), *SIZES])  # fmt: skip
    assert dkm["global_step"] == 1 and dkm["train_loss"] > 0 and dkm["train_loss_of"].startswith("KL(source")

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dkm").eval()  # the compact checkpoint
    assert sum(isinstance(m, PalettizedLinear) for m in model.modules()) == 14  # every decoder Linear, packed
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dkm")
    prompt = tokenizer("Explain what the assert statement does.", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 4)

    ids = torch.tensor([tokenizer("\n\n".join(corpus_texts()[-8:]))["input_ids"][:128]])  # never trained on
    teacher = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        reference = F.log_softmax(teacher(ids).logits.float(), -1)
    plain = quantize_model(AutoModelForCausalLM.from_pretrained(merged), DKMConfig(bits=3)).eval()
    assert _kl(reference, model, ids) < _kl(reference, plain, ids)

    served = export_onnx(model, tmp_path / "served", tokenizer_from=tmp_path / "dkm")  # what the docs' command writes
    session = onnxruntime.InferenceSession(str(served / "model.onnx"))
    assert np.array_equal(greedy_generate(session, prompt.numpy(), max_new_tokens=4), out.numpy())
