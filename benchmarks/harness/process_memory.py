"""This process's resident memory from the kernel (`/proc/self/status`), for the benchmarks' fresh processes: the
resident size (`VmRSS`) and its high-water mark (`VmHWM`), which `reset_peak` resets so that a later peak is
measured apart from an earlier one. Shared by the variants' processes of benchmarks/dkm_inference.py
(`areas/inference/worker.py`, `areas/inference/onnxrt.py`) and benchmarks/dkm_onnx.py; it imports nothing of theirs."""

from __future__ import annotations

from pathlib import Path


def status_kib(field: str) -> int:
    """`field` of /proc/self/status in KiB ("VmRSS", "VmHWM"); 0 where the kernel has no such file (not Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) of this process; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
