"""Every use of a host library's private API, one module per host library.

Where transformers, peft, accelerate or DeepSpeed offer no public way to do what hf_llmkit needs, the private
use lives in `hf_llmkit.compat.<library>` (`accelerate`, `deepspeed`, `peft`, `transformers`; the exporters'
`coremltools` and `onnxruntime_extensions`), next to the version it was checked against (`CHECKED_AGAINST`) and the
reason it is needed; `tests/compat/` fails loudly when an installed version no longer has what a module relies on.
bitsandbytes and datasets are used through public APIs only.
"""
