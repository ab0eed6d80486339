"""The composition matrix as data: every pair of features tested together, how it is built, and what must happen.

One `Cell` per pair. `Setup` says how to build it (the features it switches on); `expected` is "ok" (train, save,
reload, match the single-rank equivalent) or the one-line reason the library gives when it refuses the pair before
any work. `make test` (CI) runs every cell; `make test-fast` leaves out the `slow` ones (one representative per
row stays).
README's "Composition" table is generated from `CELLS` (`python -m tests.composition.readme_table`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_llmkit.tuners import PEFT_METHODS as REGISTRY  # the methods and their display names: one registry

PEFT_METHODS = tuple(REGISTRY)


@dataclass(frozen=True)
class Setup:
    """The features one cell switches on (everything else off).

    peft: a PEFT method of `PEFT_METHODS` (None = train the model itself); moe: upcycle to 4 experts, top-2;
    dkm: DKM 3-bit QAT on the Linear layers; dkm_shard: eDKM's table sharded over the data-parallel ranks;
    bnb4: load the base in bitsandbytes NF4; sp / ep: sequence / expert parallel size; zero: DeepSpeed ZeRO stage
    (0 = none); gc: gradient checkpointing; dkm_engine: the DKM engine ("" = the one DKM picks itself);
    precision: "bf16" / "fp16" autocast ("" = fp32); trl: train with TRL's `SFTTrainer` (its defaults: bf16
    autocast, its fused LM-head loss) and our callbacks instead of `LLMKitTrainer`; fsdp: accelerate FSDP2.
    """

    peft: str | None = None
    moe: bool = False
    dkm: bool = False
    dkm_shard: bool = False
    bnb4: bool = False
    sp: int = 1
    ep: int = 1
    zero: int = 0
    gc: bool = False
    dkm_engine: str = ""
    precision: str = ""
    trl: bool = False
    fsdp: bool = False

    @property
    def ranks(self) -> int:
        """Gloo ranks the cell runs on: 2 for sequence / expert parallelism, a sharded eDKM table, ZeRO and FSDP2."""
        return 2 if self.sp > 1 or self.ep > 1 or self.dkm_shard or self.zero or self.fsdp else 1

    @property
    def autocast_dtype(self) -> str:
        """The autocast dtype the cell trains under: its `precision`, TRL's default bf16, or "" (fp32)."""
        return self.precision or ("bf16" if self.trl else "")

    @property
    def data_parallel(self) -> int:
        return self.ranks // self.sp

    def single_rank(self) -> Setup:
        """The single-rank equivalent: the same model without the features that only split the work."""
        return replace(self, sp=1, ep=1, zero=0, gc=False, dkm_shard=False, fsdp=False)


# Partners by name: how each switches its feature on.
PARTNERS: dict[str, dict] = {
    "sp2": {"sp": 2},
    "moe": {"moe": True},
    "dkm": {"dkm": True},
    "zero2": {"zero": 2},
    "zero3": {"zero": 3},
    "bnb4": {"bnb4": True},
    "gc": {"gc": True},
    "ep2": {"ep": 2},
    "shard2": {"dkm_shard": True},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "trl": {"trl": True},
    "fsdp2": {"fsdp": True},
}
PARTNER_TITLES = {
    "sp2": "sequence parallel 2",
    "moe": "upcycled MoE",
    "dkm": "DKM QAT",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "bnb4": "bnb 4-bit base",
    "gc": "gradient checkpointing",
    "ep2": "expert parallel 2",
    "shard2": "`shard` on 2 ranks",
    "bf16": "bf16 autocast",
    "fp16": "fp16 autocast + GradScaler",
    "trl": "TRL `SFTTrainer` + our callbacks",
    "fsdp2": "FSDP2 (2 ranks)",
}
FEATURE_TITLES = {
    **{name: method.display_name for name, method in REGISTRY.items()},
    "moe": "MoE",
    "dkm": "DKM",
    "dkm_naive": "DKM, naive engine",
    "dkm_table": "DKM, table engine",
    "sp2": "sequence parallel 2",
}


@dataclass(frozen=True)
class Cell:
    """One pair: `feature` x `partner`, built as `setup`; `expected` is "ok" or the refusal's one-line reason."""

    feature: str
    partner: str
    setup: Setup
    expected: str = "ok"
    slow: bool = True
    match: str = ""  # for a refused pair: what the library's ValueError says

    @property
    def name(self) -> str:
        return f"{self.feature}-x-{self.partner}"


def _feature_setup(feature: str) -> dict:
    if feature in PEFT_METHODS:
        return {"peft": feature}
    if feature.startswith("dkm_"):  # DKM with one engine forced (the "dkm" row: the engine DKM picks)
        return {"dkm": True, "dkm_engine": feature[len("dkm_") :]}
    if feature == "sp2":
        return {"sp": 2}
    return {feature: True}


def _cell(feature: str, partner: str, *, slow: bool = True) -> Cell:
    setup = Setup(**{**_feature_setup(feature), **PARTNERS[partner]})
    if setup.dkm_shard:
        setup = replace(setup, dkm=True)
    expected, match = REFUSED.get((feature, partner), ("ok", ""))
    expected = KNOWN_BUGS.get((feature, partner), expected)
    return Cell(feature, partner, setup, expected, slow, match)


# Pairs the library refuses before any work: (the reason, for README; what its ValueError says).
REFUSED: dict[tuple[str, str], tuple[str, str]] = {
    ("dkm", "bnb4"): (
        "refused: DKM clusters full-precision weights; load the base unquantized",
        "DKM cannot cluster a model whose weights are already quantized by bitsandbytes",
    ),
}
REFUSED[("moe", "bnb4")] = (
    "refused: experts copy full-precision MLPs; upcycle before quantizing",
    "upcycle_to_moe needs a full-precision dense model, this one is quantized (bitsandbytes)",
)
# Pairs that should work and do not yet, with the bug (README shows it; the test is an expected failure that is not
# run: the failure leaves the other rank waiting in a collective until the launch times out).
KNOWN_BUGS: dict[tuple[str, str], str] = {}
# One representative per row runs in `make test` (one 2-rank launch serves all three).
QUICK = {("lora", "sp2"), ("moe", "ep2"), ("dkm", "shard2")}


def _row(feature: str, partners: tuple[str, ...]) -> list[Cell]:
    return [_cell(feature, p, slow=(feature, p) not in QUICK) for p in partners]


# Where users already train (issue 19): mixed precision, TRL's SFTTrainer, accelerate FSDP2.
AMP = ("bf16", "fp16")
CLIENTS = ("trl", "fsdp2")
PEFT_PARTNERS = ("sp2", "moe", "dkm", "zero2", "zero3", "bnb4", "gc", *AMP, *CLIENTS)
MOE_PARTNERS = ("sp2", "ep2", "zero2", "zero3", "dkm", "bnb4", *AMP, *CLIENTS)
DKM_PARTNERS = ("zero2", "zero3", "shard2", "sp2", "bnb4", *AMP, *CLIENTS)
DKM_ENGINES = ("naive", "table")  # the "dkm" row runs the engine DKM picks for fp32 scalar weights ("bucketed")

CELLS: list[Cell] = [
    *(cell for method in PEFT_METHODS for cell in _row(method, PEFT_PARTNERS)),
    *_row("moe", MOE_PARTNERS),
    *_row("dkm", DKM_PARTNERS),
    *(cell for engine in DKM_ENGINES for cell in _row(f"dkm_{engine}", AMP)),
    *_row("sp2", AMP),
]

# Fault tolerance x one configuration from each row: the main job (examples/run_clm.py) killed after its first
# checkpoint and re-run must end with the same final artifacts (tests/callbacks/clm_kill_harness.py).
FAULT_TOLERANCE: dict[str, dict] = {
    "lora-x-gc": {"flags": ["--peft_method", "lora", "--lora_rank", "4", "--gradient_checkpointing", "true"]},
    "moe-x-ep2": {
        "flags": ["--upcycle_moe", "true", "--moe_num_experts", "4", "--expert_parallel_size", "2"],
        "ranks": 2,
    },
    "dkm-x-zero2": {
        "flags": ["--quantization", "dkm", "--dkm_bits", "3", "--deepspeed", "examples/ds_zero2_no_offload.json"],
        "ranks": 2,
    },
}


def cell(name: str) -> Cell:
    """The cell called `name` (e.g. "lora-x-sp2")."""
    for c in CELLS:
        if c.name == name:
            return c
    raise KeyError(name)
