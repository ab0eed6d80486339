"""accelerate still marks and tracks prepared models the way hf_llmkit.compat.accelerate undoes it."""

from __future__ import annotations

import accelerate
import torch
from accelerate import Accelerator
from accelerate.state import is_initialized

from hf_llmkit.compat.accelerate import (
    CHECKED_AGAINST,
    PREPARED_MARK,
    forget_prepared_model,
    is_prepared,
    replace_ddp_handler,
    reset_accelerator_state,
    unwrap_optimizer,
    unwrap_scheduler,
)


def test_evaluation_preparation_can_be_undone():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    where = f"accelerate {accelerate.__version__} (checked against {CHECKED_AGAINST})"
    assert prepared is model and is_prepared(model), f"{where} no longer sets {PREPARED_MARK}"
    assert any(m is model for m in accelerator._models), f"{where} no longer tracks models in Accelerator._models"
    forget_prepared_model(accelerator, model)
    assert not is_prepared(model) and not any(m is model for m in accelerator._models)


def test_accelerator_state_can_be_reset():
    Accelerator(cpu=True)
    assert is_initialized()
    reset_accelerator_state()
    where = f"accelerate {accelerate.__version__} (checked against {CHECKED_AGAINST})"
    assert not is_initialized(), f"{where}: AcceleratorState._reset_state no longer clears the accelerator state"
    Accelerator(cpu=True)  # a fresh accelerator can be made again
    assert is_initialized()


def test_the_ddp_handler_and_the_wrapped_optimizer_are_where_hf_llmkit_reaches_them():
    from accelerate.utils import DistributedDataParallelKwargs

    where = f"accelerate {accelerate.__version__} (checked against {CHECKED_AGAINST})"
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=5)])
    seen = []
    replace_ddp_handler(accelerator, lambda base: seen.append(base) or "replacement")
    assert isinstance(seen[0], DistributedDataParallelKwargs), f"{where} no longer keeps Accelerator.ddp_handler"
    assert accelerator.ddp_handler == "replacement"
    model = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = accelerator.prepare_optimizer(inner)
    assert wrapped is not inner and unwrap_optimizer(wrapped) is inner, f"{where}: AcceleratedOptimizer.optimizer"
    assert unwrap_optimizer(inner) is inner
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0)
    wrapped_schedule = accelerator.prepare_scheduler(schedule)
    assert unwrap_scheduler(wrapped_schedule) is schedule, f"{where}: AcceleratedScheduler.scheduler"
    reset_accelerator_state()


def test_the_launcher_parallelism_environment_builds_the_accelerators_config(monkeypatch):
    """`accelerate launch --parallelism_config_sp_size 2` exports these variables; the Accelerator builds its
    ParallelismConfig from them, and so does `launcher_parallelism_config` (hf_llmkit.compat.accelerate)."""
    from hf_llmkit.compat.accelerate import launcher_parallelism_config

    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    assert launcher_parallelism_config() is None
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    assert launcher_parallelism_config().sp_size == 2
    import inspect

    from accelerate import Accelerator
    from accelerate.utils import launch

    exported = inspect.getsource(launch.prepare_extend_env_parallelism_config)  # what the launcher exports
    assert '"ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"' in exported and '"SP_SIZE"' in exported
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" in inspect.getsource(Accelerator.__init__)  # what it reads
