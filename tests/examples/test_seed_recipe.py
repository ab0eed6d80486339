"""The seed recipe's flags with the seed's meaning (Chinese-LLaMA-Alpaca-2 `run_pt.sh`), and run_pt.sh itself.

`examples/run_pt.sh` runs on 2 CPU ranks (torchrun, DeepSpeed ZeRO-2, LoRA on every projection with
embed_tokens and lm_head trained in full, gradient checkpointing) and prints nothing a user cannot act on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_llmkit.testing import corpus_tokenizer, tiny_llama
from tests import warm
from tests.conftest import EXAMPLES
from tests.examples.test_run_clm_peft import TINY

RUN = TINY[10:]  # block size, batch sizes, samples, logging, 2 steps: no model sizes (the model is a folder)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """A pretrained-model folder whose lm_head is tied to embed_tokens (as in many small LMs)."""
    folder = tmp_path_factory.mktemp("tied_llama")
    tiny_llama(tie_word_embeddings=True).save_pretrained(folder)
    corpus_tokenizer(vocab_size=512).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kbits", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_kbit_base_with_seed_lora_flags_keeps_tied_embeddings_tied(run_clm, tied_model, tmp_path, kbits):
    """--load_in_kbits 4: a bitsandbytes NF4 base (on CPU too) under LoRA with the seed's comma-separated flags."""
    out = tmp_path / "out"
    flags = ["--model_name_or_path", str(tied_model), "--peft_method", "lora", "--load_in_kbits", str(kbits),
             "--trainable", "q_proj,v_proj,k_proj,o_proj,gate_proj,down_proj,up_proj", "--lora_rank", "4",
             "--lora_alpha", "8", "--lora_dropout", "0.05", "--modules_to_save", "embed_tokens,lm_head"]  # fmt: skip
    results = run_clm.run([*RUN, *flags, "--output_dir", str(out)])
    assert results["global_step"] == 2
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    assert sum("lora_A" in k for k in saved) == 2 * 7  # 7 projections x 2 layers
    assert any("embed_tokens" in k for k in saved)
    base = AutoModelForCausalLM.from_pretrained(tied_model)
    model = PeftModel.from_pretrained(base, out / "adapter")
    # one trained embedding matrix serves input and output: the tie survives training and reloading
    assert torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    assert not torch.equal(model.get_input_embeddings().weight, tiny_llama(tie_word_embeddings=True).lm_head.weight)


def test_tied_parameters_are_counted_once(run_clm, tied_model, tmp_path):
    results = run_clm.run([*RUN, "--model_name_or_path", str(tied_model), "--output_dir", str(tmp_path)])
    model = tiny_llama(tie_word_embeddings=True)
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert results["parameters"] == unique == results["trainable_parameters"]
    assert unique < sum(p.numel() for p in model.state_dict().values())  # lm_head.weight is not a second matrix


def test_dataset_dir_of_many_files_with_seed_data_flags(run_clm, tmp_path):
    from hf_llmkit.data.corpus import write_corpus_files

    files = write_corpus_files(tmp_path / "dataset", files=6)
    flags = ["--dataset_dir", str(tmp_path / "dataset"), "--data_cache_dir", str(tmp_path / "cache"),
             "--validation_split_percentage", "0.001", "--preprocessing_num_workers", "2", "--torch_dtype", "float16",
             "--peft_method", "lora", "--trainable", "q_proj,v_proj", "--num_train_epochs", "1",
             "--output_dir", str(tmp_path / "out")]  # fmt: skip
    results = run_clm.run([*TINY, *flags])  # TINY's --max_steps 2 is typed: it wins over the epoch
    assert len(files) == 6 and results["global_step"] == 2
    assert any((tmp_path / "cache").glob("lm-blocks-*/train.arrow"))  # processed once, cached there
    evaluated = (tmp_path / "out" / "eval_results.json").read_text()
    assert '"eval_samples": 1' in evaluated  # 0.001 percent of the blocks: at least one block


def test_num_train_epochs_replaces_the_embedded_step_count(run_clm):
    args = run_clm.parse_args(["--num_train_epochs", "1", "--warmup_ratio", "0.05", "--gradient_checkpointing"])
    assert args.training.max_steps == -1 and args.training.num_train_epochs == 1
    assert args.training.warmup_steps == 0.05 and args.training.activation_checkpointing
    with pytest.raises(run_clm.UsageError, match="--warmup_ratio or --warmup_steps, not both"):
        run_clm.parse_args(["--warmup_ratio", "0.05", "--warmup_steps", "3"])


UNACTIONABLE = re.compile(
    r"Warning|WARNING|Setting accelerator to CPU|gemm_4bit_forward|find_unused_parameters|is deprecated"
)


def test_run_pt_sh_runs_the_seed_recipe_on_two_ranks_quietly(run_clm, shared_runs):
    """The seed's script as shipped (extra flags only cap the steps): trains LoRA under ZeRO-2 on 2 ranks. The run is
    docs/main_job.md's `bash examples/run_pt.sh` as the docs test runs it (the quickstart's model, the embedded corpus
    written as a folder of .txt files, `--max_steps 2`): made once per pytest run, by that test or this one
    (tests/docs/runner.py: documented_run)."""
    from tests.docs.runner import documented_run

    folder, proc = documented_run(shared_runs, run_clm, "bash examples/run_pt.sh")
    out = folder / "outputs" / "run_pt"
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| ranks                  | 2 " in proc.stdout and re.search(r"\| steps +\| 2 ", proc.stdout)
    assert "LoRA (rank 8, alpha 16)" in proc.stdout
    assert len(list((out / "dataset").glob("*.txt"))) == 8  # the corpus as a folder of .txt files
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    noise = [line for line in proc.stderr.splitlines() if UNACTIONABLE.search(line)]
    assert noise == [], noise
    info = [line for line in proc.stderr.splitlines() if " INFO run_clm: blocks of" in line]
    assert len(info) == 1  # per-rank information once, from rank 0


SEED_SCRIPT = EXAMPLES / "seed" / "run_clm_pt_with_peft.py"
PROJECTIONS = "q_proj,v_proj,k_proj,o_proj,gate_proj,down_proj,up_proj"


def test_the_seed_script_itself_trains_lora_under_zero2_on_two_ranks(tmp_path):
    """The seed's own training script (examples/seed/, adapted only where transformers 5 removed an API) with
    run_pt.sh's flags: 2 CPU ranks with torchrun's environment (forked from the warm interpreter, tests/warm.py: the
    subject is the script; run_pt.sh's test above runs torchrun itself), DeepSpeed ZeRO-2, LoRA on every projection
    with embed_tokens and lm_head trained in full, gradient checkpointing, a per-file block cache -- and our
    SavePeftModelCallback writing an adapter that reloads in this process."""
    from hf_llmkit.data.corpus import write_corpus_files

    model = tmp_path / "pretrained"
    tiny_llama().save_pretrained(model)
    corpus_tokenizer(vocab_size=512).save_pretrained(model)
    files = write_corpus_files(tmp_path / "dataset", files=3)
    out, cache = tmp_path / "out", tmp_path / "cache"
    flags = [
        "--deepspeed",
        str(EXAMPLES / "ds_zero2_no_offload.json"),
        "--model_name_or_path",
        str(model),
        "--tokenizer_name_or_path",
        str(model),
        "--dataset_dir",
        str(tmp_path / "dataset"),
        "--data_cache_dir",
        str(cache),
        "--validation_split_percentage",
        "0.001",
        "--per_device_train_batch_size",
        "1",
        "--do_train",
        "--seed",
        "4",
        "--torch_dtype",
        "float32",
        "--num_train_epochs",
        "1",
        "--lr_scheduler_type",
        "cosine",
        "--learning_rate",
        "2e-4",
        "--warmup_ratio",
        "0.05",
        "--weight_decay",
        "0.01",
        "--logging_strategy",
        "steps",
        "--logging_steps",
        "1",
        "--save_strategy",
        "steps",
        "--save_total_limit",
        "3",
        "--save_steps",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--preprocessing_num_workers",
        "2",
        "--block_size",
        "32",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "--ddp_timeout",
        "30000",
        "--logging_first_step",
        "True",
        "--lora_rank",
        "4",
        "--lora_alpha",
        "8",
        "--trainable",
        PROJECTIONS,
        "--lora_dropout",
        "0.05",
        "--modules_to_save",
        "embed_tokens,lm_head",
        "--load_in_kbits",
        "16",
        "--gradient_checkpointing",
        "--ddp_find_unused_parameters",
        "False",
        "--max_steps",
        "2",
        "--disable_tqdm",
        "true",
    ]  # fmt: skip  (the seed's run_pt.sh, with --fp16 left out: DeepSpeed on CPU has no fp16)
    warm.torchrun(SEED_SCRIPT, flags, nprocs=2, timeout=600)
    assert json.loads((out / "train_results.json").read_text())["train_samples"] > 0
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith("_text_32")) == sorted(
        f"{f.stem}_32" for f in files
    )  # each file's blocks cached on their own, as the seed does
    for folder in (out / "checkpoint-2" / "pt_lora_model", out / "pt_lora_model"):
        saved = load_file(folder / "adapter_model.safetensors")
        assert sum("lora_A" in k for k in saved) == 7 * 2  # 7 projections x 2 layers
        assert any("embed_tokens" in k for k in saved) and any("lm_head" in k for k in saved)
    base = AutoModelForCausalLM.from_pretrained(model)
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, out / "pt_lora_model")(ids).logits
    assert torch.isfinite(after).all() and not torch.allclose(before, after)
