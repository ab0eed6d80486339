"""What hf_llmkit's main jobs share (`examples/run_clm.py`, `examples/run_sft.py`): flags, model, trainer, results.

A job differs from the others only in its data: its data arguments dataclass, how it reads and tokenizes the data,
its collator and the metric it reports. Everything else is here, once: the flags of every feature (model, PEFT
methods, DKM, bitsandbytes, MoE, callbacks and `LLMKitTrainingArguments`: sequence parallelism, fault tolerance)
and their checks, the model built as the flags say, the trainer with hf_llmkit's callbacks, evaluation before and
after training, results files and the results table, and `main()` with its exit statuses.

    JOB = Job(prog="run_clm.py", description=..., data_type=DataArguments, defaults={"max_steps": 300, ...})
    STEPS = DataSteps(read=check_inputs, prepare=prepare_datasets, collator=lambda built: default_data_collator)
    results = run_job(JOB, STEPS, argv)  # parse, check, build, prepare, train, evaluate, report
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import set_seed

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.checkpoints.lock import hold_output_dir
from hf_llmkit.checkpoints.resume_rule import will_resume
from hf_llmkit.cli import features
from hf_llmkit.cli.adapter_base import BaseAfterCalibration, write_base
from hf_llmkit.cli.allocator import keep_freed_blocks
from hf_llmkit.cli.arguments import SCRATCH_SIZES, ModelArguments
from hf_llmkit.cli.calibrated_start import calibrate_untrained, calibrated_start
from hf_llmkit.cli.checks import check_training_length
from hf_llmkit.cli.errors import exit_on_error, usage_errors
from hf_llmkit.cli.features import BuildState, adapter_base_dir
from hf_llmkit.cli.folders import (
    check_checkpoint_folder,
    check_json_file,
    check_model_folder,
    check_tokenizer_folder,
    check_writable_folder,
)
from hf_llmkit.cli.help import HelpLayout
from hf_llmkit.cli.merge import check_merge_rerun
from hf_llmkit.cli.model_loading import check_scratch_config, load_model, load_tokenizer
from hf_llmkit.cli.output import configure_console, keep_tensorboard_in_output_dir
from hf_llmkit.cli.parser import CommandLineParser
from hf_llmkit.cli.results import (
    ResumePoint,
    count_parameters,
    describe_setup,
    perplexity,
    recorded_results,
    results_table,
    save_results,
)
from hf_llmkit.cli.run_folder import FlagRecord, settle_output_dir
from hf_llmkit.data.cache import remove_stale_temporaries
from hf_llmkit.data.corpus import default_cache_dir
from hf_llmkit.trainers import LLMKitTrainer

__all__ = [
    "EMBEDDED_DEFAULTS", "Args", "DataSteps", "Job", "Model", "adapter_base_dir", "build_model", "build_trainer",
    "check_combinations", "check_folders", "main", "parse_args", "run_job", "train_and_evaluate",
    "write_adapter_base",
]  # fmt: skip

logger = logging.getLogger(__name__)

TRAINING_FLAGS = (
    "output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay",
    "logging_steps", "save_steps", "save_total_limit", "eval_strategy", "eval_steps", "seed", "fp16", "bf16",
    "activation_checkpointing", "deepspeed", "ddp_find_unused_parameters", "resume_from_checkpoint", "report_to",
    "do_train", "do_eval",
)  # fmt: skip
GROUP_ORDER = ("model", "quantization", "DKM quantization", "data", "PEFT", "mixture of experts",
               "sequence parallel", "long sequences", "fault tolerance", "training")  # fmt: skip
# The seed recipe's spellings that transformers 5 deprecated: same meaning, no deprecation warning.
SEED_SPELLINGS = {"--gradient_checkpointing": "--activation_checkpointing"}
# What the main jobs do with no flags, besides their own length and cadence (each one can be overridden; a feature's
# own defaults are the feature's: `hf_llmkit.cli.features`).
EMBEDDED_DEFAULTS = dict(
    do_train=True,
    do_eval=True,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=16,
    learning_rate=1e-3,
    lr_scheduler_type="cosine",
    weight_decay=0.01,
    save_total_limit=2,
    report_to="none",
    disable_tqdm=False,
    dataloader_pin_memory=torch.cuda.is_available(),
    seed=42,
    ddp_find_unused_parameters=False,  # every trainable weight takes part in each step (MoE experts are fused tensors)
)


@dataclass(frozen=True)
class Job:
    """One main job: its name, its data arguments and the defaults it runs with when given no flags (on top of
    `EMBEDDED_DEFAULTS`)."""

    prog: str  # "run_clm.py"; the default output folder is outputs/<prog without .py>
    description: str
    data_type: type
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def output_root(self) -> str:
        return f"outputs/{Path(self.prog).stem}"


class Args(NamedTuple):
    """Every parsed argument of one run, and the flags the user typed. A feature's arguments are an attribute
    named after it (`args.peft`, `args.dkm`, `args.run`...: `hf_llmkit.cli.features.FEATURES`)."""

    model: ModelArguments
    data: Any
    features: Mapping[str, Any]
    training: LLMKitTrainingArguments
    given: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> Any:
        try:
            return self.features[name]
        except KeyError:
            raise AttributeError(f"Args has no attribute {name!r}") from None


def default_output_dir(root: str, values: Mapping[str, Any]) -> str:
    """`root`, plus one suffix per switched-on feature, so different runs never share a folder."""
    parts = [Path(values["model_name_or_path"]).name] if values["model_name_or_path"] else []
    parts += features.folder_suffixes(values)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        parts.append(f"{world}ranks")
    return "-".join([root, *parts])


def _derived_defaults(job: Job):
    def derive(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
        """Defaults that follow from what was typed (a typed flag always wins)."""
        derived = {
            "output_dir": default_output_dir(job.output_root, values),
            **features.derived_defaults(values, given),
        }
        if "num_train_epochs" in given:
            derived["max_steps"] = -1  # the epochs decide the length, not the embedded default number of steps
        return derived

    return derive


def _check_deepspeed_file(values: Mapping[str, Any]) -> None:
    if isinstance(values["deepspeed"], str) and not values["deepspeed"].lstrip().startswith("{"):
        check_json_file(values["deepspeed"], flag="--deepspeed")


def parser_for(job: Job) -> CommandLineParser:
    """The job's command-line parser (grouped `--help`, JSON flag files, one-line errors)."""
    layout = HelpLayout(order=GROUP_ORDER, training_title="training", training_flags=TRAINING_FLAGS)
    types = [ModelArguments, job.data_type, *features.argument_types(), LLMKitTrainingArguments]
    parser = CommandLineParser(
        types, layout=layout, flag_groups=features.flag_groups(), prog=job.prog, description=job.description,
        renamed_flags=SEED_SPELLINGS,
    )  # fmt: skip
    defaults = {"output_dir": job.output_root, **EMBEDDED_DEFAULTS, **features.default_values(), **job.defaults}
    parser.set_defaults(**defaults)
    return parser


def parse_args(job: Job, argv: list[str] | None = None) -> Args:
    """The run's arguments; bad flags, bad numbers and flags of a feature that is off raise `UsageError`."""
    parsed, given = parser_for(job).parse(
        argv, derived_defaults=_derived_defaults(job), prechecks=[_check_deepspeed_file, check_training_length]
    )
    model, data, *parts, training = parsed
    named = dict(zip([f.name for f in features.FEATURES if f.arguments is not None], parts, strict=True))
    args = Args(model, data, {f.name: named.get(f.name) for f in features.FEATURES}, training, given=frozenset(given))
    with usage_errors():
        check_combinations(args)
        check_scratch_config(args.model, required=[name for name in SCRATCH_SIZES if name in given])
    return args


def check_combinations(args: Args) -> None:
    """Features that cannot work together stop here, before any work (the library refuses each of these pairs with
    a `ValueError` later, once the model or the trainer is built): the training arguments' own pairs, then each
    feature's `check`."""
    training = args.training
    on_cpu = training.use_cpu or not torch.accelerator.is_available()  # a CUDA build on a machine without a GPU too
    if training.fp16 and on_cpu and not training.deepspeed:  # DeepSpeed runs fp16 itself (or refuses it)
        raise ValueError(
            "--fp16 true needs a GPU: on CPU accelerate makes neither fp16 autocast nor a loss scaler, and the run "
            "would train in fp32; drop --fp16 (or --bf16 true, on a CPU that supports it)"
        )
    if training.tiled_loss and training.label_smoothing_factor:
        raise ValueError(
            "--tiled_loss computes the plain causal-LM cross-entropy itself; drop --label_smoothing_factor or "
            "--tiled_loss"
        )
    features.check_combinations(args)


def check_folders(args: Args) -> None:
    """Check every folder the run reads or writes besides its data (model, tokenizer, checkpoint, cache, output)."""
    model, training = args.model, args.training
    if model.model_name_or_path is not None:
        check_model_folder(model.model_name_or_path)
    if model.tokenizer_name_or_path is not None:
        check_tokenizer_folder(model.tokenizer_name_or_path)
    if training.resume_from_checkpoint is not None:
        check_checkpoint_folder(training.resume_from_checkpoint)
    cache_dir = getattr(args.data, "data_cache_dir", None)
    cache_flag = "--data_cache_dir" if cache_dir else "the hf_llmkit cache ($HF_LLMKIT_CACHE)"
    check_writable_folder(cache_dir or default_cache_dir(), flag=cache_flag)
    check_writable_folder(training.output_dir, flag="--output_dir")
    features.check_folders(args)  # what the features write inside it (output_dir/merged)
    check_merge_rerun(args)  # --merge_adapter on a finished run it cannot resume: python -m hf_llmkit.cli.merge


class Model(NamedTuple):
    """The model to train and what the run needs to know about how it was built."""

    model: Any
    tokenizer: Any
    template: Any = None  # P-tuning v1: places each sample in the template
    base: Any = None  # from-scratch PEFT runs: (base model, tokenizer) the adapter trains on (write_adapter_base)
    teacher: Any = None  # --distill_from_source: the source model, the trainer's teacher_model


def build_model(args: Args, tokenizer) -> Model:
    """Load or build the model (quantized while loading when a feature asks), then run each feature's model stage
    in order: upcycle, quantize, check, prepare, wrap in the PEFT adapter (`hf_llmkit.cli.features`)."""
    required = [name for name in SCRATCH_SIZES if name in args.given]
    loaded_with = features.load_config(args)
    model = load_model(args.model, tokenizer, quantization_config=loaded_with, required=required)
    state = features.build_stages(args, BuildState(model, tokenizer, loaded_with=loaded_with))
    return Model(state.model, tokenizer, state.template, state.base, state.teacher)


def build_trainer(args: Args, built: Model, train, evaluation, *, data_collator) -> LLMKitTrainer:
    """`LLMKitTrainer` with the callbacks the flags switch on (and `ResumePoint`, for the results); a DKM model's
    `DKMTrainingStateCallback` is LLMKitTrainer's own."""
    training = args.training
    callbacks = [ResumePoint(), *features.callbacks(args)]
    trainer = LLMKitTrainer(
        model=built.model,
        args=training,
        train_dataset=train if training.do_train else None,
        eval_dataset=evaluation if training.do_eval else None,
        processing_class=built.tokenizer,
        data_collator=data_collator,
        callbacks=callbacks,
        teacher_model=built.teacher,
    )
    keep_tensorboard_in_output_dir(trainer)
    return trainer


def _resuming(training: LLMKitTrainingArguments) -> bool:
    """Whether `train()` will resume (the one resume rule: an explicit checkpoint, or auto-resume with a resumable
    checkpoint in output_dir; a half-written one is not resumed from)."""
    return will_resume(training.output_dir, training.resume_from_checkpoint, auto_resume=training.auto_resume)


def train_and_evaluate(args: Args, trainer: LLMKitTrainer) -> dict[str, Any]:
    """Evaluate before (new runs), train (resuming when output_dir holds this run's checkpoint), evaluate after;
    writes train_results.json, eval_results.json and all_results.json as transformers' run_clm does."""
    training, results = args.training, {}
    if not training.do_train:  # no train() to begin: nothing can refuse the run now
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, FlagRecord):
                callback.write()
    # DeepSpeed builds its engine in train(): ZeRO-1/2 cannot evaluate before it (transformers refuses)
    fresh = not _resuming(training)
    before = training.do_eval and training.do_train and fresh and not training.deepspeed  # untrained: once
    start = calibrated_start(args, trainer, fresh=fresh, evaluate=before)  # --dkm_recipe calibrated: in train()
    if before and start is None:
        results["eval_loss_before"] = trainer.evaluate()["eval_loss"]
        results["eval_perplexity_before"] = perplexity(results["eval_loss_before"])
    if training.do_train:
        outcome = trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
        if start is not None and start.eval_loss is not None:
            results.update(eval_loss_before=start.eval_loss, eval_before="the calibrated start")
            results["eval_perplexity_before"] = perplexity(start.eval_loss)
        trainer.save_model()
        start = next(cb.step for cb in trainer.callback_handler.callbacks if isinstance(cb, ResumePoint))
        results.update(global_step=trainer.state.global_step, resumed_at=start, resumed_from=trainer.resumed_from)
        if start and start == trainer.state.global_step:  # resumed at its end: its recorded results stay
            return _finished(args, trainer, results)
        done = {
            "train_samples": len(trainer.train_dataset),
            **features.train_results(args, len(trainer.train_dataset)),
        }
        metrics = save_results(trainer, "train", {**outcome.metrics, **done})
        trainer.save_state()
        results.update(train_loss=metrics["train_loss"], **done)
    if training.do_eval:
        metrics = trainer.evaluate()
        metrics = save_results(trainer, "eval", {**metrics, "eval_samples": len(trainer.eval_dataset)})
        results.update(eval_loss=metrics["eval_loss"], eval_perplexity=metrics["perplexity"])
    return results


def _finished(args: Args, trainer: LLMKitTrainer, results: dict[str, Any]) -> dict[str, Any]:
    """A run resumed at its last step: nothing trained, the results files stay as the run left them (evaluated
    only if it never recorded an evaluation)."""
    logger.warning(
        "%s: this run finished at step %d, nothing to train; its results files are kept as they were "
        "(--overwrite_output_dir true starts over)", args.training.output_dir, trainer.state.global_step,
    )  # fmt: skip
    results.update(recorded_results(args.training.output_dir))
    if args.training.do_eval and "eval_loss" not in results:
        metrics = save_results(trainer, "eval", {**trainer.evaluate(), "eval_samples": len(trainer.eval_dataset)})
        results.update(eval_loss=metrics["eval_loss"], eval_perplexity=metrics["perplexity"])
    return results


def write_adapter_base(args: Args, built: Model) -> Path | None:
    """Save the base model + tokenizer the adapter trains on to output_dir/base (a new run; a resumed one has it),
    so `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter")` reproduces
    the evaluated model. Written before training: peft's adapter saves read the base's config
    (`hf_llmkit.cli.adapter_base`; a DKM base is written again after a calibration changed it)."""
    base_dir = adapter_base_dir(args)
    if base_dir is None:
        return None
    with args.training.main_process_first(desc="adapter base"):
        if args.training.should_save and not (_resuming(args.training) and (base_dir / "config.json").is_file()):
            write_base(*built.base, base_dir)
    return base_dir


class DataSteps(NamedTuple):
    """What a job does with its data: `read(args)` checks and reads it (before the model is built),
    `prepare(args, built, data)` tokenizes it into (train, evaluation) datasets, `collator(built)` batches them."""

    read: Callable[[Args], Any]
    prepare: Callable[[Args, Model, Any], tuple[Any, Any]]
    collator: Callable[[Model], Any]
    loss_of: str | None = None  # the results table reports perplexity, or the loss on these tokens


def run_job(job: Job, steps: DataSteps, argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, check every input, build the model, prepare the data, train and evaluate; print the results table
    and return the results (also written to output_dir as *_results.json)."""
    start = time.perf_counter()
    args = parse_args(job, argv)
    configure_console(main_process=args.training.should_log)
    set_seed(args.training.seed)
    with usage_errors(OSError):  # everything the input decides is checked before training starts
        settle_output_dir(args, job.prog)  # a default folder of this run's own; an explicit one of another run: no
        check_folders(args)
        data = steps.read(args)
        # one run per output folder: a second run into it stops here, before any work (held until the job ends)
        lock = hold_output_dir(args.training.output_dir, main=args.training.process_index == 0)
        try:
            if args.training.process_index == 0:  # what a killed run left half-written there (merged.tmp-* folders)
                remove_stale_temporaries(args.training.output_dir)
            built = build_model(args, load_tokenizer(args.model))
            train, evaluation = steps.prepare(args, built, data)
        except BaseException:
            lock.release(clean=True)  # rejected before any work: no output folder left behind
            raise
    base_dir = write_adapter_base(args, built)
    built = built._replace(base=None)  # the snapshot is on disk now
    with usage_errors():  # a pair of features the trainer refuses (check_combinations names the known ones)
        trainer = build_trainer(args, built, train, evaluation, data_collator=steps.collator(built))
    trainer.add_callback(FlagRecord(args, job.prog))  # the record is written once nothing can refuse the run
    dkm = args.dkm.build_config()
    if base_dir is not None and dkm is not None:  # after the trainer's DKM callback: the evaluated layers' state
        trainer.add_callback(BaseAfterCalibration(base_dir, at_start=dkm.recipe == "calibrated"))
    features.train_results(args, len(train), warn=True)  # e.g. more DKM calibration samples than examples: warned
    total, trainable = count_parameters(built.model)
    results: dict[str, Any] = {"parameters": total, "trainable_parameters": trainable}
    results.update(calibrate_untrained(args, trainer, train, steps.collator(built)))  # the recipe, untrained
    results.update(train_and_evaluate(args, trainer))
    results.update(features.finished(args, trainer))  # e.g. the merged model, after the adapter's evaluation
    results.update(output_dir=args.training.output_dir, wall_time_s=time.perf_counter() - start)
    results["adapter_base"] = str(base_dir) if base_dir is not None else None
    if trainer.is_world_process_zero():
        print("\n" + results_table(describe_setup(args), results, loss_of=steps.loss_of), flush=True)
    return results


def main(run, *, prog: str) -> None:
    """Run `run()` as a command: bad input ends in one line and exit status 2; a run-ending error (diverged,
    preempted) ends with the exit status its arguments set (`--divergence_exit_code`, `--preemption_exit_code`).
    The process keeps freed large blocks for reuse (`allocator.keep_freed_blocks`: a job owns its process)."""
    keep_freed_blocks()
    finished = False
    try:
        exit_on_error(run, prog=prog)
        finished = True
    finally:
        # Tear the process groups down before interpreter exit: gloo groups (the sequence-parallel ones too)
        # destroyed during finalisation can abort the process ("terminate called without an active exception").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if finished:  # every rank tears down together: rank 0 hosts the store the others' groups still use
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
