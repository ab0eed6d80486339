"""Package discovery for hf-llmkit; everything else is declared in pyproject.toml.

`callbacks/` and `trainers/` sit at the repository's top level (the product's layout) but install as
`hf_llmkit.callbacks` and `hf_llmkit.trainers`. setuptools cannot combine automatic discovery with such a
mapping in pyproject.toml alone, so the list is computed here: every package under `hf_llmkit/`, plus the two
mapped folders and their own subpackages.
"""

from setuptools import find_packages, setup

MAPPED = {"hf_llmkit.callbacks": "callbacks", "hf_llmkit.trainers": "trainers"}

packages = find_packages(include=["hf_llmkit", "hf_llmkit.*"])
package_dir = {"hf_llmkit": "hf_llmkit"}
for name, folder in MAPPED.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")

# The C kernels (the packed DKM layers', DKM training's interval engine, the MoE experts' and routing's): sources
# compiled on the user's machine at first use (hf_llmkit/native.py)
package_data = {
    "hf_llmkit": ["_avx2_level.c"],
    "hf_llmkit.quantization": ["_lut_native.c", "_lut_avx2.c", "_lut_avx512.c", "_lut_neon.c"],
    "hf_llmkit.quantization.engines": ["_interval_native.c"],
    "hf_llmkit.parallel.moe": ["_swiglu_native.c", "_routing_native.c"],
}

setup(packages=packages, package_dir=package_dir, package_data=package_data)
