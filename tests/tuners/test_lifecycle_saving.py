"""The PEFT lifecycle battery, part two: `modules_to_save` and saving / reloading, over `lifecycle_cases.CASES`.

- `modules_to_save` with one module, and the seed recipe's `embed_tokens,lm_head` with untied and with tied
  embeddings (`ensure_weight_tying=True`: one trained copy, still tied; without it peft's warning names the option):
  trained in full, saved, disabled, kept by a second adapter, merged (exactly, where the method merges; the merged
  model keeps the trained copies) and unloaded as LoRA is (peft 0.21 keeps the trained copies, 0.22 gives the
  original modules back).
- Saving two adapters with `modules_to_save`, reloading them in ONE fresh process for the whole module (a child of
  the warm interpreter, tests/warm.py: importing the stack in a new one costs seconds) with equal outputs;
  `PeftModel.from_pretrained(..., is_trainable=False)` leaves nothing trainable, `True` exactly what `get_peft_model`
  trained; `low_cpu_mem_usage=True` loads too.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper
from safetensors.torch import load_file

from tests.tuners.lifecycle_cases import FAMILIES, METHODS, RUNS, make_model, saved_modules
from tests.tuners.lifecycle_checks import (
    fresh_process_outputs,
    no_peft_modules_left,
    outputs,
    refuses_in_one_line,
    snapshot,
    train_step,
    trainable,
    unload_keeps_trained_copies,
)

MTS_CELLS = [
    pytest.param(case, cell, id=f"{case.id}-{cell.name}") for case in RUNS for cell in saved_modules(case.family)
]


def _wrappers(model) -> dict[str, ModulesToSaveWrapper]:
    """`modules_to_save` wrappers by the name of the module they wrap in the base model."""
    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, ModulesToSaveWrapper)}


def _with_copies(family: str, tied: bool, wrappers: dict[str, ModulesToSaveWrapper]):
    """The base model with each wrapped module replaced by (the weights of) its trained copy."""
    model = make_model(family, tied)
    for name, wrapper in wrappers.items():
        model.get_submodule(name).load_state_dict(wrapper.modules_to_save["default"].state_dict())
    return model


@pytest.mark.parametrize(("case", "cell"), MTS_CELLS)
def test_modules_to_save(case, cell, tmp_path):
    method, family = METHODS[case.method], case.family
    inputs, plain = method.inputs(family), FAMILIES[family].inputs()  # plain: no virtual tokens

    def base():
        return make_model(family, cell.tied)

    def config(slot=0, tie=cell.tied, **kwargs):  # a fresh list each time: LoRA's ensure_weight_tying edits it
        return method.config(family, slot=slot, modules_to_save=list(cell.entries), ensure_weight_tying=tie, **kwargs)

    if cell.name != "one" and method.embedding_saved:
        refuses_in_one_line(method.embedding_saved, lambda: get_peft_model(base(), config()))
        return
    if cell.tied:  # without ensure_weight_tying: two independent copies, and peft's warning names the option
        with pytest.warns(UserWarning, match="ensure_weight_tying"):
            untied = get_peft_model(base(), config(tie=False))
        copies = [w.modules_to_save["default"].weight for w in _wrappers(untied).values()]
        assert len(copies) == 2 and copies[0] is not copies[1]
    model = get_peft_model(base(), config())
    wrappers = _wrappers(model)
    assert sorted(n.rsplit(".", 1)[-1] for n in wrappers) == sorted(cell.entries)
    if cell.tied:
        embed, head = (wrappers[n].modules_to_save["default"].weight for n in ("model.embed_tokens", "lm_head"))
        assert embed is head  # one trained copy, still tied
    prefix, names = model.base_model.prefix, trainable(model)
    copy_params = {n for n, _ in model.named_parameters() if ".modules_to_save." in n}
    assert {n for n in names if prefix not in n} == copy_params
    before = snapshot(model)
    train_step(model, inputs)
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert moved <= names and moved & copy_params and any(prefix in n for n in moved)
    expected = outputs(model, inputs)
    if cell.tied:  # saved and loaded back, the copies are tied again (the fresh-process reload: test_save_and_reload)
        model.save_pretrained(tmp_path)
        again = PeftModel.from_pretrained(base(), tmp_path)
        copies = [_wrappers(again)[n].modules_to_save["default"].weight for n in ("model.embed_tokens", "lm_head")]
        assert copies[0] is copies[1]
        torch.testing.assert_close(outputs(again, inputs), expected, rtol=0, atol=0)
    with model.disable_adapter():  # the original modules, not the trained copies
        torch.testing.assert_close(outputs(model, plain), outputs(base(), plain), rtol=0, atol=0)

    # a second adapter with its own copies: added inactive, switched to, removed; the first one's output stays
    model.add_adapter("other", config(slot=1))
    torch.testing.assert_close(outputs(model, inputs), expected, rtol=0, atol=0)
    model.set_adapter("other")
    assert not torch.allclose(outputs(model, method.inputs(family, 1)), expected)
    model.set_adapter("default")
    model.delete_adapter("other")
    torch.testing.assert_close(outputs(model, inputs), expected, rtol=0, atol=0)
    assert _wrappers(model).keys() == wrappers.keys()
    # ... and one without modules_to_save: it adapts the model's own modules, never the insides of the wrappers
    model.add_adapter("bare", method.config(family, slot=1))
    assert not any(isinstance(m, BaseTunerLayer) for w in _wrappers(model).values() for m in w.modules())
    torch.testing.assert_close(outputs(model, inputs), expected, rtol=0, atol=0)
    model.delete_adapter("bare")

    if method.merge_error:
        refuses_in_one_line(method.merge_error, model.merge_and_unload)
    else:
        model.merge_adapter()
        torch.testing.assert_close(outputs(model, inputs), expected, rtol=1e-4, atol=1e-4)
        model.unmerge_adapter()
        torch.testing.assert_close(outputs(model, inputs), expected, rtol=1e-4, atol=1e-4)
        merged = copy.deepcopy(model).merge_and_unload(safe_merge=True)
        assert no_peft_modules_left(merged)
        torch.testing.assert_close(outputs(merged, inputs), expected, rtol=1e-4, atol=1e-4)
        if cell.tied:
            assert merged.get_input_embeddings().weight is merged.get_output_embeddings().weight
    unloaded = model.unload()  # as LoRA: the adapter goes; the trained copies stay on peft 0.21, not on 0.22
    assert no_peft_modules_left(unloaded)
    reference = _with_copies(family, cell.tied, wrappers) if unload_keeps_trained_copies() else base()
    rounding = 0 if method.merge_error else 1e-4  # a merge and an unmerge went through the base weights
    torch.testing.assert_close(outputs(unloaded, plain), outputs(reference, plain), rtol=rounding, atol=rounding)


def _save(case, folder):
    """Two adapters with `modules_to_save` (each its own copy) saved to `folder`; returns the fresh-process job, the
    outputs of each adapter before saving and what each trains."""
    method, family = METHODS[case.method], case.family
    one = [FAMILIES[family].one_module]
    model = get_peft_model(make_model(family), method.config(family, modules_to_save=one))
    model.add_adapter("other", method.config(family, slot=1, modules_to_save=one))
    wrapper = _wrappers(model)[one[0]]
    expected, names = [], []
    for slot, name in enumerate(("default", "other")):
        model.set_adapter(name)
        with torch.no_grad():  # as if trained: each copy differs from the base module
            for p in wrapper.modules_to_save[name].parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(slot)))
        expected.append(outputs(model, method.inputs(family, slot)))
        names.append(trainable(model))
    model.set_adapter("default")
    model.save_pretrained(folder)
    adapters = [("default", "", method.inputs(family, 0)), ("other", "other", method.inputs(family, 1))]
    return (family, False, str(folder), adapters), expected, names


def _save_seed(case, cell, folder):
    """One adapter with the seed recipe's `modules_to_save` (`cell`) saved to `folder`: the job and its outputs."""
    method, family = METHODS[case.method], case.family
    config = method.config(family, modules_to_save=list(cell.entries), ensure_weight_tying=cell.tied)
    model = get_peft_model(make_model(family, cell.tied), config)
    with torch.no_grad():
        for p in (p for n, p in model.named_parameters() if ".modules_to_save." in n):
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    model.save_pretrained(folder)
    inputs = method.inputs(family)
    return (family, cell.tied, str(folder), [("default", "", inputs)]), [outputs(model, inputs)]


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory):
    """Every case the session runs `test_save_and_reload` for (with the seed recipe's modules_to_save where it
    applies): saved here, all reloaded in one fresh process."""
    wanted = [
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_save_and_reload" and hasattr(item, "callspec")
    ]
    root = tmp_path_factory.mktemp("lifecycle")
    jobs, expected, results = [], [], {}
    for case in wanted:
        job, outs, names = _save(case, root / case.id)
        jobs.append(job)
        expected.append((case.id, "two adapters", outs))
        results[case.id] = {"folder": root / case.id, "trainable": names, "reloads": []}
        for cell in saved_modules(case.family)[1:] if not METHODS[case.method].embedding_saved else []:
            job, outs = _save_seed(case, cell, root / f"{case.id}-{cell.name}")
            jobs.append(job)
            expected.append((case.id, cell.name, outs))
    for (case_id, what, outs), reloaded in zip(expected, fresh_process_outputs(jobs) if jobs else []):
        results[case_id]["reloads"].append((what, outs, reloaded))
    return results


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in RUNS])
def test_save_and_reload(case, saved):
    method, family = METHODS[case.method], case.family
    result, folder = saved[case.id], saved[case.id]["folder"]
    for path in (folder, folder / "other"):
        files = {p.name for p in path.iterdir() if p.is_file()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
        state = load_file(path / "adapter_model.safetensors")
        prefix = METHODS[case.method].config(family).peft_type.value.lower() + "_"
        assert state and all(t.numel() > 0 for t in state.values())
        copy_keys = {k for k in state if f".{FAMILIES[family].one_module}." in k and prefix not in k}
        assert copy_keys and all(prefix in k for k in set(state) - copy_keys), sorted(state)  # adapter + copy only
    for what, expected, reloaded in result["reloads"]:  # a fresh process, the same outputs
        assert len(reloaded) == len(expected), what
        for one, other in zip(reloaded, expected):
            torch.testing.assert_close(one, other, rtol=0, atol=0, msg=lambda m, what=what: f"{what}: {m}")
    expected = result["reloads"][0][1][0]  # the default adapter's outputs before saving

    inputs = method.inputs(family)
    frozen = PeftModel.from_pretrained(make_model(family), folder, is_trainable=False)
    assert not trainable(frozen) and frozen.peft_config["default"].inference_mode
    torch.testing.assert_close(outputs(frozen, inputs), expected, rtol=0, atol=0)
    resumed = PeftModel.from_pretrained(make_model(family), folder, is_trainable=True)
    assert trainable(resumed) == result["trainable"][0]  # what get_peft_model trained, nothing more
    resumed.load_adapter(folder / "other", adapter_name="other", is_trainable=True)
    resumed.set_adapter("other")
    assert trainable(resumed) == result["trainable"][1]  # the other adapter and its modules_to_save copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lazily = PeftModel.from_pretrained(make_model(family), folder, low_cpu_mem_usage=True)
    # weights created on the meta device, then loaded as views of the file: another CPU kernel may run, so float
    # rounding may differ
    torch.testing.assert_close(outputs(lazily, inputs), expected, rtol=1e-4, atol=1e-4)
