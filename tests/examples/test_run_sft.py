"""examples/run_sft.py, supervised fine-tuning: only response tokens are learned, long records keep their response,
bad records are named by line, and the run trains, evaluates on response tokens and saves like run_clm.py."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_llmkit.data.corpus import corpus_tokenizer
from hf_llmkit.data.sft import (
    ALPACA,
    IGNORE_INDEX,
    InstructionCollator,
    PromptTemplate,
    check_length_budget,
    pack_examples,
    tokenize_record,
    tokenize_records,
)
from hf_llmkit.testing import tiny_llama
from tests import warm
from tests.conftest import load_example

SHORT = "Q: {instruction} {input}\nA: "
# A tiny model and a short prompt, so a few steps take a second or two on 2 cores.
TINY = [
    "--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
    "--max_position_embeddings", "128", "--max_seq_length", "128", "--prompt_template", SHORT,
    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--max_train_samples", "32",
    "--max_eval_samples", "8", "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0",
]  # fmt: skip
RECORD = {"instruction": "Name the statement that raises AssertionError.", "input": "", "output": "assert"}
EMPTY = {"instruction": "Say nothing at all, please, and do it with a rather long prompt.", "input": "x", "output": ""}


@pytest.fixture(scope="module")
def run_sft():
    return load_example("run_sft")


@pytest.fixture(scope="module")
def tokenizer():
    return corpus_tokenizer(vocab_size=512)


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_prompt_tokens_never_reach_the_loss(tokenizer):
    """Labels are -100 on exactly the prompt; a record whose response is empty adds nothing to loss or gradients."""
    example, cut = tokenize_record(RECORD, tokenizer, template=ALPACA, max_seq_length=512)
    prompt = [tokenizer.bos_token_id, *tokenizer(ALPACA.prompt(RECORD), add_special_tokens=False)["input_ids"]]
    assert cut is None and example["input_ids"][: len(prompt)] == prompt
    assert example["labels"] == [IGNORE_INDEX] * len(prompt) + example["input_ids"][len(prompt) :]
    assert example["labels"][-1] == tokenizer.eos_token_id  # the response ends with the end of text
    empty, _ = tokenize_record(EMPTY, tokenizer, template=ALPACA, max_seq_length=512)
    assert set(empty["labels"]) == {IGNORE_INDEX} and len(empty["input_ids"]) > len(example["input_ids"])

    collate = InstructionCollator(tokenizer.pad_token_id)
    both = collate([example, empty])
    assert both["input_ids"][0, len(example["input_ids"]) :].eq(tokenizer.pad_token_id).all()
    assert both["labels"][0, len(example["input_ids"]) :].eq(IGNORE_INDEX).all()
    assert both["attention_mask"].sum(1).tolist() == [len(example["input_ids"]), len(empty["input_ids"])]
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    alone_loss, alone_grads = _loss_and_grads(model, collate([example]))
    both_loss, both_grads = _loss_and_grads(model, both)
    torch.testing.assert_close(both_loss, alone_loss)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(both_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_truncation_keeps_the_response_when_it_can_and_counts_the_rest(tokenizer):
    short = {"instruction": "word " * 60, "input": "", "output": "assert"}  # long prompt, short response
    long = {"instruction": "Why?", "input": "", "output": "because " * 60}  # the response alone overflows
    template = PromptTemplate.parse(SHORT)
    examples, report = tokenize_records([RECORD, short, long], tokenizer, template=template, max_seq_length=40)
    assert [len(e["input_ids"]) for e in examples[1:]] == [40, 40]
    whole, _ = tokenize_record(short, tokenizer, template=template, max_seq_length=4096)
    learned = [label for label in whole["labels"] if label != IGNORE_INDEX]
    assert [label for label in examples[1]["labels"] if label != IGNORE_INDEX] == learned  # response kept whole
    assert examples[1]["input_ids"][0] == tokenizer.bos_token_id
    assert (
        examples[1]["input_ids"][-len(learned) - 3 : -len(learned)]
        == whole["input_ids"][-len(learned) - 3 : -len(learned)]
    )
    assert 0 < sum(label != IGNORE_INDEX for label in examples[2]["labels"]) < 61  # lost the end of its response
    assert (report.records, report.prompt_cut, report.response_cut) == (3, 1, 1)
    line = report.describe(40)
    assert "2 of 3 records are longer than --max_seq_length 40: 1 kept their whole response" in line
    assert "1 lost the end of their response" in line


def test_packing_concatenates_whole_examples_and_keeps_their_labels(tokenizer):
    examples, _ = tokenize_records([RECORD] * 5, tokenizer, template=ALPACA, max_seq_length=512)
    size = len(examples[0]["input_ids"])
    packs = pack_examples(examples, 2 * size + 1)
    assert [len(p["input_ids"]) for p in packs] == [2 * size, 2 * size, size]
    assert packs[0]["labels"] == examples[0]["labels"] * 2


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "input": "d"}\n', "line 3 has no 'output'"),
        ('[\n{"instruction": "a", "output": "b"},\n{"instruction": "c",\n"output": 7}]', "line 3: 'output' is int"),
        ('{"instruction": "a", "output": "b"}\n["not", "an", "object"]\n', "line 2 is a JSON list"),
        ('{"instruction": "a", "output": "b"}\n{"instruction": oops}\n', "line 2 is not valid JSON"),
        ('{"instruction": null, "output": "b"}\n', "line 1: 'instruction' is null, not a string"),
    ],
    ids=["missing-key", "not-a-string", "not-an-object", "malformed", "null"],
)  # fmt: skip
def test_a_bad_record_is_named_by_its_line_before_any_work(run_sft, tmp_path, content, expected):
    data = tmp_path / ("data.json" if content.startswith("[") else "data.jsonl")
    data.write_text(content)
    with pytest.raises(run_sft.UsageError, match=expected) as info:
        run_sft.run([*TINY, "--train_file", str(data), "--output_dir", str(tmp_path / "out")])
    assert "\n" not in str(info.value) and str(data) in str(info.value) and not (tmp_path / "out").exists()


def test_a_template_without_the_instruction_is_refused(run_sft, tmp_path):
    with pytest.raises(run_sft.UsageError, match=r"has no \{instruction\} field"):
        run_sft.parse_args(["--prompt_template", "Q: {input}", "--output_dir", str(tmp_path)])
    assert PromptTemplate.parse("alpaca") is ALPACA


def test_a_template_that_would_drop_the_records_inputs_is_refused_before_any_work(run_sft, tmp_path):
    """Issue 33: `Q: {instruction}` on records with an "input" dropped every input without a word."""
    data = tmp_path / "records.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (RECORD, EMPTY, RECORD)))
    flags = ["--prompt_template", "Q: {instruction}\nA: ", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(run_sft.UsageError) as info:
        run_sft.run([*TINY[:12], *TINY[14:], "--train_file", str(data), *flags])  # without TINY's template
    expected = r"has no {input} field, and 1 of the 3 records have an input (record 2 the first) that it would drop"
    assert expected in str(info.value) and not (tmp_path / "out").exists()
    PromptTemplate.parse("Q: {instruction}").check_records([RECORD, RECORD])  # no record has an input: fine
    with pytest.raises(run_sft.UsageError, match="have an input"):  # the embedded set has inputs too
        run_sft.run([*TINY[:12], *TINY[14:], *flags])


def test_a_length_budget_that_cannot_hold_one_example_is_a_flag_conflict(run_sft, tokenizer, tmp_path):
    """Issue 33: P-tuning's 30 virtual tokens in --max_seq_length 24 fed 1,426-token batches; 40 in 16 blamed the
    records for empty outputs. The budget counts the virtual tokens, the template and a response."""
    for tokens, length in (("30", "24"), ("40", "16")):
        flags = ["--peft_method", "ptuning", "--num_virtual_tokens", tokens, "--max_seq_length", length]
        with pytest.raises(run_sft.UsageError) as info:
            run_sft.run([*TINY, *flags, "--output_dir", str(tmp_path / "out")])
        message = str(info.value)
        assert f"--max_seq_length {length} cannot hold one example: {tokens} tokens of the P-tuning" in message
        assert "of the prompt template (--prompt_template), 2 for a one-token response make" in message
        assert not (tmp_path / "out").exists()
    need = 1 + len(tokenizer(SHORT.format(instruction="", input=""), add_special_tokens=False)["input_ids"]) + 2
    check_length_budget(tokenizer, PromptTemplate.parse(SHORT), need)  # the least that holds one example
    with pytest.raises(ValueError, match=f"--max_seq_length {need - 1} cannot hold one example"):
        check_length_budget(tokenizer, PromptTemplate.parse(SHORT), need - 1)
    with pytest.raises(ValueError, match="leaves -6 tokens beside the 30 wrapped around each example"):
        tokenize_record(RECORD, tokenizer, template=ALPACA, max_seq_length=24, wrap=([5] * 30, []))


def test_trains_on_the_embedded_set_and_reports_the_response_loss(run_sft, tmp_path, capsys):
    results = run_sft.run([*TINY, "--output_dir", str(tmp_path), "--max_steps", "4", "--learning_rate", "3e-3"])
    assert results["global_step"] == 4 and results["eval_loss"] < results["eval_loss_before"]
    table = capsys.readouterr().out
    assert "| eval loss after (response tokens) " in table and f"{results['eval_loss']:.3f}" in table
    assert json.loads((tmp_path / "eval_results.json").read_text())["eval_loss"] == pytest.approx(results["eval_loss"])
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.hidden_size == 64


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("method", [[], ["--peft_method", "bitfit"]], ids=["full", "bitfit"])
def test_a_head_tied_to_its_clustered_embedding_trains_and_reloads(run_sft, tmp_path, method):
    """--dkm_quantize_embeddings true on a tied model (issue 52), with or without an adapter: the LM head stays the
    clustered embedding in the job and in the saved model (the adapter's base), which reloads to finite logits."""
    from peft import PeftModel

    from hf_llmkit.quantization.tied import TiedDKMHead

    flags = [*TINY, "--output_dir", str(tmp_path), "--max_steps", "2", "--config_overrides",
             "tie_word_embeddings=true", "--quantization", "dkm", "--dkm_bits", "4", "--dkm_quantize_embeddings",
             "true"]  # fmt: skip
    results = run_sft.run([*flags, *method])
    assert results["global_step"] == 2 and results["eval_loss"] == results["eval_loss"]  # not NaN
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base" if method else tmp_path)
    assert isinstance(model.lm_head, TiedDKMHead) and model.lm_head.embedding is model.model.embed_tokens
    if method:
        model = PeftModel.from_pretrained(model, tmp_path)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 22]])).logits).all()


def test_modules_to_save_cannot_split_a_head_tied_to_its_clustered_embedding(run_sft, tmp_path):
    flags = [*TINY, "--output_dir", str(tmp_path / "run"), "--config_overrides", "tie_word_embeddings=true",
             "--quantization", "dkm", "--dkm_quantize_embeddings", "true", "--peft_method", "lora"]  # fmt: skip
    with pytest.raises(
        run_sft.UsageError, match="drop embed_tokens from --modules_to_save, or pass --dkm_quantize_em"
    ):
        run_sft.run([*flags, "--modules_to_save", "embed_tokens"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "method",
    [
        ["--peft_method", "lora"],
        ["--peft_method", "bitfit"],  # biases added to Llama's bias-less layers: declared by attention/mlp_bias
        [
            "--peft_method",
            "lora",
            "--target_modules",
            "embed_tokens,q_proj",
            "--config_overrides",
            "tie_word_embeddings=true",
        ],  # the tied lm_head keeps the base weight: untied in the merged model
    ],  # fmt: skip
    ids=["lora", "bitfit", "lora-tied-embedding"],
)
def test_merge_adapter_saves_the_merged_plain_model(run_sft, tmp_path, method):
    """`--merge_adapter`: output_dir/merged is a plain model (no adapter files) whose logits are the trained adapter
    model's; the adapter and its base are saved as before. An earlier run's merged/ is replaced, and what a run
    killed during its merge left (issue 52: a full-size merged.tmp-* folder forever) is removed."""
    from peft import PeftModel

    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "an earlier merge").write_text("x")
    killed = f"merged.tmp-{socket.gethostname()}-{_dead_pid()}"  # the names `replace_folder` writes
    for leftover in (killed, killed + "-old"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "model.safetensors").write_bytes(b"half")
    flags = [*TINY, "--output_dir", str(tmp_path), "--max_steps", "2", "--learning_rate", "3e-2"]
    results = run_sft.run([*flags, *method, "--merge_adapter"])
    merged_dir = tmp_path / "merged"
    assert results["merged_model"] == str(merged_dir) and not (merged_dir / "adapter_config.json").exists()
    assert not (merged_dir / "an earlier merge").exists() and not list(tmp_path.glob("*.tmp-*"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path)(ids).logits
        assert not torch.allclose(adapted, plain, atol=1e-3)  # the adapter learned something to merge
        assert torch.allclose(merged(ids).logits, adapted, atol=1e-5)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--merge_adapter"], "--merge_adapter has no effect without a --peft_method"),
        (["--peft_method", "bottleneck", "--merge_adapter"], "a bottleneck adapter is not a change of weights"),
        (["--peft_method", "lora", "--merge_adapter", "--quantization", "dkm"], "this run's base is quantized"),
    ],
)
def test_merge_adapter_refuses_what_it_cannot_merge_before_any_work(run_sft, tmp_path, flags, expected):
    with pytest.raises(run_sft.UsageError, match=expected):
        run_sft.parse_args([*TINY, "--output_dir", str(tmp_path), *flags])


def test_merge_adapter_with_a_lora_bias_on_layers_without_bias_is_refused_before_any_work(run_sft, tmp_path):
    """Issue 52: `--lora_bias true --merge_adapter` trained, then failed in peft's merge (the adapted Llama layers
    have no bias to fold the LoRA bias into): one line naming the fix, before any work."""
    flags = ["--peft_method", "lora", "--lora_bias", "true", "--merge_adapter", "--target_modules", "q_proj,v_proj"]
    with pytest.raises(run_sft.UsageError) as info:
        run_sft.run([*TINY, *flags, "--output_dir", str(tmp_path / "out"), "--max_steps", "2"])
    message = str(info.value)
    assert "--lora_bias true with --merge_adapter" in message and "4 adapted layers have none" in message
    assert "(model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj, ...)" in message
    assert message.endswith("drop --lora_bias, or --merge_adapter") and "\n" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_merge_adapter_refuses_a_file_or_a_symlink_at_merged_before_any_work(run_sft, tmp_path, kind):
    """Issue 52: output_dir/merged a file (or a link to a folder elsewhere) made a re-run exit 0 without the merged
    model (or with the old one beside a newer adapter): refused in one line, nothing written, the link's folder
    untouched."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    if kind == "file":
        (out / "merged").write_text("notes")
    else:
        (out / "merged").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(run_sft.UsageError) as info:
        run_sft.run([*TINY, "--output_dir", str(out), "--peft_method", "lora", "--merge_adapter"])
    what = "a file" if kind == "file" else f"a symlink to {elsewhere}"
    expected = f"--merge_adapter writes the merged model to the folder {out / 'merged'}, and that is {what}: remove"
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert [p.name for p in out.iterdir()] == ["merged"] and [p.name for p in elsewhere.iterdir()] == ["config.json"]


def test_merge_adapter_on_a_full_disk_is_one_line_and_exit_status_74(tmp_path):
    """Issue 52: a failed write of the merged model (a real file size limit in a process of its own, as a nearly full
    disk) was safetensors' traceback; it is the one line and exit status 74 of every failed save, nothing is left
    under merged/, and the adapter is saved."""
    model = tmp_path / "model"
    tiny_llama(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2).save_pretrained(model)
    corpus_tokenizer(vocab_size=512).save_pretrained(model)
    limit = (model / "model.safetensors").stat().st_size // 2  # above the adapter's files, below the model's
    out = tmp_path / "out"
    flags = [*TINY[10:], "--model_name_or_path", model, "--output_dir", out, "--max_steps", "2"]
    flags += ["--peft_method", "lora", "--merge_adapter"]
    proc = warm.run_script(Path(__file__).parent / "merge_file_limit_run.py", [limit, *flags])
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if "could not write" in line]
    assert f"could not write the merged model into {out / 'merged'}: file too large" in line
    assert "the trained adapter is saved in" in line
    assert (out / "adapter_model.safetensors").is_file()
    assert not (out / "merged").exists() and not list(out.glob("*.tmp-*"))


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_merge_adapter_refuses_bitfit_biases_the_architecture_cannot_hold_before_training(
    run_sft, tmp_path, model_type
):
    """Qwen2's o_proj / MLP and every Mistral projection are built without a bias whatever the config says: a merged
    BitFit model would reload without the trained biases, so the run stops before training and writes nothing."""
    flags = [*TINY, "--output_dir", str(tmp_path / "run"), "--model_type", model_type, "--peft_method", "bitfit"]
    fix = "--bitfit_add_missing_biases false .*, or drop" if model_type == "qwen2" else ": drop"  # Mistral: none
    with pytest.raises(run_sft.UsageError, match=f"{fix} --merge_adapter \\(the adapter is saved either way\\)$"):
        run_sft.run([*flags, "--merge_adapter"])
    assert not (tmp_path / "run").exists()
