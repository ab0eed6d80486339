"""DeepSpeed internals hf_llmkit relies on (checked against deepspeed 0.19.8).

- `deepspeed.ops.__compatible_ops__`: the probe cache DeepSpeed consults before JIT-compiling an op. Its own
  comment says edits to it persist; there is no public switch for the shared-memory collective op.
"""

from __future__ import annotations

CHECKED_AGAINST = "0.19.8"

# Ops `deepspeed.comm`'s torch backend compiles when it starts on a CPU-only machine (C++ builds with ninja,
# about a minute each on 2 cores). gloo runs every collective without them.
CPU_COMM_OPS = ("deepspeed_shm_comm", "deepspeed_ccl_comm")


def skip_cpu_comm_op_builds() -> bool:
    """Keep DeepSpeed from JIT-compiling its CPU collective ops; True when it applied (a CPU-only machine).

    Without this, every DeepSpeed start on a CPU-only machine builds `deepspeed_shm_comm` into the torch extensions
    cache; a build killed half way leaves a `lock` file there that makes every later build wait forever.
    Call it before `deepspeed.init_distributed` (`LLMKitTrainingArguments` does, for DeepSpeed runs without an
    accelerator).
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    compatible = deepspeed.ops.__compatible_ops__
    for name in CPU_COMM_OPS:
        compatible[name] = False
    return True
