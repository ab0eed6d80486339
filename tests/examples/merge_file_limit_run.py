"""Run by test_run_sft.py in a process of its own: the merged model's save meets a real write failure.

`python tests/examples/merge_file_limit_run.py LIMIT FLAGS...` runs examples/run_sft.py with FLAGS under a file size
limit of LIMIT bytes (RLIMIT_FSIZE, with SIGXFSZ ignored so that a write past it fails with EFBIG instead of killing
the process, as a nearly full disk fails with ENOSPC). A limit above the adapter's files and below the model's
weights makes the merged model's save the one write that fails.
"""

from __future__ import annotations

import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import load_example  # noqa: E402

if __name__ == "__main__":
    limit, flags = int(sys.argv[1]), sys.argv[2:]
    run_sft = load_example("run_sft")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    sys.argv = ["run_sft.py", *flags]
    run_sft.main()
