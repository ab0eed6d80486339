"""Sequence parallelism and mixture of experts: DeepSpeed's ALST peers, the longest-sequence search and the offload
bytes of `sequence_parallel.py`, and the fragments of `sequence_parallel.py` and `moe.py`."""
