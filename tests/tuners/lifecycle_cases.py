"""The case table of the PEFT lifecycle battery (tests/tuners/test_lifecycle.py): model families x methods.

A row per method we ship (bottleneck in each placement, BitFit with existing and with added biases, P-tuning v1 and
v2) plus peft's LoRA as the reference that defines the expected behaviour; three model families: a tiny Llama, the
real all-MiniLM-L6-v2 as a BERT encoder, and a plain MLP of `nn.Linear`s. A cell that makes no sense for a method is
not skipped silently: the library refuses it in one line (`Method.refused`, checked by the battery) or the table
states why it does not run (`Method.skipped`). The support table in docs/peft.md is generated from this file
(tests/tuners/lifecycle_table.py), so it says what the battery proves.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import LoraConfig
from torch import nn

from hf_llmkit import BitFitConfig, BottleneckConfig, PTuningConfig, PTuningV2Config
from hf_llmkit.testing import minilm_path, tiny_llama

VIRTUAL = 3  # P-tuning virtual tokens / P-tuning v2 prefix length


class MLP(nn.Module):
    """A plain MLP of nn.Linear layers; `lin2` (the head) has no bias, so BitFit can add one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.lin1 = nn.Linear(20, 20)
        self.lin2 = nn.Linear(20, 4, bias=False)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.relu(self.lin1(self.relu(self.lin0(X)))))


@functools.cache
def _pristine(family: str, tied: bool) -> nn.Module:
    if family == "llama":
        return tiny_llama(tie_word_embeddings=tied)
    if family == "minilm":
        from transformers import AutoModel

        return AutoModel.from_pretrained(minilm_path()).eval()
    torch.manual_seed(0)
    return MLP().eval()


def make_model(family: str, tied: bool = False) -> nn.Module:
    """A fresh copy of the family's base model (fp32, eval mode; built or loaded once per process)."""
    return copy.deepcopy(_pristine(family, tied))


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    vocab: int | None  # token ids (P-tuning v1's virtual ids start here); None: the model takes features
    one_module: str  # the modules_to_save cell with one module
    seed: bool = False  # has `embed_tokens` and `lm_head`: the seed recipe's modules_to_save applies
    checkpointing: bool = True  # has transformers' activation checkpointing

    def inputs(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        if self.vocab is None:
            return {"X": torch.randn(4, 10, generator=g)}
        low = 1000 if self.name == "minilm" else 3  # ordinary word pieces of MiniLM's vocabulary
        ids = torch.randint(low, low + 400, (2, 10), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


FAMILIES = {
    "llama": Family("llama", "tiny Llama", vocab=512, one_module="lm_head", seed=True),
    "minilm": Family("minilm", "MiniLM (BERT)", vocab=30522, one_module="pooler"),
    "mlp": Family("mlp", "MLP", vocab=None, one_module="lin2", checkpointing=False),
}
NO_CHECKPOINTING = "a plain nn.Module has no activation checkpointing to switch on; fp16 / bf16 run without it"


@dataclass(frozen=True)
class Method:
    """A row: how to configure the method per family, and where it refuses (each refusal is a one-line error)."""

    name: str
    title: str
    build: Callable[..., Any]  # (family, slot, init, **peft kwargs) -> config; slot k = the k-th adapter
    merge_error: str | None = None  # None: merges exactly; else the ValueError's text (a regex)
    identity_at_init: bool = True  # init_weights=True gives the base model's outputs
    refused: dict[str, str] = field(default_factory=dict)  # family -> what get_peft_model says (a regex)
    skipped: dict[str, str] = field(default_factory=dict)  # family -> why the cell does not run
    embedding_saved: str | None = None  # what it says when `embed_tokens` is in modules_to_save (a regex)
    overlap: str | None = None  # what add_adapter says when two adapters cannot coexist (a regex)
    reference: bool = False  # peft's own method (the expected behaviour), not ours

    def config(self, family: str, *, slot: int = 0, init: bool = False, **kwargs: Any) -> Any:
        return self.build(FAMILIES[family], slot, init, **kwargs)

    def inputs(self, family: str, slot: int = 0) -> dict[str, torch.Tensor]:
        """The family's inputs; P-tuning v1's start with the virtual tokens of adapter `slot`."""
        inputs = FAMILIES[family].inputs()
        if self.name == "ptuning":
            start = FAMILIES[family].vocab + VIRTUAL * slot
            inputs["input_ids"][:, :VIRTUAL] = torch.arange(start, start + VIRTUAL)
        return inputs


def _bottleneck(placement: str) -> Callable[..., Any]:
    def build(family: Family, slot: int, init: bool, **kwargs: Any) -> Any:
        targets = {"target_modules": ["lin1"]} if family.name == "mlp" else {}
        return BottleneckConfig(placement=placement, bottleneck_size=8, init_weights=init, **targets, **kwargs)

    return build


def _bitfit(add_missing: bool) -> Callable[..., Any]:
    def build(family: Family, slot: int, init: bool, **kwargs: Any) -> Any:
        return BitFitConfig(add_missing_biases=add_missing, init_weights=init, **kwargs)

    return build


def _ptuning(family: Family, slot: int, init: bool, **kwargs: Any) -> Any:
    start = None if slot == 0 else family.vocab + VIRTUAL * slot  # slot 0: the default, the vocabulary size
    return PTuningConfig(num_virtual_tokens=VIRTUAL, virtual_token_start_id=start, **kwargs)


def _ptuning_v2(family: Family, slot: int, init: bool, **kwargs: Any) -> Any:
    return PTuningV2Config(num_virtual_tokens=VIRTUAL, prefix_projection=True, **kwargs)


_LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "minilm": ["query", "value"], "mlp": ["lin0", "lin1"]}


def _lora(family: Family, slot: int, init: bool, **kwargs: Any) -> Any:
    return LoraConfig(r=4, target_modules=_LORA_TARGETS[family.name], init_lora_weights=init, **kwargs)


BOTTLENECK_MERGE = r"^Bottleneck adapters cannot be merged.*unload\(\)"
PTUNING_MERGE = r"^P-tuning .*cannot merge\. Use `model\.unload\(\)`"
NO_EMBEDDING = r"^P-tuning v1 embeds virtual token ids, and MLP has no input embedding"
NO_ATTENTION = r"^P-tuning v2 prepends keys/values inside attention, and MLP has no transformers attention module"

METHODS = {
    m.name: m
    for m in (
        Method("houlsby", "Bottleneck, Houlsby", _bottleneck("houlsby"), merge_error=BOTTLENECK_MERGE),
        Method("pfeiffer", "Bottleneck, Pfeiffer", _bottleneck("pfeiffer"), merge_error=BOTTLENECK_MERGE),
        Method("parallel", "Bottleneck, parallel", _bottleneck("parallel"), merge_error=BOTTLENECK_MERGE),
        Method(
            "bitfit",
            "BitFit, existing biases",
            _bitfit(False),
            refused={"llama": r"^BitFit found no module with a bias; set add_missing_biases=True"},
        ),
        Method(
            "bitfit_added",
            "BitFit, added biases",
            _bitfit(True),
            skipped={"minilm": "BERT has every bias already: the same cells as BitFit with existing biases"},
        ),
        Method(
            "ptuning",
            "P-tuning v1",
            _ptuning,
            merge_error=PTUNING_MERGE,
            identity_at_init=False,
            refused={"mlp": NO_EMBEDDING},
            embedding_saved=r"^P-tuning v1 wraps the input embedding 'model\.embed_tokens'.*remove 'embed_tokens' "
            r"from modules_to_save",
            overlap=r"^virtual token ids .* overlap those of adapter 'default' .*; give each adapter its own tokens",
        ),
        Method(
            "ptuning_v2",
            "P-tuning v2",
            _ptuning_v2,
            merge_error=PTUNING_MERGE,
            identity_at_init=False,
            refused={"mlp": NO_ATTENTION},
        ),
        Method("lora", "LoRA (peft, reference)", _lora, reference=True),
    )
}


@dataclass(frozen=True)
class Case:
    family: str
    method: str

    @property
    def id(self) -> str:
        return f"{self.family}-{self.method}"

    @property
    def refusal(self) -> str | None:
        return METHODS[self.method].refused.get(self.family)

    @property
    def skip_reason(self) -> str | None:
        return METHODS[self.method].skipped.get(self.family)

    @property
    def runs(self) -> bool:
        return self.refusal is None and self.skip_reason is None


CASES = [Case(family, method) for family in FAMILIES for method in METHODS]
RUNS = [case for case in CASES if case.runs]


@dataclass(frozen=True)
class SavedModules:
    """A `modules_to_save` cell: the entries and the base model they go with."""

    name: str
    entries: tuple[str, ...]
    tied: bool = False  # the base ties its input and output embeddings (then with ensure_weight_tying=True)


def saved_modules(family: str) -> list[SavedModules]:
    """The family's modules_to_save cells: one module; the seed recipe's two, untied and tied, where they exist."""
    spec = FAMILIES[family]
    cells = [SavedModules("one", (spec.one_module,))]
    if spec.seed:
        cells.append(SavedModules("seed", ("embed_tokens", "lm_head")))
        cells.append(SavedModules("seed_tied", ("embed_tokens", "lm_head"), tied=True))
    return cells
