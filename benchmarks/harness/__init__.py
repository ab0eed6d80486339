"""The harness every benchmark shares, area-neutral (it imports nothing of `areas`).

- `common`: interleaved rounds in rotated order (`Bench`), devices, peak memory, the machine and its load over the
  run, results files (`write_results`), tables and plots;
- `slices`: a variant in a fresh process of its own, a crash as a row with its reason, rows saved as measured,
  `--only-missing` to resume;
- `process_memory` (a process's resident peak), `tensor_memory` (tensors counted on CPU);
- `registry`: the docs fragments `report.py` renders (`@fragment`, `measured`), which each area's `fragments` fill.
"""
