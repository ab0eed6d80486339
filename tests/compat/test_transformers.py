"""The private Trainer hooks LLMKitTrainer overrides still exist with the parameters it relies on."""

from __future__ import annotations

import sys

import transformers

from hf_llmkit.compat.transformers import CHECKED_AGAINST, TRAINER_PRIVATE_HOOKS, missing_trainer_internals
from hf_llmkit.trainers import LLMKitTrainer


def test_trainer_internals_are_still_there():
    missing = missing_trainer_internals()
    assert not missing, (
        f"transformers {transformers.__version__} changed what LLMKitTrainer overrides (checked against "
        f"{CHECKED_AGAINST}): {missing}; update hf_llmkit.compat.transformers and hf_llmkit.trainers"
    )


def test_every_private_override_is_declared():
    private = {name for name in vars(LLMKitTrainer) if name.startswith("_") and not name.startswith("__")}
    overridden = {name for name in private if hasattr(transformers.Trainer, name)}
    assert overridden == set(TRAINER_PRIVATE_HOOKS), "declare private Trainer overrides in compat.transformers"
    doc = sys.modules[LLMKitTrainer.__module__].__doc__
    assert all(f"`{name}`" in doc for name in TRAINER_PRIVATE_HOOKS)  # listed, with why, where users read


def test_cache_keyword_is_the_one_models_take():
    """A KV cache passed by `cache_keyword` reaches the model: its continuation equals the uncached forward (the
    keyword is `past_key_values` up to transformers 5.23 and `cache` from 5.24)."""
    import torch
    from transformers import DynamicCache

    from hf_llmkit.compat.transformers import cache_keyword
    from hf_llmkit.testing import tiny_llama

    model, ids = tiny_llama().eval(), torch.tensor([[5, 6, 7, 8, 9]])
    keyword = cache_keyword(model)
    assert keyword in ("cache", "past_key_values")
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, -1]
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], use_cache=True, **{keyword: cache})
        assert cache.get_seq_length() == ids.shape[1] - 1  # the model filled the cache it was handed
        last = model(input_ids=ids[:, -1:], use_cache=True, **{keyword: cache}).logits[:, -1]
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)


def test_callback_states_are_where_the_trainer_saves_and_reads_them():
    """The Trainer's save indexes `state.stateful_callbacks` by class name and its resume reads it back; the compat
    helpers write the same entries, in a live state and in a `trainer_state.json` dict."""
    import inspect

    from transformers import Trainer, TrainerState

    from hf_llmkit.compat.transformers import add_saved_callback_states, saved_callback_state

    hint = f"transformers {transformers.__version__} changed stateful_callbacks (checked against {CHECKED_AGAINST})"
    assert "self.state.stateful_callbacks[cb_name]" in inspect.getsource(Trainer._save_checkpoint), hint
    assert "self.state.stateful_callbacks" in inspect.getsource(Trainer._load_callback_state), hint
    state = TrainerState(stateful_callbacks={"Kept": {"args": {}, "attributes": {"n": 1}}})
    assert saved_callback_state(state, "Kept", {"fresh": True}) == {"args": {}, "attributes": {"n": 1}}
    assert saved_callback_state(state, "New", {"fresh": True}) == {"fresh": True}
    assert state.stateful_callbacks["New"] == {"fresh": True}
    saved = {"global_step": 3}
    add_saved_callback_states(saved, {"A": {"attributes": {}}})
    assert TrainerState(**saved).stateful_callbacks == {"A": {"attributes": {}}}
