"""Every use of a host library's private API, one module per host library.

Where transformers, peft, accelerate or DeepSpeed offer no public way to do what hf_llmkit needs, the private
use lives in `hf_llmkit.compat.<library>`, next to the version it was checked against (`CHECKED_AGAINST`);
`tests/compat/` fails loudly when an installed version no longer has what a module relies on.
"""
