"""The `recipe` section of dkm_quality.py (issue 43): the whole path on the real model, each stage a fresh process.

    1. SFT with LoRA on instruction records, the adapter merged by the job:
       python examples/run_sft.py --model_name_or_path MODEL --peft_method lora --merge_adapter ...
    2. DKM 3-bit, calibrated start + training by distillation from the merged model, compact save:
       python examples/run_sft.py --model_name_or_path SFT/merged --quantization dkm --dkm_bits 3
           --dkm_recipe calibrated --distill_from_source true ...
    3. reload the compact checkpoint (`PalettizedLinear` layers) and generate greedily
    4. export: python -m hf_llmkit.quantization.export onnx DKM ONNX_FOLDER

Each stage's wall time and peak resident memory (the stage process's own, from `os.wait4`) go into the results; the
jobs' evaluation losses on held-out instruction records (response tokens) before and after each job follow the
quality through the path: the source model, the merged SFT model, the DKM start, the trained DKM model.
`tests/quantization/test_real_model_path.py` runs the same path on a two-layer slice of the model in seconds.

`python benchmarks/areas/dkm/recipe.py job OUT.json FLAGS...` runs `run_sft.run(FLAGS)` and writes its results (the
stage process of steps 1 and 2); `... generate OUT.json CHECKPOINT` runs step 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PROMPT = "Explain what the assert statement does."
SFT = ["--peft_method", "lora", "--merge_adapter", "--learning_rate", "2e-4"]
DKM = ["--quantization", "dkm", "--dkm_bits", "3", "--dkm_recipe", "calibrated", "--distill_from_source", "true",
       "--learning_rate", "2e-5"]  # fmt: skip
COMMON = ["--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--lr_scheduler_type", "constant",
          "--warmup_steps", "0", "--weight_decay", "0"]  # fmt: skip
FULL = {"steps": 24, "batch": 4, "length": 256, "eval": 64, "calibration": 128}
QUICK = {"steps": 2, "batch": 2, "length": 64, "eval": 4, "calibration": 4}


def stage_flags(model: str, out: Path, size: dict) -> dict[str, list[str]]:
    """The two jobs' flags (`run_sft.py`), as the docs show them, with this run's sizes."""
    sizes = ["--max_steps", str(size["steps"]), "--per_device_train_batch_size", str(size["batch"]),
             "--per_device_eval_batch_size", str(size["batch"]), "--max_seq_length", str(size["length"]),
             "--max_eval_samples", str(size["eval"]), "--logging_steps", str(max(1, size["steps"] // 4))]  # fmt: skip
    return {
        "sft": ["--model_name_or_path", model, *SFT, "--output_dir", str(out / "sft"), *sizes, *COMMON],
        "dkm": ["--model_name_or_path", str(out / "sft" / "merged"), *DKM, "--dkm_calibration_samples",
                str(size["calibration"]), "--output_dir", str(out / "dkm"), *sizes, *COMMON],
    }  # fmt: skip


def _timed(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB of the process, its output tail) of one stage process; raises on failure."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:3])} exited {proc.returncode}: {output.strip().splitlines()[-1:]}")
    return wall, usage.ru_maxrss / 1024, output[-2000:]


def run(model: str, work: Path, quick: bool = False) -> dict:
    """Every stage in order; a failed stage ends the path there, its row saying why."""
    size = QUICK if quick else FULL
    flags = stage_flags(model, work, size)
    me = [sys.executable, __file__]
    plan = [
        ("SFT with LoRA, adapter merged (run_sft.py --peft_method lora --merge_adapter)", "sft",
         [*me, "job", str(work / "sft.json"), *flags["sft"]]),
        ("DKM 3-bit, calibrated start + training by distillation from the merged model, compact save (run_sft.py "
         "--quantization dkm --dkm_recipe calibrated --distill_from_source true)", "dkm",
         [*me, "job", str(work / "dkm.json"), *flags["dkm"]]),
        ("reload the compact checkpoint and generate", "generate",
         [*me, "generate", str(work / "generate.json"), str(work / "dkm")]),
        ("export ONNX (python -m hf_llmkit.quantization.export onnx)", "export",
         [sys.executable, "-m", "hf_llmkit.quantization.export", "onnx", str(work / "dkm"), str(work / "onnx")]),
    ]  # fmt: skip
    stages = []
    for label, key, argv in plan:
        row = {"stage": label, "key": key}
        try:
            row["wall_s"], row["peak_rss_mb"], _ = _timed(argv)
        except RuntimeError as err:
            stages.append({**row, "error": str(err)[:300]})
            break
        if key in ("sft", "dkm", "generate"):
            row.update(json.loads((work / f"{key}.json").read_text()))
        if key == "export":
            row["onnx_mb"] = sum(f.stat().st_size for f in (work / "onnx").glob("model.onnx*")) / 2**20
        stages.append(row)
    sizes = {name: _folder_mb(work / path) for name, path in (("merged", "sft/merged"), ("dkm", "dkm"))}
    return {"stages": stages, "folder_mb": sizes, "size": size,
            "commands": {k: _shown(v, model, work) for k, v in flags.items()}}  # fmt: skip


def _folder_mb(folder: Path) -> float | None:
    files = list(folder.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / 2**20 if files else None


def _shown(flags: list[str], model: str, work: Path) -> str:
    text = " ".join(flags).replace(model, "<model>").replace(str(work), "<dir>")
    return "python examples/run_sft.py " + text


def _job(out: Path, flags: list[str]) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    import run_sft

    results = run_sft.run(flags)
    keep = ("eval_loss_before", "eval_loss", "train_loss", "global_step")
    out.write_text(json.dumps({k: v for k, v in results.items() if k in keep and v is not None}))


def _generate(out: Path, checkpoint: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_llmkit  # noqa: F401  (registers "dkm")
    from hf_llmkit.quantization import PalettizedLinear

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    packed = sum(isinstance(m, PalettizedLinear) for m in model.modules())
    from hf_llmkit.data.sft import ALPACA  # run_sft.py's default template: the prompt the model was tuned on

    ids = tokenizer(ALPACA.prompt({"instruction": PROMPT, "input": ""}), return_tensors="pt").input_ids
    start = time.perf_counter()
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    seconds = time.perf_counter() - start
    out.write_text(json.dumps({"packed_layers": packed, "new_tokens": len(new), "tokens_per_s": len(new) / seconds,
                               "text": tokenizer.decode(new, skip_special_tokens=True)}))  # fmt: skip


if __name__ == "__main__":
    {
        "job": lambda: _job(Path(sys.argv[2]), sys.argv[3:]),
        "generate": lambda: _generate(Path(sys.argv[2]), sys.argv[3]),
    }[sys.argv[1]]()
