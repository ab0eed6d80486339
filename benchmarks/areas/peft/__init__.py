"""PEFT methods: the workloads of `peft_methods.py` and its fragments."""
