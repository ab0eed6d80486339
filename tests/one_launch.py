"""Several Trainer runs -- and main jobs -- one after another in one launched process.

On CPU, starting a rank (a fresh interpreter importing torch, transformers, peft, bitsandbytes: 6-7 s of CPU) costs
more than training a tiny model, so a multi-rank test launches its ranks once and runs every configuration it checks
in them. Between two runs `fresh_trainer_state` puts the process back as it started: accelerate keeps one
process-wide state and refuses a second DeepSpeed `Accelerator` while the first one's state lives
(`hf_llmkit.compat.accelerate`); the FSDP2 composition cells switch the shared distributed type
(tests/composition/clients.py); an `Accelerator` with a DeepSpeed or FSDP plugin leaves `ACCELERATE_USE_DEEPSPEED` /
`ACCELERATE_USE_FSDP` set in the environment, where the next run's arguments would read them; and a ZeRO-3 config
must not partition the next run's model. transformers resets the same accelerate state (with the partial one)
before every non-DeepSpeed `TrainingArguments`; the process group stays.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def fresh_trainer_state(environ: dict[str, str]) -> None:
    """Forget what earlier Trainers left in this process; `environ`: the environment the process started with."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(environ)


def run_example(name: str, argv: list[str]) -> None:
    """Run `examples/<name>.py` with the command line `argv` in this process, as `python examples/<name>.py` would
    (its `main()`; a main job destroys the process group when it ends, so run it last)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.argv = [f"{name}.py", *argv]
    module.main()
