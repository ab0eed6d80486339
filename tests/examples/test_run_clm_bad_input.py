"""Bad input to examples/run_clm.py: one line naming the fix, exit status 2, before any work, nothing written.

Most cases run in-process (`run()` raises `UsageError`, which `main()` prints as one line with exit status 2);
a few run the script end to end to check the line, the status and the absence of a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hf_llmkit.testing import corpus_tokenizer, tiny_llama
from tests import warm
from tests.conftest import EXAMPLES
from tests.examples.test_run_clm import TINY

SIZES = TINY[:10]  # --vocab_size ... --max_position_embeddings: only for a model built from scratch
RUN = TINY[10:] + ["--max_steps", "1"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder of bad (and good) inputs, shared by the cases."""
    root = tmp_path_factory.mktemp("bad_inputs")
    files = {
        "empty.txt": b"",
        "binary.txt": b"\x89PNG\r\n\x1a\n\x00\x00\xffbinary",
        "malformed.jsonl": b'{"text": "a"}\n{"text": oops}\n',
        "notext.jsonl": b'{"body": "a"}\n',
        "number.json": b'[{"text": 12}]',
        "short.txt": b"hello world\n",
        "good.txt": b"a line of text that is long enough\n" * 50,
        "afile": b"x",
        "data.csv": b"text\nhello\n",
    }
    for name, content in files.items():
        (root / name).write_bytes(content)
    model = root / "model"
    tiny_llama().save_pretrained(model)
    corpus_tokenizer(vocab_size=512).save_pretrained(model)
    for name in ("corrupt_config", "no_weights", "bad_weights"):
        (root / name).mkdir()
        for item in model.iterdir():
            (root / name / item.name).write_bytes(item.read_bytes())
    (root / "corrupt_config" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (root / "no_weights" / "model.safetensors").unlink()
    (root / "bad_weights" / "model.safetensors").write_bytes(b"\x00" * 64)
    (root / "run" / "checkpoint-2").mkdir(parents=True)
    (root / "bad_state" / "checkpoint-2").mkdir(parents=True)
    (root / "bad_state" / "checkpoint-2" / "trainer_state.json").write_text("{")
    (root / "empty_dir").mkdir()
    deep = root / "deep" / "/".join(["d"] * 40)
    deep.mkdir(parents=True)
    (deep / "a.txt").write_text("deep text\n")
    (root / "args.json").write_text('{"max_steps": 2,')
    return root


# (name, flags, expected part of the one line); {d} is the inputs folder.
CASES = [
    ("empty-file", [*SIZES, "--train_file", "{d}/empty.txt"], "empty.txt is empty; add text or remove the file"),
    ("binary-file", [*SIZES, "--train_file", "{d}/binary.txt"], "binary.txt line 1 is not UTF-8 text (byte 0x89 at"),
    ("malformed-json", [*SIZES, "--train_file", "{d}/malformed.jsonl"], "malformed.jsonl line 2 is not valid JSON"),
    ("json-no-text", [*SIZES, "--train_file", "{d}/notext.jsonl"], "line 1 has no 'text' field (fields: body)"),
    ("json-text-not-str", [*SIZES, "--train_file", "{d}/number.json"], "row 1: 'text' is int, not a string"),
    ("binary-validation", [*SIZES, "--validation_file", "{d}/binary.txt"], "binary.txt line 1 is not UTF-8 text"),
    ("csv-file", [*SIZES, "--train_file", "{d}/data.csv"], "unsupported suffix '.csv'; use .txt, .json or .jsonl"),
    ("no-data-files", [*SIZES, "--dataset_dir", "{d}/empty_dir"], "holds no .txt, .json or .jsonl file"),
    ("deep-dataset-dir", [*SIZES, "--dataset_dir", "{d}/deep"], "nests folders more than 32 levels deep"),
    ("dir-and-file", [*SIZES, "--dataset_dir", "{d}", "--train_file", "{d}/good.txt"], "either --dataset_dir or"),
    ("zero-blocks", [*SIZES, "--train_file", "{d}/short.txt"], "gives 0 blocks of 32 tokens; add text or lower"),
    ("split-0", [*SIZES, "--validation_split_percentage", "0"], "must be between 0 and 100 (exclusive)"),
    ("split-100", [*SIZES, "--validation_split_percentage", "100"], "must be between 0 and 100 (exclusive)"),
    ("max-train-0", [*SIZES, "--max_train_samples", "0"], "--max_train_samples 0 must be at least 1"),
    ("model-missing", ["--model_name_or_path", "{d}/nothing"], "does not exist; pass a local model folder"),
    ("model-corrupt-config", ["--model_name_or_path", "{d}/corrupt_config"], "config.json is corrupt"),
    ("model-no-weights", ["--model_name_or_path", "{d}/no_weights"], "has a config.json but no weights"),
    ("model-bad-weights", ["--model_name_or_path", "{d}/bad_weights"], "is not a readable safetensors file"),
    ("tokenizer-missing", [*SIZES[2:], "--tokenizer_name_or_path", "{d}/nothing"], "--tokenizer_name_or_path"),
    ("output-dir-file", [*SIZES, "--output_dir", "{d}/afile"], "--output_dir {d}/afile is a file; pass a folder"),
    ("output-dir-in-file", [*SIZES, "--output_dir", "{d}/afile/out"], "which is a file; pass a folder"),
    ("cache-dir-file", [*SIZES, "--data_cache_dir", "{d}/afile"], "--data_cache_dir {d}/afile is a file"),
    ("resume-no-checkpoint", [*SIZES, "--resume_from_checkpoint", "{d}/run"], "(it holds checkpoint-2: pass that)"),
    ("resume-bad-state", [*SIZES, "--resume_from_checkpoint", "{d}/bad_state/checkpoint-2"], "trainer_state.json is"),
    ("config-rejected", [*SIZES, "--config_overrides", "hidden_act=nope"], "cannot build a llama model from this"),
    ("heads-do-not-divide", [*SIZES, "--hidden_size", "65", "--num_attention_heads", "2", "--num_key_value_heads",
     "2"], "rejects this llama config (The hidden size (65) is not a multiple of the number of attention heads (2).)"),
    ("config-unknown-key", [*SIZES, "--config_overrides", "hiden_size=8"], "key hiden_size isn't in the original"),
    ("model-type", [*SIZES, "--model_type", "lama"], "--model_type 'lama' is not a transformers causal LM"),
    ("size-for-gpt2", [*SIZES, "--model_type", "gpt2"], "--intermediate_size has no effect for --model_type gpt2"),
    ("block-too-large", [*SIZES, "--block_size", "100"], "--block_size 100 is larger than the model's context (64"),
    ("sizes-with-model", ["--model_name_or_path", "{d}/model", "--hidden_size", "8"], "--hidden_size has no effect"),
    ("vocab-with-tokenizer", ["--tokenizer_name_or_path", "{d}/model", "--vocab_size", "9"], "--vocab_size has no"),
    ("dkm-flag-off", [*SIZES, "--dkm_bits", "4"], "--dkm_bits has no effect without --quantization dkm"),
    ("moe-flag-off", [*SIZES, "--moe_num_experts", "4"], "--moe_num_experts has no effect without --upcycle_moe"),
    ("moe-loss-off", [*SIZES, "--moe_aux_loss_coef", "0.1"], "--moe_aux_loss_coef has no effect without --upcycle"),
    ("lora-flag-off", [*SIZES, "--lora_rank", "4"], "--lora_rank has no effect without --peft_method lora"),
    ("lora-flag-wrong-method", [*SIZES, "--peft_method", "bitfit", "--lora_alpha", "8"], "--lora_alpha has no"),
    ("trainable-off", [*SIZES, "--trainable", "q_proj,v_proj"], "--target_modules has no effect without a --peft"),
    ("ptuning-flag-off", [*SIZES, "--ptuning_template", "[P0] {text}"], "without --peft_method ptuning"),
    ("method-spelling-off", [*SIZES, "--peft_method", "lora", "--num_virtual_tokens", "8"],
     "--num_virtual_tokens is an option of --peft_method ptuning or ptuning_v2; add --peft_method ptuning or drop"),
    ("adapter-save-off", [*SIZES, "--no_save_peft_adapter"], "--save_peft_adapter has no effect without a --peft"),
    ("split-with-file", [*SIZES, "--validation_file", "{d}/good.txt", "--validation_split_percentage", "2"], "drop"),
    ("kbits-without-peft", [*SIZES, "--load_in_kbits", "4"], "train an adapter on it with --peft_method"),
    ("kbits-with-dkm", [*SIZES, "--peft_method", "lora", "--load_in_kbits", "8", "--quantization", "dkm"], "choose"),
    ("kbits-from-scratch", [*SIZES, "--peft_method", "lora", "--load_in_kbits", "4"], "add --model_name_or_path"),
    ("kbits-with-moe", [*SIZES, "--peft_method", "lora", "--load_in_kbits", "4", "--upcycle_moe", "true"], "drop one"),
    ("unknown-flag", [*SIZES, "--lora_rnk", "4"], "unknown option --lora_rnk; did you mean --lora_rank?"),
    ("invalid-choice", [*SIZES, "--peft_method", "lorra"], "--peft_method: invalid choice: 'lorra'"),
    ("bad-int", [*SIZES, "--max_steps", "ten"], "--max_steps: invalid int value: 'ten'"),
    ("deepspeed-missing", [*SIZES, "--deepspeed", "{d}/nothing.json"], "--deepspeed {d}/nothing.json does not exist"),
    ("deepspeed-corrupt", [*SIZES, "--deepspeed", "{d}/args.json"], "--deepspeed: {d}/args.json is corrupt"),
    ("args-json-malformed", ["{d}/args.json"], "args.json is not a JSON file of flags"),
    ("sp-without-ranks", [*SIZES, "--sequence_parallel_size", "2"], "sequence_parallel_size=2 must be >= 1 and"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "expected"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_usage_error_before_any_work(run_clm, inputs, tmp_path, flags, expected):
    out = tmp_path / "out"
    argv = [flag.replace("{d}", str(inputs)) for flag in flags]
    if "--output_dir" not in argv and not argv[0].endswith(".json"):
        argv += ["--output_dir", str(out)]
    with pytest.raises(run_clm.UsageError) as info:
        run_clm.run(argv if argv[0].endswith(".json") else [*RUN, *argv])  # the case's flags last: they win
    message = str(info.value)
    assert expected.replace("{d}", str(inputs)) in message and "\n" not in message, message
    assert not out.exists()  # nothing written for a rejected command


def _script(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`python examples/run_clm.py ARGS` from a child of the warm interpreter (tests/warm.py)."""
    return warm.run_script(EXAMPLES / "run_clm.py", args, timeout=300, **kwargs)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("run_clm.py: error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_unwritable_output_dir_stops_before_any_work_end_to_end(inputs, tmp_path):
    """Found up front by writing a probe (root included), not at the first checkpoint after training; the script
    prints one line, exits 2, and shows no traceback."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    args = [*SIZES, *RUN, "--train_file", str(inputs / "good.txt"), "--output_dir", str(locked / "out")]
    line = _one_error_line(_script(args, honour_permissions=True))
    assert "--output_dir" in line and "is not writable (Permission denied" in line
    assert not (locked / "out").exists()


@pytest.mark.slow
def test_heads_not_divisible_by_sequence_parallel_size_on_two_ranks(tmp_path):
    """3 query heads cannot split over 2 ranks: one line from rank 0, before training, on both ranks (each with the
    environment torchrun gives it, forked from the warm interpreter)."""
    flags = [*SIZES[:2], "--hidden_size", "48", "--intermediate_size", "64", "--num_hidden_layers", "1",
             "--num_attention_heads", "3", "--num_key_value_heads", "3", "--max_position_embeddings", "64", *RUN,
             "--sequence_parallel_size", "2", "--output_dir", str(tmp_path / "o")]  # fmt: skip
    ranks = warm.run_script_on_ranks(EXAMPLES / "run_clm.py", flags, nprocs=2, timeout=300)
    output = "\n".join(proc.stdout + proc.stderr for proc in ranks)
    lines = [line for line in output.splitlines() if "run_clm.py: error:" in line]
    assert len(lines) == 1 and "num_attention_heads=3 is not divisible by sequence_parallel_size=2" in lines[0]
    assert lines[0] in ranks[0].stderr and ranks[0].returncode == 2, [(p.returncode, p.stderr[-2000:]) for p in ranks]
    assert not (tmp_path / "o").exists()


def test_divergence_ends_with_one_line_and_the_exit_status_asked_for(run_clm, tmp_path, monkeypatch, caplog):
    """Not bad input but not a crash either: a loss that cannot be rolled back ends the run with one logged line
    and the status `--divergence_exit_code` sets (the mapping itself is tested in tests/cli/test_errors.py)."""
    args = [*RUN, *SIZES, "--max_steps", "6", "--learning_rate", "1e12", "--output_dir", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", ["run_clm.py", *args, "--divergence_exit_code", "7"])
    with pytest.raises(SystemExit) as done:
        run_clm.main()
    assert done.value.code == 7
    lines = [r.getMessage() for r in caplog.records if "training diverged" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "non-finite training loss" in lines[0]
