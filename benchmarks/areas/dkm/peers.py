"""The methods `dkm_quality.py` compares, each applied to a model in place: ours and real peers from PyPI.

Every function takes a full-precision model (its `nn.Linear` matrices are quantized, the names in `skip` are left
alone), quantizes it and returns the bits per weight its stored form needs over those matrices, counted from what
the method keeps (packed indices or integers, lookup tables, scales, zero points). Scales, zero points and
tables count what their stored formats hold: the peers' scales and zero points 16 bits each (bf16/fp16 scales, zero
points at `bits` bits where the format packs them), our lookup tables the width our checkpoints store them in (32
bits, 16 with `lut_dtype="float16"`); bitsandbytes nf4 keeps an fp32 absmax per block of 64 (no double
quantization): 4.5 bits. Trained methods get a `train` callable (the workload's distillation step, the same batches
and budget for every trained method).

Peers (`benchmarks/install_peers.sh` installs them): torchao 0.18 QAT (`IntxFakeQuantizeConfig`) and weight-only
PTQ (`IntxWeightOnlyConfig`), HQQ 0.2.8,
llmcompressor 0.14 GPTQ, bitsandbytes nf4, coremltools 9 k-means palettization (`PostTrainingPalettizer`) and DKM
(`DKMPalettizer`). A peer that cannot run here raises; the benchmark records the one-line reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def linears(model: nn.Module, skip: tuple[str, ...]) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and not n.endswith(skip)}


def _numel(layers) -> int:
    return sum(m.weight.numel() for m in layers.values())


SCALE_BITS = 16  # a peer's scale or zero point, as its deployed format stores it (bf16 / fp16)


# ---- ours --------------------------------------------------------------------------------------------------------


def dkm(model, bits: int, skip, train: Callable | None, *, calibration=None, start=None, **options) -> float:
    """DKM (hf_llmkit): k-means tables, then (with `train`) DKM training, then (with `calibration`, model inputs)
    GPTQ's rounding onto the trained tables (`hf_llmkit.quantization.calibrate`); bits of the packed export + its
    tables and block scales (in `lut_dtype`, float32 unless `options` say otherwise). With `recipe="calibrated"` the
    calibration comes first and training starts from it (what `DKMTrainingStateCallback` does in a Trainer). With
    `start` (`dkm_state` of a calibrated model) training starts from that model's latent weights, tables and scales
    instead, and nothing is calibrated: a calibrated start, which training keeps (`DKMLinear.start`)."""
    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import DKMLinear, calibrate, keep_training_state, quantize_model

    config = DKMConfig(bits=bits, modules_to_not_convert=list(skip), **options)
    quantize_model(model, config)
    keep_training_state(model, False)  # this loop saves no checkpoints
    layers = {n: m for n, m in model.named_modules() if isinstance(m, DKMLinear)}
    first = config.recipe == "calibrated"
    if start is not None:
        with torch.no_grad():
            for name, layer in layers.items():
                weight, table, scales, *importance = start[name]
                for tensor, saved in zip((layer.weight, layer.centroids, layer.scales), (weight, table, scales)):
                    if saved is not None:
                        tensor.copy_(saved)
                layer.start = "calibrated"  # its scales are kept; DKM's iterations weigh by its importance (issue 50)
                if importance and importance[0] is not None:
                    layer.importance = importance[0].clone()
    elif calibration is not None and first:
        calibrate(model, _rows(calibration))
    if train is not None:
        train(model)
    if calibration is not None and not first and start is None:
        calibrate(model, _rows(calibration))
    stored = sum(t.nbytes * 8 for m in layers.values() for t in m.export().values())
    return stored / sum(m.weight.numel() for m in layers.values())


def dkm_state(model) -> dict[str, tuple]:
    """{name: (latent weight, table, block scales or None, importance or None)} of every DKM Linear: a start `dkm`
    can train from (the importance `calibrate` keeps weighs DKM's centroid iterations)."""
    from hf_llmkit.quantization import DKMLinear

    return {
        n: tuple(None if t is None else t.detach().clone() for t in (m.weight, m.centroids, m.scales, m.importance))
        for n, m in model.named_modules()
        if isinstance(m, DKMLinear)
    }


def _rows(calibration: dict, size: int = 8) -> list[dict]:
    """The calibration inputs in batches of `size` rows (the first batch runs the whole model, LM head included)."""
    count = len(next(iter(calibration.values())))
    return [{k: v[i : i + size] for k, v in calibration.items()} for i in range(0, count, size)]


TABLE_BUDGET = 0.25  # bits per weight the per-channel tables may add: about what a g64 peer's scale + zero cost


def channels_per_table(model, bits: int, skip, table_bits: int = 16) -> int:
    """The fewest output channels per table (a power of two dividing every target's rows) whose tables add at most
    `TABLE_BUDGET` bits per weight over the targets."""
    targets = list(linears(model, skip).values())
    numel = sum(m.weight.numel() for m in targets)
    size = 1
    while sum(m.weight.shape[0] // size for m in targets) * (1 << bits) * table_bits > TABLE_BUDGET * numel:
        if any(m.weight.shape[0] % (2 * size) for m in targets):
            break
        size *= 2
    return size


# ---- trained peers -----------------------------------------------------------------------------------------------


def torchao_qat(model, bits: int, skip, train: Callable, group_size: int | None = 64) -> float:
    """torchao QAT: int`bits` symmetric weight-only fake quantization per group of `group_size` inputs (None: one
    scale per output channel), then training; a 16-bit scale per group."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    dtype = getattr(torch, f"int{bits}")
    if group_size is None:
        weight_config = IntxFakeQuantizeConfig(dtype, granularity="per_channel", is_symmetric=True)
    else:
        weight_config = IntxFakeQuantizeConfig(dtype, group_size=group_size, is_symmetric=True)
    targets = linears(model, skip)
    scales = sum(
        m.weight.shape[0] * (1 if group_size is None else m.weight.shape[1] // group_size) for m in targets.values()
    )
    quantize_(model, QATConfig(weight_config=weight_config), filter_fn=lambda m, name: name in targets)
    train(model)
    return (_numel(targets) * bits + scales * SCALE_BITS) / _numel(targets)


def coreml_dkm(model, bits: int, skip, train: Callable) -> float:
    """coremltools `DKMPalettizer` (per-tensor LUT), then training; bits of indices + an fp32 LUT per matrix."""
    from coremltools.optimize.torch.palettization import DKMPalettizer, DKMPalettizerConfig

    targets = linears(model, skip)
    config = DKMPalettizerConfig.from_dict(
        {"module_name_configs": {name: {"n_bits": bits, "cluster_dim": 1} for name in targets}}
    )
    palettizer = DKMPalettizer(model, config)
    palettizer.prepare(inplace=True)
    train(model, step_hook=palettizer.step)
    palettizer.finalize(inplace=True)
    return (_numel(targets) * bits + len(targets) * (1 << bits) * 32) / _numel(targets)


# ---- post-training peers -----------------------------------------------------------------------------------------


def torchao_ptq(model, bits: int, skip, train=None, group_size: int = 64) -> float:
    """torchao weight-only post-training quantization (`IntxWeightOnlyConfig`, int`bits`, asymmetric, a scale and a
    zero point per group of `group_size` inputs, no data): a 16-bit scale and a `bits`-bit zero point per group."""
    from torchao.quantization import IntxWeightOnlyConfig, MappingType, PerGroup, quantize_

    targets = linears(model, skip)
    groups = sum(m.weight.numel() // group_size for m in targets.values())
    config = IntxWeightOnlyConfig(getattr(torch, f"int{bits}"), PerGroup(group_size), MappingType.ASYMMETRIC)
    quantize_(model, config, filter_fn=lambda m, name: name in targets)
    return (_numel(targets) * bits + groups * (SCALE_BITS + bits)) / _numel(targets)


def coreml_kmeans(model, bits: int, skip, train=None) -> float:
    """coremltools `PostTrainingPalettizer`: k-means palettization per tensor, no data."""
    from coremltools.optimize.torch.palettization import PostTrainingPalettizer, PostTrainingPalettizerConfig

    targets = linears(model, skip)
    config = PostTrainingPalettizerConfig.from_dict(
        {"module_name_configs": {name: {"n_bits": bits, "granularity": "per_tensor"} for name in targets}}
    )
    PostTrainingPalettizer(model, config).compress(inplace=True)
    return (_numel(targets) * bits + len(targets) * (1 << bits) * 32) / _numel(targets)


def hqq(model, bits: int, skip, train=None, group_size: int = 64) -> float:
    """HQQ (half-quadratic, data-free), asymmetric per group; bits of the integers + the stored scales and zeros."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQBackend, HQQLinear

    HQQLinear.set_backend(HQQBackend.PYTORCH)
    targets = linears(model, skip)
    stored = 0
    for lin in targets.values():
        config = BaseQuantizeConfig(nbits=bits, group_size=group_size, axis=1)
        q = HQQLinear(lin, quant_config=config, compute_dtype=torch.float32, device="cpu", del_orig=False)
        stored += lin.weight.numel() * bits + sum(q.meta[k].numel() * SCALE_BITS for k in ("scale", "zero"))
        with torch.no_grad():
            lin.weight.copy_(q.dequantize().reshape(lin.weight.shape).to(lin.weight.dtype))
    return stored / _numel(targets)


def gptq(model, bits: int, skip, train=None, *, calibration, group_size: int = 64) -> float:
    """llmcompressor GPTQ (asymmetric per group, calibrated on the workload's training inputs)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    targets = linears(model, skip)
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    ignore = [name for name, m in model.named_modules() if type(m) is nn.Linear and name not in targets]
    recipe = GPTQModifier(config_groups={"group": scheme}, ignore=ignore, dampening_frac=0.01)
    data = Dataset.from_dict({k: [row.tolist() for row in v] for k, v in calibration.items()})
    n = len(data)
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=n, pipeline="basic")
    stored = 0
    for lin in targets.values():
        stored += lin.weight.numel() * bits
        for name in ("weight_scale", "weight_zero_point"):
            extra = getattr(lin, name, None)
            if extra is not None:  # zero points are stored packed at `bits` bits; scales at 16 bits
                stored += extra.numel() * (bits if "zero" in name else SCALE_BITS)
    return stored / _numel(targets)


def bnb_nf4(model, bits: int, skip, train=None) -> float:
    """bitsandbytes nf4 (blocks of 64, fp32 absmax, no double quantization); quantized and dequantized per matrix."""
    import bitsandbytes.functional as bnbf

    if bits != 4:
        raise ValueError("nf4 is a 4-bit format")
    targets = linears(model, skip)
    stored = 0
    for lin in targets.values():
        w = lin.weight.data
        packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
        stored += packed.numel() * 8 + state.absmax.numel() * state.absmax.element_size() * 8
        lin.weight.data = bnbf.dequantize_4bit(packed, state).to(w.dtype).reshape(w.shape)
    return stored / _numel(targets)


POST_TRAINING = {"coremltools k-means": coreml_kmeans, "HQQ g64": hqq, "GPTQ g64 (llmcompressor)": gptq}
