"""Getting a callback's metrics into the Trainer's `log`, so every reporter receives them.

`Trainer.log` appends to `state.log_history` and then calls `on_log` on each callback in order: the reporting
integrations (TensorBoard, W&B, ...) come before any user callback, so a user callback that adds keys to `logs` in
its `on_log` is too late for them. A callback that implements `contribute_logs(logs, state)` gets its keys in
through one of two routes:

- `LLMKitTrainer.log` (a documented override point) calls `add_callback_logs` *before* `Trainer.log`, so the keys
  reach `log_history` and every reporter;
- with a plain `Trainer`, the callback's own `on_log` calls `add_callback_logs([self], ...)`: the keys reach
  `log_history` and the callbacks after it (the progress/printer callback), not the reporters before it.

Example:
    ```python
    from hf_llmkit.log_bridge import add_callback_logs

    class Contributor:
        def contribute_logs(self, logs, state):
            return {"my_metric": 1.0}

    logs = {"loss": 2.0}
    add_callback_logs([Contributor()], logs, state=None)
    assert logs["my_metric"] == 1.0
    ```
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["add_callback_logs"]


def add_callback_logs(callbacks: Iterable[Any], logs: dict[str, float], state: Any) -> dict[str, float]:
    """Merge what each `contribute_logs`-capable callback returns into `logs` (in place; returns what was added)."""
    added: dict[str, float] = {}
    for callback in callbacks:
        contribute = getattr(callback, "contribute_logs", None)
        if callable(contribute):
            added.update(contribute(logs, state) or {})
    logs.update(added)
    return added
