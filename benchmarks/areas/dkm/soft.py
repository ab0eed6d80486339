"""Soft assignment or straight-through: DKM training from the calibrated start (`--only soft`, issue 43 part 2).

`DKMConfig(recipe="calibrated")` starts training from the best post-training state (block scales per 64 inputs,
tables refit to the output error, GPTQ-rounded latent weights) and trains with the hard assignment and
straight-through gradients. The paper's algorithm trains with DKM's soft assignment instead (each weight a blend of
the table's entries by its attention over them). Here both start from the same calibrated model, with the same
distillation batches, steps and optimizer, and are evaluated as they are saved (the hard assignment):

- straight-through (the recipe's training, `training_forward="auto"`);
- soft over the start's tables and scales (`training_forward="soft"`), at the default temperature, a colder and a
  warmer one, annealed from warm to cold over the steps, and with the latent weights at a tenth of the rate.

The paper's own training from this start (block scales recomputed from the latent weights, DKM's unweighted centroid
iterations) is no variant any more: no training forward moves a calibrated start (issue 50), the scales are kept and
the iterations weigh every weight by the importance `calibrate` kept (unweighted, they took SmolLM2 from KL 0.645 to
3.06 in one forward); a variant with those weighted iterations is issue 50's study, not measured here yet.

Why one wins is measured at the start and after training: the share of weights the soft assignment blends at its
temperature (largest attention under 0.99: the only weights whose soft gradient is not near zero), the distillation
loss of the soft model against the saved (hard) one on a training batch (how far the model soft training optimises is
from the one it saves), the share of weights whose latent gradient is at least a thousandth of its layer's largest,
and after training the share of weights whose entry changed and how far the tables moved.

Workloads: all-MiniLM-L6-v2 (`areas.dkm.workloads.MiniLM`, its metrics) and SmolLM2-135M-Instruct (the real model,
`smollm2_path()`; `--soft-layers N` a slice of its first N layers for iteration): KL divergence of the next-token
distribution from the source model's, perplexity and top-1 agreement on held-out blocks of the corpus's last texts,
which neither calibration nor training sees. Results: `benchmarks/results/dkm_soft.json`, section "study".
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from harness.common import RESULTS, run_record, write_results

from areas.dkm.smollm2 import distillation_loss
from areas.dkm.soft_report import STRAIGHT

SOFT = "soft, tables and scales kept"
VARIANTS = {  # name -> (DKMConfig changes, temperature schedule (first, last) or None)
    STRAIGHT: ({}, None),
    SOFT: ({"training_forward": "soft"}, None),
    "soft, temperature 0.005": ({"training_forward": "soft", "temperature": 0.005}, None),
    "soft, temperature 0.1": ({"training_forward": "soft", "temperature": 0.1}, None),
    "soft, temperature 0.1 -> 0.002 (annealed)": ({"training_forward": "soft"}, (0.1, 0.002)),
    "soft, latent weights at a tenth of the rate": ({"training_forward": "soft", "latent_lr_scale": 0.1}, None),
}
BLENDED = 0.99  # a weight is blended when its largest attention is below this


def add_arguments(parser) -> None:
    parser.add_argument("--soft-bits", type=int, nargs="*", default=[2, 3], help="the study's widths")
    parser.add_argument("--soft-steps", type=int, default=None, help="the study's training steps (default --steps)")
    parser.add_argument("--soft-workloads", nargs="*", default=None, choices=["minilm", "smollm2"],
                        help="the study's models (default: both; --quick: minilm)")  # fmt: skip
    parser.add_argument("--soft-layers", type=int, default=None, help="a slice of SmolLM2's first N layers")
    parser.add_argument("--soft-variants", nargs="*", default=None, help="only these variants (names or indices)")


def _earlier() -> dict:
    path = RESULTS / "dkm_soft.json"
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    earlier.pop("recorded", None)
    return earlier


def save_section(name: str, data: dict) -> None:
    """Write `data` as section `name` of `benchmarks/results/dkm_soft.json`, keeping the other sections."""
    write_results("dkm_soft", {**_earlier(), name: {**data, "measured": run_record()}})


def merged_rows(workload: str, rows: list[dict]) -> list[dict]:
    """`rows` with the earlier study's rows of `workload` that this run did not measure (another width or variant,
    a run of its own), in width order."""
    earlier = _earlier().get("study", {}).get("workloads", {}).get(workload, {}).get("rows", [])
    done = {(r["bits"], r["variant"]) for r in rows}
    kept = [r for r in earlier if (r["bits"], r["variant"]) not in done]
    return sorted(kept + rows, key=lambda r: r["bits"])  # stable: each width's rows in their order


# -- the SmolLM2 workload --------------------------------------------------------------------------------------------


class SmolLM2Study:
    """SmolLM2-135M-Instruct: distillation on the corpus's first texts, metrics on held-out blocks of its last."""

    name = "SmolLM2-135M-Instruct"
    skip = ("lm_head",)  # the tied embedding stays
    metrics = ("kl", "ppl", "top1")

    def __init__(self, layers: int | None = None, blocks: int = 8, block: int = 512, quick: bool = False):
        from transformers import AutoTokenizer

        from hf_llmkit.testing import corpus_texts, smollm2_path

        self.path = smollm2_path(num_hidden_layers=2 if quick else layers)
        tok = AutoTokenizer.from_pretrained(self.path)
        blocks, block = (2, 64) if quick else (blocks, block)
        texts, held, counted = corpus_texts(), len(corpus_texts()), 0
        while counted < (blocks + 1) * block:  # whole texts from the end
            held -= 1
            counted += len(tok(texts[held])["input_ids"]) + 1
        self.eval_ids = torch.tensor(tok("\n\n".join(texts[held:]))["input_ids"][: blocks * block]).view(blocks, -1)
        self.train_ids = torch.tensor(tok("\n\n".join(texts[:held]))["input_ids"])
        self.held_out = {"texts": len(texts) - held, "tokens": blocks * block}
        self.teacher = self.load().eval()

    def load(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    def calibration(self, n: int = 128, tokens: int = 256) -> dict:
        ids = self.train_ids[: n * tokens].view(n, tokens)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def batches(self, steps: int, size: int = 4, tokens: int = 128):
        gen = torch.Generator().manual_seed(0)
        for _ in range(steps):
            starts = torch.randint(len(self.train_ids) - tokens, (size,), generator=gen).tolist()
            yield torch.stack([self.train_ids[s : s + tokens] for s in starts])

    def loss(self, model, batch) -> torch.Tensor:
        return distillation_loss(self.teacher, model, batch)

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        model.eval()
        kls, losses, agree = [], [], []
        for ids in self.eval_ids:
            lp = F.log_softmax(self.teacher(input_ids=ids[None]).logits[0, :-1].float(), -1)
            lq = F.log_softmax(model(input_ids=ids[None]).logits[0, :-1].float(), -1)
            kls.append((lp.exp() * (lp - lq)).sum(-1).mean())
            losses.append(-lq.gather(1, ids[1:, None]).mean())
            agree.append((lq.argmax(-1) == lp.argmax(-1)).float().mean())
        return {"kl": torch.stack(kls).mean().item(), "ppl": math.exp(torch.stack(losses).mean().item()),
                "top1": torch.stack(agree).mean().item()}  # fmt: skip


# -- the calibrated start and the variants ---------------------------------------------------------------------------


def _layers(model) -> list:
    from hf_llmkit.quantization import DKMLinear

    return [m for m in model.modules() if isinstance(m, DKMLinear)]


def calibrated_start(workload, bits: int, skip, samples: int = 128):
    """The model `recipe="calibrated"` trains from: quantized, refit and GPTQ-rounded on `samples` calibration
    inputs."""
    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import calibrate, keep_training_state, quantize_model

    config = DKMConfig(bits=bits, recipe="calibrated", modules_to_not_convert=list(skip))
    model = quantize_model(workload.load(), config)
    keep_training_state(model, False)  # this loop saves no checkpoints
    calibrate(model, [workload.calibration(samples)])
    return model


def reconfigure(model, **changes):
    """Every DKM layer of `model` takes its config with `changes` (checked by `DKMConfig` itself); returns it."""
    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import DKMSettings

    layers = _layers(model)
    config = DKMConfig(**{**layers[0].settings.config.to_dict(), "calibration_samples": 0, **changes})
    for layer in layers:
        layer.settings = DKMSettings.from_config(config, "linear", layer.weight.shape[0])
        layer.dkm_step = None
    return config


@torch.no_grad()
def blended_share(model, temperature: float) -> float:
    """The share of weights whose largest attention over their table is below `BLENDED` at `temperature` (in units
    of the normalised weights' standard deviation, as DKM's): the weights the soft assignment blends."""
    blended = total = 0
    for layer in _layers(model):
        scales = layer.lookup_scales()
        v = layer._normalized(layer.weight.detach(), scales).reshape(layer.settings.groups, -1).float()
        table = layer.lookup_table()[..., 0]
        tau = temperature * v.std(1, unbiased=False).clamp_min(1e-12)
        for part in v.split(1 << 16, dim=1):
            attn = torch.softmax(-(part.unsqueeze(-1) - table.unsqueeze(1)).abs() / tau.view(-1, 1, 1), -1)
            blended += int((attn.amax(-1) < BLENDED).sum())
        total += v.numel()
    return blended / total


def _loss(workload, model, batch, backward: bool = False) -> float:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.train()
    loss = workload.loss(model, batch)
    if backward:
        loss.backward()
    return loss.item()


def gradient_share(workload, model, batch) -> float:
    """The share of latent weights whose gradient on `batch` is at least a thousandth of their layer's largest."""
    model.zero_grad(set_to_none=True)
    _loss(workload, model, batch, backward=True)
    hit = total = 0
    for layer in _layers(model):
        g = layer.weight.grad.abs()
        hit += int((g >= 1e-3 * g.max()).sum())
        total += g.numel()
    model.zero_grad(set_to_none=True)
    return hit / total


def _indices(model) -> list[torch.Tensor]:
    return [layer.hard_indices().clone() for layer in _layers(model)]


def _tables(model) -> list[torch.Tensor]:
    return [layer.lookup_table().clone() for layer in _layers(model)]


def run_variant(workload, start, name: str, steps: int, lr: float, batch) -> dict:
    from areas.dkm.workloads import make_trainer

    changes, schedule = VARIANTS[name]
    model = copy.deepcopy(start)
    config = reconfigure(model, **changes)
    row = {"variant": name, "changes": changes, "schedule": schedule}
    if schedule is not None:
        config.temperature = schedule[0]
    if config.straight_through is False:
        row["blended_at_start"] = blended_share(model, config.temperature)
    row["loss_at_start"] = _loss(workload, model, batch)  # the objective training starts from (moving nothing)
    row["gradient_share_at_start"] = gradient_share(workload, model, batch)
    done = [0]

    def anneal():
        done[0] += 1
        if schedule is not None:
            first, last = schedule
            config.temperature = first * (last / first) ** (done[0] / max(steps - 1, 1))

    before_idx, before_tab = _indices(model), _tables(model)
    began = time.perf_counter()
    make_trainer(workload, steps, lr)(model, step_hook=anneal)
    row["train_s"] = time.perf_counter() - began
    after_idx = _indices(model)
    row["changed_entries"] = sum(int((a != b).sum()) for a, b in zip(after_idx, before_idx)) / sum(
        a.numel() for a in after_idx
    )
    row["table_moved"] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(_tables(model), before_tab))
    row.update(workload.evaluate(model))
    return row


def _selected(args) -> list[str]:
    names = list(VARIANTS)
    if args.quick and not args.soft_variants:  # --quick: the two the verdict compares
        return [STRAIGHT, SOFT]
    if not args.soft_variants:
        return names
    return [names[int(v)] if v.isdigit() else v for v in args.soft_variants]


def study(args) -> dict:
    """The study: for each workload and width, the calibrated start, then every variant from a copy of it."""
    from areas.dkm.workloads import MiniLM

    steps = args.soft_steps or args.steps
    out = {"steps": steps, "lr": args.lr, "variants": _selected(args), "workloads": {}}
    for kind in args.soft_workloads or (["minilm"] if args.quick else ["minilm", "smollm2"]):
        if kind == "minilm":
            workload = MiniLM(quick=args.quick)
        else:
            workload = SmolLM2Study(layers=args.soft_layers, quick=args.quick)
        skip = workload.skip + (args.extra_skip if kind == "minilm" else ())
        batch = next(iter(workload.batches(1)))
        rows = []
        for bits in args.soft_bits[:1] if args.quick else args.soft_bits:
            began = time.perf_counter()
            start = calibrated_start(workload, bits, skip, 16 if args.quick else 128)  # --quick: dkm_quality's 16
            rows.append({"variant": "calibrated start, no training", "bits": bits,
                         "calibrate_s": time.perf_counter() - began, **workload.evaluate(start)})  # fmt: skip
            for temperature in (0.005, 0.02, 0.1):
                rows[-1][f"blended_at_{temperature:g}"] = blended_share(start, temperature)
            print(f"  soft study, {workload.name} {bits}-bit: {rows[-1]}", file=sys.stderr, flush=True)
            for name in out["variants"]:
                rows.append({"bits": bits, **run_variant(workload, start, name, steps, args.lr, batch)})
                shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in rows[-1].items()}
                print(f"  soft study, {workload.name}: {shown}", file=sys.stderr, flush=True)
            del start
        name = workload.name + (f" (first {args.soft_layers} layers)" if args.soft_layers and kind != "minilm" else "")
        held = workload.held_out
        held = {"sentences": len(held)} if isinstance(held, list) else held
        out["workloads"][name] = {"metrics": list(workload.metrics), "rows": merged_rows(name, rows),
                                  "held_out": held, "steps": steps, "lr": args.lr}  # fmt: skip
        save_section("study", _with_earlier(out))  # a finished workload is kept at once
    return _with_earlier(out)


def _with_earlier(out: dict) -> dict:
    """`out` with the workloads of the results file that this run did not measure (read now: another run of the
    section may have written since this one began)."""
    earlier = _earlier().get("study", {}).get("workloads", {})
    return {**out, "workloads": {**earlier, **out["workloads"]}}
