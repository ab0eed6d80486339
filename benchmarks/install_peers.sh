#!/usr/bin/env bash
# The peers of benchmarks/dkm_quality.py, installed into the current environment beside hf_llmkit's pins.
# --no-deps where a peer's own requirements would move torch or transformers (llmcompressor pins
# transformers<=5.17 and compressed-tensors 0.19; it runs GPTQ on CPU with ours); coremltools and bitsandbytes come
# with `make install` already. Usage: bash benchmarks/install_peers.sh  (uses .venv/bin/pip when present).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo pip )}"
"$PIP" install --no-deps torchao==0.18.0 hqq==0.2.8.post1 llmcompressor==0.14.0.1 compressed-tensors==0.20.0
"$PIP" install loguru termcolor requests scipy matplotlib
