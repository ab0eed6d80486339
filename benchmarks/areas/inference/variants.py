"""The variants of benchmarks/dkm_inference.py: how each is prepared on disk and loaded, and the bytes it holds.

Every variant starts from the same random-weight bf16 Llama checkpoint (`dense`), written once by `prepare`:
- dense fp32 / bf16: `from_pretrained` of it in that dtype;
- ours: `from_pretrained(dense, quantization_config=DKMConfig(...))`, `save_pretrained` (packed indices, tables,
  block scales), then `from_pretrained` of that compact checkpoint (its Linear layers are `PalettizedLinear`);
- bitsandbytes nf4: quantized by `BitsAndBytesConfig(load_in_4bit=True)` at prepare time, saved and reloaded;
- GPTQ (gptqmodel): quantized at prepare time on corpus blocks (group 64), saved, reloaded with its torch kernel;
- HQQ (its torch backend) and torchao weight-only: quantized at load (neither reloads a saved model here), so their
  load-time peak includes the bf16 weights; their inference peak is measured apart.
Only the decoder layers' Linear weights are quantized, by every method (embeddings and the LM head stay dense, as
`DKMConfig`'s default `modules_to_not_convert=["lm_head"]` keeps them). A peer that cannot run here raises
`Unavailable` with a one-line reason.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # gptqmodel asks its CPU pool for 2 loader threads


class Unavailable(RuntimeError):
    """This peer cannot run on this machine; the message is the one-line reason the results record."""


def preimport() -> dict[str, str]:
    """Import transformers, hf_llmkit and every installed peer once in the benchmark's process (its children are
    forks of it on CPU); returns {package: version or why it is missing}. Runs no torch op (a fork must not inherit
    a started OpenMP pool)."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    import transformers
    from transformers import AutoModelForCausalLM  # noqa: F401

    transformers.utils.logging.disable_progress_bar()

    import hf_llmkit  # noqa: F401
    from hf_llmkit.quantization import layers  # noqa: F401

    found = {}
    for module, dist in (("bitsandbytes", "bitsandbytes"), ("hqq.core.quantize", "hqq"),
                         ("torchao.quantization", "torchao"), (None, "gptqmodel")):  # fmt: skip
        try:  # not gptqmodel: its import starts threads, whose locks a fork would inherit held (children hang)
            if module:
                importlib.import_module(module)
            found[dist] = version(dist)
        except (ImportError, PackageNotFoundError) as e:
            found[dist] = f"not installed ({type(e).__name__})"
    return found


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape.get("kv_heads", shape["heads"]),
        vocab_size=shape["vocab"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def prepare(spec: dict) -> None:
    """Write the variant's checkpoint into `spec["dir"]` (nothing for variants quantized at load)."""
    out, kind = Path(spec["dir"]), spec["kind"]
    try:
        if kind == "checkpoint":
            _dense_checkpoint(spec, out)
        elif kind == "ours":
            from transformers import AutoModelForCausalLM

            from hf_llmkit import DKMConfig

            config = DKMConfig(bits=spec["bits"], **spec["options"])
            model = AutoModelForCausalLM.from_pretrained(spec["dense_dir"], quantization_config=config)
            model.eval().save_pretrained(out)
        elif kind == "bnb":
            from transformers import AutoModelForCausalLM, BitsAndBytesConfig

            config = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch.bfloat16,
                llm_int8_skip_modules=["lm_head"],
            )
            model = AutoModelForCausalLM.from_pretrained(
                spec["dense_dir"], quantization_config=config, device_map="cpu", dtype=torch.bfloat16
            )
            model.save_pretrained(out)
        elif kind == "gptq":
            _gptq_prepare(spec, out)
        elif kind == "llama_cpp":
            from areas.inference import llamacpp

            llamacpp.prepare(spec)
        elif kind == "onnx":  # onnxruntime rows: areas/inference/onnxrt.py
            from areas.inference.onnxrt import prepare as onnx_prepare

            onnx_prepare(spec)
    except Exception as e:  # the reason a peer cannot run, for `load` to raise
        if kind in ("checkpoint", "ours", "onnx"):
            raise
        out.mkdir(parents=True, exist_ok=True)
        (out / "UNAVAILABLE").write_text(f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}")


def _dense_checkpoint(spec: dict, out: Path) -> None:
    from transformers import LlamaForCausalLM

    from hf_llmkit.data.corpus import corpus_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(spec["shape"])).to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    corpus_tokenizer(vocab_size=4096).save_pretrained(out)  # gptqmodel loads a tokenizer from the folder


def _gptq_prepare(spec: dict, out: Path) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    from hf_llmkit.data.corpus import corpus_tokenizer
    from hf_llmkit.testing import corpus_texts

    tokenizer = corpus_tokenizer(vocab_size=4096)
    ids = tokenizer("\n".join(corpus_texts()[:400]))["input_ids"]
    block, count = 128, spec.get("calibration_blocks", 8)
    samples = [
        {
            "input_ids": torch.tensor([ids[i * block : (i + 1) * block]]),
            "attention_mask": torch.ones(1, block, dtype=torch.long),
        }
        for i in range(count)
    ]
    model = GPTQModel.load(spec["dense_dir"], QuantizeConfig(bits=spec["bits"], group_size=64), device="cpu")
    model.quantize(samples, batch_size=1)
    model.save(str(out))


def _unavailable(spec: dict) -> None:
    marker = Path(spec["dir"]) / "UNAVAILABLE"
    if marker.exists():
        raise Unavailable(marker.read_text())


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and ".layers." in f".{n}"}


def load(spec: dict) -> nn.Module:
    """The variant, ready for `generate`, on `spec["device"]`."""
    from transformers import AutoModelForCausalLM

    kind, dense, device = spec["kind"], spec["dense_dir"], spec["device"]
    if kind == "dense":
        model = AutoModelForCausalLM.from_pretrained(dense, dtype=getattr(torch, spec["dtype"]))
    elif kind == "ours":
        import hf_llmkit  # noqa: F401  registers "dkm": without it transformers loads random dense Linears
        from hf_llmkit.quantization.layers import PalettizedLinear

        dtype = {"dtype": getattr(torch, spec["dtype"])} if spec.get("dtype") else {}  # default: the saved one
        model = AutoModelForCausalLM.from_pretrained(spec["dir"], **dtype)
        wrong = {type(m).__name__ for m in _decoder_linears(model).values()}
        if wrong or not any(isinstance(m, PalettizedLinear) for m in model.modules()):
            raise RuntimeError(f"the compact checkpoint reloaded without PalettizedLinear layers (found {wrong})")
    elif kind == "bnb":
        _unavailable(spec)
        model = AutoModelForCausalLM.from_pretrained(spec["dir"], device_map=device)
    elif kind == "gptq":
        _unavailable(spec)
        from gptqmodel import BACKEND, GPTQModel

        backend = BACKEND.TORCH if device == "cpu" else BACKEND.AUTO
        return GPTQModel.load(spec["dir"], device=device, backend=backend).model.eval()
    elif kind == "hqq":
        model = _hqq(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16), spec["bits"], device)
    elif kind == "torchao_int4":
        model = _torchao_int4(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16), device)
    elif kind == "torchao_intx":
        model = _torchao_intx(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16), spec["bits"])
    else:
        raise ValueError(f"unknown variant kind {kind!r}")
    return model.to(device).eval()


def _hqq(model: nn.Module, bits: int, device: str) -> nn.Module:
    try:
        from hqq.core.quantize import BaseQuantizeConfig, HQQBackend, HQQLinear
    except ImportError as e:
        raise Unavailable(f"hqq is not installed ({e}): bash benchmarks/install_peers.sh") from e
    HQQLinear.set_backend(HQQBackend.PYTORCH)
    config = BaseQuantizeConfig(nbits=bits, group_size=64)
    for name, linear in _decoder_linears(model).items():
        parent, child = name.rsplit(".", 1)
        quantized = HQQLinear(linear, quant_config=config, compute_dtype=torch.bfloat16, device=device, del_orig=True)
        setattr(model.get_submodule(parent), child, quantized)
    return model


def _torchao_int4(model: nn.Module, device: str) -> nn.Module:
    """torchao's int4 weight-only (group 64) in the first packing format that takes this device."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except ImportError as e:
        raise Unavailable(f"torchao is not installed ({e}): bash benchmarks/install_peers.sh") from e
    linears = _decoder_linears(model)
    errors = []
    for packing in ("plain", "tile_packed_to_4d", "plain_int32"):
        probe = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16, device=device)
        try:
            quantize_(probe, Int4WeightOnlyConfig(group_size=64, int4_packing_format=packing))
            probe(torch.zeros(1, 64, dtype=torch.bfloat16, device=device))
        except Exception as e:
            errors.append(f"{packing}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        config = Int4WeightOnlyConfig(group_size=64, int4_packing_format=packing)
        quantize_(model, config, filter_fn=lambda m, fqn: fqn in linears)
        return model
    import torchao

    raise Unavailable(
        f"torchao {torchao.__version__} int4 weight-only has no {device} packing format ({'; '.join(errors)})"
    )


def _torchao_intx(model: nn.Module, bits: int) -> nn.Module:
    try:
        from torchao.quantization import IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    except ImportError as e:
        raise Unavailable(f"torchao is not installed ({e}): bash benchmarks/install_peers.sh") from e
    linears = _decoder_linears(model)
    config = IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(64))
    quantize_(model, config, filter_fn=lambda m, fqn: fqn in linears)
    return model


# -- bytes held ---------------------------------------------------------------------------------------------------


def _tensors(value, depth: int = 0):
    """Every plain tensor reachable from `value` (tensor subclasses flattened, quantization states' attributes)."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "__tensor_flatten__") and type(value) not in (torch.Tensor, nn.Parameter):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _tensors(getattr(value, name), depth)
        else:
            yield value
            if type(value) not in (torch.Tensor, nn.Parameter):  # e.g. bitsandbytes' Params4bit.quant_state
                yield from _tensors(vars(value), depth + 1)
        return
    if depth > 3 or isinstance(value, (str, bytes, int, float, bool, type(None), nn.Module)):
        return
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    elif hasattr(value, "__dict__"):
        items = vars(value).values()
    else:
        return
    for item in items:
        yield from _tensors(item, depth + 1)


def _bytes(modules) -> int:
    seen, total = set(), 0
    for module in modules:
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if any(value is own for own in (module._parameters, module._buffers, module._modules)):
                continue
            for t in _tensors(value):
                if isinstance(t, nn.Parameter):  # bitsandbytes' Params4bit is a Parameter subclass: its data
                    t = t.data
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key not in seen and storage.nbytes():
                    seen.add(key)
                    total += storage.nbytes()
    return total


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every tensor the model holds (parameters, buffers, tensors kept as attributes: quantization states,
    tables, caches; each storage once), for the whole model and for its decoder layers alone."""
    layers = [m for n, m in model.named_modules() if ".layers." in f".{n}."]
    return {"model": _bytes(list(model.modules())), "decoder": _bytes(layers)}


def describe(model: nn.Module) -> str:
    """The class of the first decoder layer's MLP down projection (and of its weight, when that is a subclass)."""
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.down_proj"))
    weight = getattr(layer, "weight", None)
    kind = type(layer).__name__
    if isinstance(weight, torch.Tensor) and type(weight) not in (torch.Tensor, nn.Parameter):
        kind += f" ({type(weight).__name__})"
    return kind


def loops_taken(model: nn.Module, spec: dict) -> str:
    """Which code multiplied: the DKM kernel's loops the packed layers take on this CPU for the model's dtype (with
    `spec["loops"]` capping them), or torch's CPU capability for the others."""
    if spec["device"] != "cpu":
        return spec["device"]
    if spec["kind"] == "ours":
        from hf_llmkit.quantization import _lut_native as native
        from hf_llmkit.quantization.layers import PalettizedEmbedding, PalettizedLinear

        bf16 = model.dtype == torch.bfloat16
        levels = set()
        for module in model.modules():
            if isinstance(module, (PalettizedLinear, PalettizedEmbedding)):
                scale = module.weight_scale
                block = 0 if scale is None else module.weight_shape[1] // scale.shape[1]
                bits = module.settings.bits
                levels.add(f"{bits}-bit {native.loops(bits, block, bf16, module.weight_lut.dtype)}")
        return "DKM kernel: " + ", ".join(sorted(levels))
    return f"torch {torch.backends.cpu.get_cpu_capability()}"


KERNEL_MODULES = ("Linear", "PalettizedLinear", "TiedDKMHead", "PalettizedEmbedding", "Embedding", "Linear4bit")


def kernel_seconds(model: nn.Module, run) -> float:
    """Seconds `run()` spends inside the modules that multiply by (or look up) weights, timed by forward hooks; the
    rest of its time is the framework's (norms, attention, cache, generate's own steps, Python)."""
    total, started = [0.0], {}
    handles = []

    def before(module, args):
        started[id(module)] = time.perf_counter()

    def after(module, args, output):
        total[0] += time.perf_counter() - started.pop(id(module))

    for module in model.modules():
        if type(module).__name__ in KERNEL_MODULES:
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return total[0]


def dkm_paths() -> list[str]:
    """The packed-inference paths our layers took in this process ("cpu:compile", ...), as `lut_gemv` logged them;
    empty where none ran (or before that module existed)."""
    import sys

    module = sys.modules.get("hf_llmkit.quantization.lut_gemv")
    return sorted(f"{device}:{path}" for device, path in getattr(module, "_logged", ()))
