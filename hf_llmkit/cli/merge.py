"""Merge a finished run's adapter, without training: `python -m hf_llmkit.cli.merge OUTPUT_DIR`.

    python -m hf_llmkit.cli.merge outputs/run-lora      # writes outputs/run-lora/merged

What `--merge_adapter true` writes at the end of a run: the adapter of `OUTPUT_DIR` (`OUTPUT_DIR/adapter`, else the
adapter files in `OUTPUT_DIR` itself) merged into the base its `adapter_config.json` names (`OUTPUT_DIR/base` for a
base that exists nowhere else), saved with the tokenizer as a plain model to `OUTPUT_DIR/merged` (written whole or
not at all). Re-running a finished run's command with `--merge_adapter true` does the same from its last checkpoint;
this command also serves runs that kept no checkpoint (`--save_strategy no`). Anything that cannot be merged (no
adapter, an adapter that is no change of weights, a quantized base) prints one `error: ...` line naming the fix and
exits 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["adapter_folder", "check_merge_rerun", "main", "merge_saved_adapter"]

PROG = "python -m hf_llmkit.cli.merge"


def adapter_folder(output_dir: str | Path) -> Path:
    """The folder holding a run's final adapter: `output_dir/adapter`, else `output_dir` itself."""
    out = Path(output_dir)
    for folder in (out / "adapter", out):
        if (folder / "adapter_config.json").is_file():
            return folder
    raise ValueError(
        f"{out} holds no adapter (no adapter/adapter_config.json): pass the --output_dir of a run trained with "
        "--peft_method lora or bitfit"
    )


def check_merge_rerun(args) -> None:
    """A main job with `--merge_adapter true` whose output folder holds a finished run it cannot resume (no checkpoint:
    `--save_strategy no`) would train that run again to merge it: refused before any work, naming this command."""
    from hf_llmkit.checkpoints.resume_rule import will_resume
    from hf_llmkit.cli.run_folder import RESULT_FILES

    training = args.training
    out = Path(training.output_dir)
    if not args.peft.merge_adapter or args.run.overwrite_output_dir:
        return
    if not any((out / name).is_file() for name in RESULT_FILES):
        return
    if will_resume(out, training.resume_from_checkpoint, auto_resume=training.auto_resume):
        return  # resumed at its end (nothing trains), or from an earlier step to more steps
    raise ValueError(
        f"--merge_adapter true: {out} holds a finished run with no checkpoint to resume, so this run would train it "
        f"again; merge its adapter without training: {PROG} {out} (or add --overwrite_output_dir true to retrain)"
    )


def merge_saved_adapter(output_dir: str | Path) -> Path:
    """Merge the finished adapter of the run in `output_dir` into its base; returns `output_dir/merged`."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_llmkit  # noqa: F401  (registers hf_llmkit's PEFT methods with peft)
    from hf_llmkit.cli.peft import MERGEABLE
    from hf_llmkit.data.cache import not_a_folder, replace_folder
    from hf_llmkit.tuners.merging import merge_for_saving, merge_problem

    target = Path(output_dir) / "merged"
    what = not_a_folder(target)
    if what is not None:
        raise ValueError(f"the merged model goes to the folder {target}, and that is {what}: remove it")
    adapter = adapter_folder(output_dir)
    config = PeftConfig.from_pretrained(adapter)
    method = str(getattr(config.peft_type, "value", config.peft_type)).lower()
    if method not in MERGEABLE:
        raise ValueError(
            f"the adapter in {adapter} is a {method} adapter, no change of weights to merge: only "
            f"{' or '.join(MERGEABLE)} adapters merge (load it with PeftModel.from_pretrained instead)"
        )
    base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path)
    if getattr(base.config, "quantization_config", None) is not None:
        raise ValueError(
            f"the adapter's base {config.base_model_name_or_path} is quantized: merging folds the adapter into "
            "full-precision weights; load the adapter on its base with PeftModel.from_pretrained instead"
        )
    model = PeftModel.from_pretrained(base, adapter)
    problem = merge_problem(model)
    if problem is not None:
        raise ValueError(f"{problem}: load the adapter on its base with PeftModel.from_pretrained instead")
    merged = merge_for_saving(model)
    tokenizer_from = adapter if (adapter / "tokenizer_config.json").is_file() else Path(output_dir)
    tokenizer = (
        AutoTokenizer.from_pretrained(tokenizer_from) if (tokenizer_from / "tokenizer_config.json").is_file() else None
    )

    def write(folder: Path) -> None:
        merged.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    replace_folder(target, write)  # an earlier merge of another adapter replaced
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("output_dir", help="the --output_dir of a finished run trained with --peft_method lora/bitfit")
    args = parser.parse_args(argv)
    try:
        target = merge_saved_adapter(args.output_dir)
    except (ValueError, OSError) as error:
        print(f"{PROG}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
