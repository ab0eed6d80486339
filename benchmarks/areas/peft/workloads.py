"""What benchmarks/peft_methods.py compares: the two workloads (a Llama-shaped causal LM, MiniLM as a masked LM), their
batches, each PEFT method's config (ours and peft's) and a `Runner` that trains one method step by step."""

from __future__ import annotations

import copy
import warnings

import torch
from harness.common import synchronize  # sibling module (the script's folder is on sys.path)

import hf_llmkit
from hf_llmkit.testing import corpus_tokenizer, minilm_path, tiny_llama_config

N_VIRTUAL = 20  # prompt-learning methods: virtual tokens / prefix length
LLAMA_SHAPE = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)


def build_base(kind: str):
    from transformers import BertForMaskedLM, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(tiny_llama_config(vocab_size=len(corpus_tokenizer()), **LLAMA_SHAPE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BertForMaskedLM.from_pretrained(minilm_path())  # the MLM head is new (the package is an encoder)


def token_blocks(tokenizer, texts: list[str], seq: int) -> torch.Tensor:
    ids = [i for t in texts for i in tokenizer(t, add_special_tokens=False)["input_ids"]]
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq]).view(n, seq)


def make_batch(kind: str, blocks: torch.Tensor, mask_id: int | None, seed: int = 0) -> dict:
    ids = blocks.clone()
    labels = ids.clone()
    if kind != "llama":  # masked LM: 15% of positions replaced by [MASK] and predicted
        chosen = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.15
        labels[~chosen] = -100
        ids[chosen] = mask_id
    return {"input_ids": ids, "labels": labels}


def adapt_batch(batch: dict, extra: dict) -> dict:
    """Per-method input changes: P-tuning v1 writes its virtual tokens into the text, PromptEncoder prepends some."""
    batch = dict(batch)
    if "virtual_ids" in extra:  # [P0]..[Pn-1] replace the first n positions (template "[P0]..[Pn-1] {text}")
        ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
        n = len(extra["virtual_ids"])
        ids[:, :n] = torch.tensor(extra["virtual_ids"])
        labels[:, :n] = -100
        batch.update(input_ids=ids, labels=labels)
    if extra.get("prepends"):  # same total length as everyone else
        n = extra["prepends"]
        batch = {k: v[:, n:] for k, v in batch.items()}
        if extra.get("pad_labels"):  # peft pads causal-LM labels itself, not others
            batch["labels"] = torch.cat([torch.full_like(batch["labels"][:, :n], -100), batch["labels"]], dim=1)
    return batch


class Runner:
    """One method's model, optimizer and batch; `step()` is one timed training step."""

    def __init__(self, model, batch: dict, lr: float, device: torch.device) -> None:
        model.to(device)
        self.model, self.batch, self.device = model, {k: v.to(device) for k, v in batch.items()}, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.trainable = sum(p.numel() for p in self.params)
        self.total = sum(p.numel() for p in model.parameters())
        model.train()

    def step(self) -> float:
        loss = self.model(**self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def memory_mib(self) -> float:
        if self.device.type == "cuda":  # the whole step's allocator peak: parameters, activations, grads, Adam state
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.step()
            synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.step()
        state = 3 * 4 * self.trainable  # fp32 grad + Adam's two moments
        return (sum(saved.values()) + state) / 2**20


def method_configs(kind: str) -> dict:
    """name -> factory returning (peft config, input changes) for one workload ("llama" or "bert")."""
    from peft import BeftConfig, LoraConfig, PrefixTuningConfig, PromptEncoderConfig

    llama = kind == "llama"
    task = {"task_type": "CAUSAL_LM"} if llama else {}
    # peft has no masked-LM task type; its prompt-learning models run BERT as FEATURE_EXTRACTION
    prompt_task = task or {"task_type": "FEATURE_EXTRACTION"}
    attention = (
        ["q_proj", "k_proj", "v_proj", "o_proj"] if llama else ["query", "key", "value", "attention.output.dense"]
    )
    bottleneck = dict(reduction_factor=16, non_linearity="relu")
    methods = {
        "bottleneck houlsby": lambda: (hf_llmkit.BottleneckConfig(placement="houlsby", **bottleneck), {}),
        "bottleneck pfeiffer": lambda: (hf_llmkit.BottleneckConfig(placement="pfeiffer", **bottleneck), {}),
        "bottleneck parallel": lambda: (hf_llmkit.BottleneckConfig(placement="parallel", **bottleneck), {}),
        "bitfit": lambda: (hf_llmkit.BitFitConfig(add_missing_biases=llama), {}),
    }
    if hasattr(hf_llmkit, "PTuningConfig"):  # the P-tuning methods land separately; the benchmark runs without
        methods["ptuning v1"] = lambda: _ptuning_v1(kind)
    if hasattr(hf_llmkit, "PTuningV2Config"):
        methods["ptuning v2"] = lambda: (hf_llmkit.PTuningV2Config(num_virtual_tokens=N_VIRTUAL), {})
    methods.update(
        {
            "peft LoRA r=8 (attention)": lambda: (
                LoraConfig(r=8, lora_alpha=16, target_modules=attention, **task),
                {},
            ),
            "peft PrefixTuning": lambda: (PrefixTuningConfig(num_virtual_tokens=N_VIRTUAL, **prompt_task), {}),
            "peft PromptEncoder": lambda: (
                PromptEncoderConfig(num_virtual_tokens=N_VIRTUAL, encoder_hidden_size=128, **prompt_task),
                {"prepends": N_VIRTUAL, "pad_labels": not llama},
            ),
            "peft BEFT": lambda: (BeftConfig(**task), {}),
        }
    )
    return methods


def _ptuning_v1(kind: str):
    from transformers import AutoTokenizer

    config = hf_llmkit.PTuningConfig(
        num_virtual_tokens=N_VIRTUAL, template=hf_llmkit.build_ptuning_template(N_VIRTUAL, "{text}")
    )
    tokenizer = corpus_tokenizer() if kind == "llama" else AutoTokenizer.from_pretrained(minilm_path())
    template = hf_llmkit.PTuningTemplate(tokenizer, config)
    return config, {"virtual_ids": template.virtual_token_ids}


def quality_lr(name: str) -> float:
    if name == "full fine-tuning":
        return 5e-5
    # one rate for all weight-space methods, one for the prompt-space ones (their inputs start far from useful)
    return 1e-2 if any(k in name for k in ("Prefix", "Prompt", "ptuning")) else 2e-3


def build_runners(kind: str, batch: dict, device: torch.device) -> tuple[dict, dict]:
    from peft import get_peft_model

    base = build_base(kind)
    runners = {"full fine-tuning": Runner(copy.deepcopy(base), batch, 1e-5, device)}
    skipped = {}
    for name, make in method_configs(kind).items():
        try:
            config, changes = make()
            model = get_peft_model(copy.deepcopy(base), config)
            runner = Runner(model, adapt_batch(batch, changes), quality_lr(name), device)
            runner.step()  # fails here, not mid-timing, if the method cannot run this model
            runners[name] = runner
        except Exception as err:  # a peer method that cannot run a workload is reported, not fatal
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"
    return runners, skipped
