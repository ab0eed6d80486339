"""What DKM's soft assignment costs per training step (`python benchmarks/dkm_quality.py --only steps`).

One training step (forward and backward, the optimizer left out) of two real models, plain against DKM, variants in
interleaved rounds (`harness.common.Bench`: the order rotated each round, min and median of per-round ratios):

- all-MiniLM-L6-v2: one distillation step of 16 sentences (the teacher's forward included; `--quick`: 4), as
  `dkm_quality.py` trains it; its layers are 384x384 and 1536x384;
- SmolLM2-135M-Instruct (`hf_llmkit.testing.smollm2_path()`, all 30 layers): one language-modelling step of 4
  sequences of 128 tokens; its layers are 576x576, 192x576 (keys, values), 1536x576 and 576x1536, and its tied
  49,152-token embedding stays in float32.

Variants: the plain model in float32; DKM 3 and 4 bits with float32 latent weights (the interval engine: its C
kernel on this CPU), a table per channel, bfloat16 latent weights (the rest of the model in float32; the kernel
counts their bit patterns) and, for MiniLM, the whole model in bfloat16 (the earlier table's rows); the same engines
on torch's ops (`interval_kernel.torch_ops()`: the engines as they were
before the kernel, the bfloat16 rows on the table engine); and `recipe="calibrated"`'s training forward (the hard
assignment with straight-through gradients), all against the plain float32 step. Each row also has the bytes its step
saves for backward (each storage once, parameters left out; DKM's own through its marshaling hooks): the kernel saves
no more than the torch ops did.
"""

from __future__ import annotations

import contextlib

import torch
from harness.common import Bench

from areas.dkm import peers

STEP_BITS = (3, 4)
SMOLLM2_BATCH = (4, 128)  # sequences x tokens of one SmolLM2 step


class SmolLM2Steps:
    """The real SmolLM2-135M-Instruct and one fixed batch of the embedded corpus: a language-modelling step."""

    name = "SmolLM2-135M-Instruct"
    skip = ("lm_head",)
    large = True  # every variant's model is held at once: the rows that answer the issue only

    def __init__(self, quick: bool = False):
        from transformers import AutoTokenizer

        from hf_llmkit.data.corpus import corpus_texts
        from hf_llmkit.testing import smollm2_path

        self.path = smollm2_path(num_hidden_layers=2 if quick else None)
        tok = AutoTokenizer.from_pretrained(self.path)
        rows, length = (2, 32) if quick else SMOLLM2_BATCH
        ids = tok(" ".join(corpus_texts()[:40]), return_tensors="pt")["input_ids"][0]
        self.batch = ids[: rows * length].view(rows, length)

    def load(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    def batches(self, steps: int):
        for _ in range(steps):
            yield self.batch

    def loss(self, model, batch) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss


def _plan(small: bool) -> list[tuple[str, int | None, str | None, dict, bool]]:
    """(label, bits, bf16 ("latent": the DKM layers' latent weights, "model": the whole model; None: float32),
    DKMConfig options, on torch's ops) of every variant. Every variant's model is held at once (interleaved rounds),
    so a large model (`small=False`) gets the rows that answer the issue only; its whole model in bf16 would time this
    CPU's bf16 matrix products of the LM head, not DKM."""
    per_channel = {"granularity": "per_grouped_channel", "group_size": 1}
    calibrated = {"recipe": "calibrated", "calibration": None}  # its training forward: the hard assignment + STE
    plan = [("plain fp32", None, None, {}, False)]
    plan += [(f"DKM {b}-bit fp32", b, None, {}, False) for b in STEP_BITS]
    plan += [("DKM 3-bit fp32, a table per channel", 3, None, per_channel, False)] if small else []
    plan += [(f"DKM {b}-bit bf16", b, "latent", {}, False) for b in STEP_BITS]
    plan += [("DKM 3-bit bf16, the whole model in bf16", 3, "model", {}, False)] if small else []
    plan += [("DKM 3-bit fp32, torch ops (no kernel)", 3, None, {}, True)]
    plan += [("DKM 3-bit fp32, a table per channel, torch ops", 3, None, per_channel, True)] if small else []
    plan += [("DKM 3-bit bf16, torch ops (table engine)", 3, "latent", {}, True)]
    plan += [("DKM 3-bit bf16, the whole model in bf16, torch ops", 3, "model", {}, True)] if small else []
    plan += [("DKM 3-bit fp32, recipe='calibrated'", 3, None, calibrated, False)] if small else []
    return plan


def _context(torch_ops: bool):
    from hf_llmkit.quantization.engines import interval_kernel

    return interval_kernel.torch_ops() if torch_ops else contextlib.nullcontext()


def _saved_bytes(model, step) -> int:
    """Bytes one step saves for backward: each storage once, parameters left out; the DKM layers' own saved tensors
    go through their marshaling hooks (`DKMConfig.offload`), which count them the same way."""
    from hf_llmkit.quantization import DKMLinear
    from hf_llmkit.quantization.marshal import MarshalHooks

    params = tuple(model.parameters())
    with MarshalHooks(offload=False, exclude=params) as meter:
        step(backward=False)
    marshals = [getattr(m, "last_marshal", None) for m in model.modules() if isinstance(m, DKMLinear)]
    inner = sum(m.stored_bytes for m in marshals if m is not None)
    return meter.stats.stored_bytes + inner


def workload_steps(workload, rounds: int, extra_skip=(), quick: bool = False) -> dict:
    """{"summary": Bench's per-variant summary, "saved_mib": {label: MiB}} of one workload."""
    from areas.dkm.helpers import bf16_latent
    from hf_llmkit.quantization import DKMLinear

    variants, saved = {}, {}
    batch = next(iter(workload.batches(1)))
    small = not getattr(workload, "large", False)
    for label, bits, dtype, options, torch_ops in _plan(small):
        if quick and dtype == "model":  # --quick quantizes one layer: the others would time bf16 matrix products
            continue
        model = workload.load()
        if dtype == "model":
            model = model.to(torch.bfloat16)
        if bits is not None:
            peers.dkm(model, bits, workload.skip + tuple(extra_skip), None, **options)
        if dtype == "latent":
            bf16_latent(model, DKMLinear)
        for module in model.modules():  # the teacher runs without dropout; so does every student here
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0

        def step(model=model, torch_ops=torch_ops, backward=True):
            model.train()
            with _context(torch_ops):
                loss = workload.loss(model, batch)
                if backward:
                    loss.backward()
            model.zero_grad(set_to_none=True)

        step()  # the first step initialises what DKM keeps between steps
        saved[label] = _saved_bytes(model, step) / 2**20
        variants[label] = step
    # --quick: no untimed round (the step above initialised each variant; the timings are a smoke test's)
    timings = Bench(rounds=rounds, warmup=0 if quick else 1).run(variants, baseline="plain fp32")
    print(f"\n### One {workload.name} training step, ratio to the plain fp32 step\n\n{timings.table()}")
    return {**timings.to_json(), "saved_mib": saved}


def step_times(args, minilm_cls) -> dict:
    """The steps section: MiniLM and SmolLM2 (`--quick`: MiniLM's one matrix and a 2-layer SmolLM2)."""
    from hf_llmkit.quantization.engines import interval_kernel

    threads = torch.get_num_threads()
    torch.set_num_threads(args.step_threads)
    try:
        built = interval_kernel.library() is not None
        loops = interval_kernel.loops() if built else "none: " + interval_kernel.unavailable_reason()
        out = {"threads": args.step_threads, "kernel_loops": loops, "workloads": {}}
        for workload in (minilm_cls(quick=args.quick), SmolLM2Steps(quick=args.quick)):
            extra = args.extra_skip if workload.name.startswith("all-MiniLM") else ()
            out["workloads"][workload.name] = workload_steps(workload, args.step_rounds, extra, args.quick)
    finally:
        torch.set_num_threads(threads)
    return out
