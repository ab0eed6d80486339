"""torch still offers what hf_llmkit.compat.torch relies on, with the meaning it relies on."""

from __future__ import annotations

import torch

from hf_llmkit.compat.torch import (
    CHECKED_AGAINST,
    module_buffers,
    sigmoid_slope,
    storage_use_count,
    version_counter,
    view_base,
)

WHERE = f"torch {torch.__version__} (checked against {CHECKED_AGAINST})"


def test_storage_use_count_counts_holders():
    t = torch.empty(4)
    storage = t.untyped_storage()
    alone = storage_use_count(storage)
    assert alone is not None, f"{WHERE}: torch._C._storage_Use_Count is gone; GradientBuffer would never reuse memory"
    view = t[1:]
    assert storage_use_count(storage) == alone + 1, f"{WHERE}: a view no longer counts as a holder of its storage"
    del view
    assert storage_use_count(storage) == alone


def test_view_base_names_the_viewed_tensor():
    weight = torch.nn.Parameter(torch.ones(2, 3))
    assert isinstance(view_base(weight.t()), torch.nn.Parameter), f"{WHERE}: Tensor._base no longer names the base"
    assert view_base(torch.ones(2)) is None


def test_module_buffers_is_the_live_dict_of_a_modules_own_buffers():
    module = torch.nn.BatchNorm1d(3)
    module.register_buffer("none", None)
    buffers = module_buffers(module)
    assert buffers["running_mean"] is module.running_mean and buffers["none"] is None, f"{WHERE}: Module._buffers"
    module.running_mean = torch.ones(3)  # replaced through setattr: the same dict sees it
    assert buffers["running_mean"] is module.running_mean, f"{WHERE}: Module._buffers is no longer the live dict"


def test_version_counter_grows_with_in_place_changes():
    t = torch.zeros(3)
    before = version_counter(t)
    t.add_(1)
    assert version_counter(t) > before, f"{WHERE}: Tensor._version no longer counts in-place changes"
    assert version_counter(t + 1) == 0


def test_recompile_limit_raises_dynamo_limit():
    import torch._dynamo.config as dynamo_config

    from hf_llmkit.compat.torch import recompile_limit

    before = dynamo_config.recompile_limit
    with recompile_limit(before + 5):
        assert dynamo_config.recompile_limit == before + 5, f"{WHERE}: dynamo's recompile_limit setting is gone"
    assert dynamo_config.recompile_limit == before


def test_sigmoid_slope_is_the_sigmoid_derivative_in_one_op():
    assert getattr(torch.ops.aten, "sigmoid_backward", None) is not None, f"{WHERE}: aten.sigmoid_backward is gone"
    y, g = torch.rand(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    torch.testing.assert_close(sigmoid_slope(g, y), g * y * (1 - y), rtol=1e-15, atol=1e-15)


def test_apply_is_how_a_dtype_cast_reaches_buffers():
    from torch import nn

    from hf_llmkit.compat.torch import apply_keeping_dtypes

    class Kept(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.tensor([1.0001]))
            self.register_buffer("other", torch.tensor([1.0001]))

        def _apply(self, fn, recurse=True):
            return apply_keeping_dtypes(self, lambda: super(Kept, self)._apply(fn, recurse), ("table",))

    module = Kept().to(torch.float16)
    assert module.table.dtype == torch.float32 and module.table.item() == torch.tensor(1.0001).item()
    assert module.other.dtype == torch.float16  # torch's own cast, through nn.Module._apply
