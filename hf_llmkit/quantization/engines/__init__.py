"""DKM's soft assignment behind one interface: four engines compute the same function, chosen in one place.

Every engine is a module with

    run(x, weight, centroids, settings, group) -> (x @ W_c^T, or W_c when x is None;  refined centroids [G, K, d])

where `W_c = A(W) C` is DKM's soft-clustered weight after `dkm_iters` differentiable k-means steps, differentiable in
`weight` and `x`; the engines in `WEIGHING` also take `importance=` (`_dkm.Importance`), which weighs each weight in
those steps (`C <- A^T H W / A^T H 1`), as `calibrate` counts its share of the output error. They differ only in
cost (tests/quantization/test_engines.py checks each against naive DKM in float64):

- "naive" (`naive.py`): autograd through `[n, K]` attention maps, O(|W| K) memory; the reference.
- "table" (`table.py`): eDKM's table of unique weight values (16-bit weights hold at most 65,536), optionally
  sharded across data-parallel ranks; also vectors (`cluster_dim > 1`) and, without uniquification, 32-bit weights.
- "interval" (`interval.py`): scalar weights in closed form between sorted centroids, O(|W|) work whatever the
  number of tables (a table per channel costs about what one per tensor does); saves a byte per weight per step.
- "bucketed" (`bucketed.py`, `_buckets.py`, `_grid.py`, `_jets.py`): 32-bit scalar weights in O(|W|) work, with
  nothing weight-sized saved for backward (its buckets compress one large table, not many small ones).

`DKMConfig(engine=...)` pins one; "auto" (the default) is `resolve`'s rule, the only place an engine is chosen.
"""

from __future__ import annotations

import torch

from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization.engines import bucketed, interval, interval_kernel, naive, table

# weights per table from which "auto" takes the bucketed engine: one 4096x4096 table steps about 2x faster there than
# in the interval engine at 3 bits (as fast at 4), one 1024x1024 table 1.4-3x slower (benchmarks/dkm.py, 1 thread)
BUCKETED_FROM = 1 << 22

RUN = {"naive": naive.run, "table": table.run, "bucketed": bucketed.run, "interval": interval.run}
ENGINES = ("auto", *RUN)  # what `DKMConfig(engine=...)` accepts


def all_finite(weight: torch.Tensor) -> bool:
    """Whether every weight is finite: a finite sum says so in one reduction (a sum that overflows or is NaN/Inf
    falls back to checking each weight)."""
    return bool(torch.isfinite(weight.sum())) or bool(torch.isfinite(weight).all())


def unsupported(engine: str, dtype: torch.dtype | None, cluster_dim: int, sharded: bool) -> str | None:
    """Why `engine` cannot cluster such a layer (None when it can): the one statement of what each engine supports.

    `DKMConfig` asks with `dtype=None` (any dtype: what a config alone can rule out), the layer swap and `resolve`
    with the layer's dtype; a pinned engine that cannot raises early, "auto" never does."""
    if engine == "auto":
        return None
    if sharded and engine != "table":
        return "does not shard: use engine='table' or shard=False"
    if cluster_dim != 1 and engine in ("bucketed", "interval"):
        return "clusters scalars: use cluster_dim=1 or engine='table'"
    if dtype is not None and engine == "bucketed" and dtype != torch.float32:
        return f"clusters float32 weights, these are {dtype}: use engine='table' or 'auto'"
    return None


WEIGHING = ("naive", "interval")  # the engines that weigh the centroid updates by an importance (`_dkm.Importance`)


def resolve(settings, weight: torch.Tensor, group, weighted: bool = False) -> str:
    """The engine a layer runs: the pinned one, or for "auto":

    - "naive" when `uniquify=False` and nothing is sharded (DKM as written, its memory included);
    - for float32 scalar weights, unsharded, all finite: "interval", or "bucketed" where a table has at least
      `BUCKETED_FROM` weights (its buckets compress them: faster there, and nothing weight-sized saved);
    - for 16-bit scalar weights, unsharded, all finite, where the interval kernel serves (the CPU, a C compiler):
      "interval" (the kernel iterates over their distinct values);
    - "table" otherwise: 16-bit weights elsewhere, vectors, sharding, and weights holding NaN/Inf (the bucketed grid
      needs finite values; the table engine propagates NaN like naive DKM, so a diverged step shows as a NaN loss).

    `weighted`: the centroid updates run (`dkm_iters > 0`) weighted by a calibrated importance, which only the
    engines in `WEIGHING` compute: "auto" takes "interval" for every finite scalar weight, unsharded (on the CPU its
    kernel, elsewhere its torch ops); what is left, or a pinned engine of the others, raises a ValueError naming the
    fix.
    """
    cfg = settings.config
    sharded = group is not None
    if weighted:
        engine = cfg.engine
        if engine == "auto":
            plain = settings.cluster_dim == 1 and not sharded and all_finite(weight)
            engine = "naive" if not cfg.uniquify and not sharded else "interval" if plain else "table"
        reason = unsupported(engine, weight.dtype if engine != "interval" else None, settings.cluster_dim, sharded)
        if reason is None and settings.cluster_dim != 1:
            reason = "weighs scalar tables only (calibrate makes them): use cluster_dim=1, or dkm_iters=0"
        if reason is None and engine not in WEIGHING:
            reason = (
                "does not weigh DKM's centroid updates by the calibrated importance (hf_llmkit.quantization.calibrate"
                "): use engine='interval' (or 'auto') with cluster_dim=1 and shard=False, or dkm_iters=0"
            )
        if reason is not None:
            raise ValueError(f"DKMConfig(engine={engine!r}) {reason}.")
        return engine
    if cfg.engine == "auto":
        if not cfg.uniquify and not sharded:
            return "naive"
        if unsupported("bucketed", weight.dtype, settings.cluster_dim, sharded) is None:  # float32 scalars
            if not all_finite(weight):
                return "table"
            return "bucketed" if weight.numel() // settings.groups >= BUCKETED_FROM else "interval"
        if settings.cluster_dim == 1 and not sharded and interval_kernel.available(weight) and all_finite(weight):
            return "interval"
        return "table"
    reason = unsupported(cfg.engine, weight.dtype, settings.cluster_dim, sharded)
    if reason is None and cfg.engine in ("bucketed", "interval") and not all_finite(weight):
        reason = "cannot train weights holding NaN/Inf: it needs finite ones (engine='auto' uses 'table')"
    if reason is not None:
        raise ValueError(f"DKMConfig(engine={cfg.engine!r}) {reason}.")
    return cfg.engine


def soft_cluster(x, weight, centroids, settings, group=None, scales=None, importance=None):
    """DKM's soft-clustered `x @ W_c^T` (or `W_c`) and refined centroids, by the engine `resolve` picks.

    With block `scales` `[rows, cols / block]` (constants to autograd) the table clusters `W / s` and the clustered
    weight is `s` times it: the interval kernel folds them into its passes, the other engines cluster the divided
    weight. With `importance` `[in_features]` (a calibrated layer's, see `layers._Clustered.importance`; None:
    uniform) each weight counts its input's importance times its block scale squared in the centroid updates
    (`_dkm.Importance`), as `calibrate` counts it; without iterations it changes nothing and is not passed on."""
    if not settings.config.dkm_iters:
        importance = None
    engine = resolve(settings, weight, group, weighted=importance is not None)
    if engine == "interval" and interval_kernel.serves(x, weight) and weight.dim() == 2:
        return interval_kernel.run(x, weight, centroids, settings, scales, importance)
    weigh = None if importance is None else dkm.Importance(importance, scales)
    extra = {} if weigh is None else {"importance": weigh}
    if scales is None:
        return RUN[engine](x, weight, centroids, settings, group, **extra)
    spread = dkm.expand_scales(scales, weight.shape[1])
    normalized = (weight.float() / spread).to(weight.dtype)
    clustered, cents = RUN[engine](None, normalized, centroids, settings, group, **extra)
    w_c = (clustered.float() * spread).to(weight.dtype)
    return (w_c if x is None else x @ w_c.to(x.dtype).t()), cents
