"""The exit statuses hf_llmkit's runs end with: one table, read by the errors, the arguments and the main jobs.

| status | name             | meaning                                                                | re-run?        |
|--------|------------------|------------------------------------------------------------------------|----------------|
| 0      |                  | finished                                                               | no             |
| 2      | `EXIT_USAGE`     | bad input (a flag, a file, a folder in use, another run's checkpoint)  | after the fix  |
| 3      | `EXIT_DIVERGED`  | the loss diverged beyond `max_rollbacks` (`divergence_exit_code`)      | with lower LR  |
| 74     | `EXIT_IO_ERROR`  | a checkpoint could not be written (disk full, no permission; EX_IOERR) | after freeing  |
| 143    | `EXIT_PREEMPTED` | stopped by SIGTERM / SIGUSR1 after a complete checkpoint               | yes, as it was |
"""

from __future__ import annotations

__all__ = ["EXIT_DIVERGED", "EXIT_IO_ERROR", "EXIT_PREEMPTED", "EXIT_USAGE"]

EXIT_USAGE = 2  # argparse's status for bad arguments
EXIT_DIVERGED = 3
EXIT_IO_ERROR = 74  # sysexits.h EX_IOERR
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what schedulers and `torchrun --max-restarts` read as "killed, run again"
