"""A worker of tests/examples/two_nodes.py (`torchrun --run-path two_nodes_worker.py SCRIPT ARGS`): notes its pid as
the worker of its RANK in `$TWO_NODES_WORKERS`, then runs SCRIPT with ARGS as `__main__`, as `python SCRIPT ARGS`
would (its output line-buffered, as torchrun's `python -u`)."""

import os
import runpy
import sys
from pathlib import Path

sys.stdout.reconfigure(line_buffering=True)
(Path(os.environ["TWO_NODES_WORKERS"]) / f"rank{os.environ['RANK']}-{os.getpid()}").touch()
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
