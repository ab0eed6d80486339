"""What a run started by torchelastic (`torchrun`, `accelerate launch` on several machines) needs to survive a restart.

With `--max-restarts N`, torchrun's agents restart every worker of the job when one fails, and the new workers
resume from the newest complete checkpoint (`LLMKitTrainingArguments.auto_resume`). In torch 2.4 and later the
workers' process groups meet in a store that the agents share across restarts (`TORCHELASTIC_USE_AGENT_STORE`):
the restarted workers find the previous round's addresses there and fail to connect to the dead workers' ports
(`Gloo connectFullMesh failed ... Connection refused`; NCCL reads a stale unique id). PyTorch issue 135712
describes it; setting `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` for the agents gives every round its own store.
Checked against torch 2.13.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["SHARED_STORE_FIX", "check_elastic_restarts"]

SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def check_elastic_restarts(environ: Mapping[str, str] | None = None) -> None:
    """Raise `ValueError` when torchelastic may restart this worker into a store that still holds the last round's
    keys (restarts allowed and the agents' store shared); the message names the environment variable that fixes it.

    A worker cannot repair this itself: the agents pick the store before they start it.
    """
    env = os.environ if environ is None else environ
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return  # not set by torchelastic
    if restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ValueError(
            f"torchrun --max-restarts {restarts} with the agents' shared store: restarted workers would read the "
            f"previous round's addresses and fail to connect (PyTorch issue 135712); start every node's launcher "
            f"with {SHARED_STORE_FIX} in its environment, or launch with --max-restarts 0"
        )
