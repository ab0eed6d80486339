"""The tokenizer and model a causal-LM training command trains, from local folders only.

- `load_tokenizer`: the tokenizer folder, the model folder, or the BPE trained on the embedded corpus.
- `load_model`: a pretrained folder (`AutoModelForCausalLM.from_pretrained`, optionally quantized by DKM or
  bitsandbytes), or a new model of any transformers causal-LM architecture built from `causal_lm_config`
  (`AutoConfig` + `AutoModelForCausalLM.from_config`, like transformers' `run_clm.py --model_type`).

Whatever transformers (or huggingface_hub's strict config validation) raises while it turns the user's values into
a config or a model is the user's input being rejected, whatever its class (`StrictDataclassClassValidationError`
is no `ValueError`; a new release may add others): it is re-raised as a `ValueError` naming the flags to change.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from hf_llmkit.data.corpus import corpus_tokenizer

__all__ = [
    "SIZE_FLAGS", "causal_lm_config", "check_scratch_config", "context_length", "load_model", "load_tokenizer",
    "ties_embeddings",
]  # fmt: skip
# The model sizes a from-scratch model takes from the command line (where its architecture has them).
SIZE_FLAGS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings",
)  # fmt: skip


def _describe(err: BaseException) -> str:
    """The host's reason in one line: the innermost cause (huggingface_hub wraps the validator's ValueError)."""
    while err.__cause__ is not None and str(err.__cause__):
        err = err.__cause__
    text = " ".join(str(err).split())
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


def load_tokenizer(model_args: Any):
    """`--tokenizer_name_or_path`, else the model folder, else the corpus BPE of `--vocab_size` tokens."""
    source = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if source is None:
        return corpus_tokenizer(vocab_size=model_args.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.sep_token
    if tokenizer.eos_token is None and tokenizer.sep_token is not None:
        tokenizer.eos_token = tokenizer.sep_token  # encoder tokenizers (BERT) end documents with [SEP]
    return tokenizer


def causal_lm_config(
    model_type: str,
    *,
    tokenizer: Any,
    sizes: Mapping[str, int],
    overrides: str | None = None,
    required: Iterable[str] = (),
    vocab_size: int | None = None,
) -> PretrainedConfig:
    """A new config of `model_type` with the tokenizer's vocabulary, `sizes` where the architecture has them, and
    `overrides` (`"key=value,key=value"`) applied last. A name in `required` (a size the user typed) that the
    architecture does not have raises `ValueError`, as does any config transformers rejects. Without a tokenizer
    (checking the flags before any work) `vocab_size` stands in for its vocabulary."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. llama, mistral, qwen2, gpt2"
        raise ValueError(f"--model_type {model_type!r} is not a transformers causal LM; {hint}")
    defaults = AutoConfig.for_model(model_type)
    for name in required:
        if not hasattr(defaults, name):
            raise ValueError(f"--{name} has no effect for --model_type {model_type} (its config has no {name})")
    kwargs = {name: value for name, value in sizes.items() if hasattr(defaults, name)}
    special = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id", None) for t in ("pad", "bos", "eos")}
    vocab = len(tokenizer) if tokenizer is not None else vocab_size
    try:
        config = AutoConfig.for_model(model_type, vocab_size=vocab, tie_word_embeddings=False, **special, **kwargs)
        if overrides:
            config.update_from_string(overrides)
    except Exception as err:  # noqa: BLE001 - any rejection of the user's values (see the module docstring)
        raise ValueError(
            f"transformers rejects this {model_type} config ({_describe(err)}); fix the size flags or "
            "--config_overrides"
        ) from None
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        divisors = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        raise ValueError(
            f"--num_key_value_heads {kv_heads} does not divide --num_attention_heads {heads} (each key/value head "
            f"serves a whole group of query heads); pass one of {divisors}"
        )
    return config


def _scratch_sizes(model_args: Any) -> dict[str, int]:
    return {name: getattr(model_args, name) for name in SIZE_FLAGS}


def check_scratch_config(model_args: Any, *, required: Iterable[str] = ()) -> None:
    """For a model built from scratch: the config its flags describe, built before any work (the `--vocab_size`
    standing in for the tokenizer's), so sizes and overrides transformers rejects stop the command at once."""
    if model_args.model_name_or_path is None:
        causal_lm_config(
            model_args.model_type, tokenizer=None, vocab_size=model_args.vocab_size, sizes=_scratch_sizes(model_args),
            overrides=model_args.config_overrides, required=required,
        )  # fmt: skip


def context_length(config: Any) -> int | None:
    """The model's maximum sequence length, under any of the names transformers configs use."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def ties_embeddings(model: torch.nn.Module) -> bool:
    """Whether the output layer shares its weight with the input embedding (a DKM `TiedDKMHead` multiplies by its
    clustered embedding's own weight: tied too)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is None:
        return False
    inputs = model.get_input_embeddings()
    if getattr(output, "embedding", None) is inputs:  # hf_llmkit.quantization.tied.TiedDKMHead
        return True
    weight = getattr(output, "weight", None)
    return weight is not None and weight is getattr(inputs, "weight", None)


def _dtype(name: str | None) -> Any:
    return name if name in (None, "auto") else getattr(torch, name)


def load_model(model_args: Any, tokenizer: Any, *, quantization_config: Any = None, required: Iterable[str] = ()):
    """The model to train: `model_args.model_name_or_path` (a local folder), or a new `model_args.model_type`.

    `quantization_config` (a `DKMConfig` or `BitsAndBytesConfig`) quantizes a pretrained model's weights while
    they load; a new model is quantized afterwards (`quantize_model`, the DKM feature's stage in the main jobs).
    `required` lists the size flags the user typed (see `causal_lm_config`).
    """
    dtype = _dtype(model_args.torch_dtype)
    kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.model_name_or_path is None:
        if quantization_config is not None:
            raise ValueError("a model built from scratch is quantized after it is built: use quantize_model")
        config = causal_lm_config(
            model_args.model_type, tokenizer=tokenizer, sizes=_scratch_sizes(model_args),
            overrides=model_args.config_overrides,
            required=required,
        )  # fmt: skip
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except Exception as err:  # noqa: BLE001 - any rejection of the user's values (see the module docstring)
            raise ValueError(
                f"transformers cannot build a {config.model_type} model from this config ({_describe(err)}); "
                "fix --config_overrides or the size flags"
            ) from None
        return model
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    if getattr(config, "is_decoder", True) is False:
        config.is_decoder = True  # encoder checkpoints (BERT family) train causally as decoders
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config, **kwargs)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    return model
