"""Fault tolerance and the run's callbacks: `RunArguments` (`hf_llmkit.cli.arguments`): resuming from the output
folder (`auto_resume`, whose one default rule is here: resume unless `--overwrite_output_dir true`), the fault-
tolerance, adapter-saving and loss-scale callbacks, and the seed recipe's `--warmup_ratio`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_llmkit.cli.arguments import RunArguments
from hf_llmkit.cli.errors import UsageError
from hf_llmkit.cli.features.base import Feature

__all__ = ["RUN"]


def _auto_resume(values: Mapping[str, Any]) -> bool:
    """A main job resumes from its output folder unless told to start over."""
    return not values["overwrite_output_dir"]


class Run(Feature):
    name = "run"
    arguments = RunArguments
    in_run_identity = False  # how to treat the folder, not what the run is
    defaults = {"auto_resume": _auto_resume({"overwrite_output_dir": RunArguments.overwrite_output_dir})}

    def derived_defaults(self, values, given):
        if "warmup_ratio" in given and "warmup_steps" in given:
            raise UsageError("pass --warmup_ratio or --warmup_steps, not both (a --warmup_steps below 1 is a ratio)")
        derived = {"auto_resume": _auto_resume(values)}
        if values["warmup_ratio"] is not None:
            derived["warmup_steps"] = values["warmup_ratio"]
        return derived

    def check(self, args) -> None:
        if args.training.enable_jit_checkpoint and args.run.fault_tolerance:
            raise UsageError(
                "--enable_jit_checkpoint true and --fault_tolerance (on by default) would both save on SIGTERM: drop "
                "--enable_jit_checkpoint (fault tolerance saves a complete checkpoint on SIGTERM and the same command "
                "resumes), or add --fault_tolerance false to keep transformers' JIT checkpoint alone"
            )

    def callbacks(self, args):
        return args.run.build_callbacks(peft=args.peft.peft_method != "none", fp16=args.training.fp16)


RUN = Run()
