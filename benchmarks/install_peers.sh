#!/usr/bin/env bash
# The peers of benchmarks/dkm_quality.py and dkm_inference.py, installed into the current environment beside
# hf_llmkit's pins.
# --no-deps where a peer's own requirements would move torch or transformers (llmcompressor pins
# transformers<=5.17 and compressed-tensors 0.19; it runs GPTQ on CPU with ours; gptqmodel 7.7 asks for torch>=2.14.1
# and runs its torch kernel on ours, with the few packages it imports); coremltools and bitsandbytes come
# with `make install` already. Usage: bash benchmarks/install_peers.sh  (uses .venv/bin/python -m pip when present).
set -euo pipefail
cd "$(dirname "$0")/.."
# `python -m pip`: a copied virtual environment's bin/pip still names the python it was made with
PIP="${PIP:-$( [ -x .venv/bin/python ] && echo .venv/bin/python -m pip || echo python -m pip )}"
$PIP install --no-deps torchao==0.18.0 hqq==0.2.8.post1 llmcompressor==0.14.0.1 compressed-tensors==0.20.0
$PIP install --no-deps gptqmodel==7.7.0 pypcre==0.6.4 logbar==0.4.15 tokenicer==0.0.14 device-smi==0.5.7 \
    defuser==0.0.28 threadpoolctl
$PIP install loguru termcolor requests scipy matplotlib
