"""The multi-rank launcher: real gloo ranks, results in rank order, every rank's stderr on failure."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hf_llmkit.testing import DistributedRunError, distributed_backend, launch, tiny_llama


def _all_reduce_rank() -> tuple[int, int, float, str]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item(), dist.get_backend()


def _fail_on_rank_one(message: str) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError(message)
    dist.barrier()  # rank 0 waits for a peer that never comes: the launcher must not hang


def _sleep_forever() -> None:
    import time

    time.sleep(3600)


def _abort_at_finalisation() -> int:
    """What a library's group destroyed at interpreter exit can do to a rank: abort it after its work is done."""
    import atexit

    atexit.register(os.abort)
    return dist.get_rank()


def test_launch_runs_real_gloo_ranks():
    results = launch(_all_reduce_rank, nprocs=2, timeout=120)
    backend = distributed_backend(2)  # "gloo" here; NCCL joins it on a machine with a GPU per rank (tests/gpu)
    assert results == [(0, 2, 3.0, backend), (1, 2, 3.0, backend)]
    assert not dist.is_initialized()


def test_backend_is_gloo_without_a_cuda_device_per_rank():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert distributed_backend(gpus + 1) == "gloo"  # one rank more than there are GPUs
    if gpus == 0:
        assert distributed_backend(1) == "gloo"
    with pytest.raises(ValueError, match="nprocs must be >= 1"):
        distributed_backend(0)


def test_failure_reports_every_rank():
    with pytest.raises(DistributedRunError) as info:
        launch(_fail_on_rank_one, "boom-from-rank-one", nprocs=2, timeout=60)
    text = str(info.value)
    assert "boom-from-rank-one" in text and "rank 0" in text and "rank 1" in text


def test_a_rank_that_returned_is_not_failed_by_its_interpreter_finalisation():
    assert launch(_abort_at_finalisation, nprocs=2, timeout=120) == [0, 1]


def test_timeout_is_bounded():
    with pytest.raises(DistributedRunError, match="timed out"):
        launch(_sleep_forever, nprocs=2, timeout=3, init_process_group=False)


def test_rejects_functions_it_cannot_import():
    def local():
        return 1

    with pytest.raises(ValueError, match="module top level"):
        launch(local, nprocs=2)


def test_tiny_llama_is_deterministic():
    a, b = tiny_llama(seed=3), tiny_llama(seed=3)
    ids = torch.arange(12).reshape(2, 6)
    torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)
    assert a.config.num_key_value_heads < a.config.num_attention_heads  # GQA, as the parallel tests need
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "gpt2", "bert"])
def test_tiny_model_of_every_family_has_the_tiny_shape(model_type):
    from hf_llmkit.testing import TINY_SHAPE, tiny_model

    model = tiny_model(model_type, num_hidden_layers=1) if model_type != "gpt2" else tiny_model("gpt2", n_layer=1)
    config = model.config
    assert config.model_type == model_type and config.num_hidden_layers == 1 and not model.training
    assert config.hidden_size == TINY_SHAPE["hidden_size"] and config.vocab_size == TINY_SHAPE["vocab_size"]
    ids = torch.arange(3, 15).reshape(2, 6)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids)[0]).all()


def test_tiny_config_names_the_families_it_knows():
    from hf_llmkit.testing import tiny_config

    with pytest.raises(ValueError, match="use one of"):
        tiny_config("t5")


def test_tiny_training_args_are_quiet_cpu_defaults_that_overrides_change(tmp_path):
    from hf_llmkit.testing import tiny_training_args

    args = tiny_training_args(tmp_path, max_steps=2)
    assert args.max_steps == 2 and args.use_cpu and args.report_to == [] and args.save_strategy == "no"
    assert args.output_dir == str(tmp_path)


def test_smollm2_path_builds_the_real_model_once_and_slices_it(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_llmkit.testing import smollm2_path

    whole = smollm2_path(cache_dir=tmp_path)
    assert smollm2_path(cache_dir=tmp_path) == whole  # found in the cache, not built again
    tokenizer = AutoTokenizer.from_pretrained(whole)
    model = AutoModelForCausalLM.from_pretrained(whole)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the GGUF file
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    answer = tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :])
    assert "Paris" in answer  # real weights: a sensible greedy answer

    part = AutoModelForCausalLM.from_pretrained(smollm2_path(num_hidden_layers=2, cache_dir=tmp_path))
    assert part.config.num_hidden_layers == len(part.model.layers) == 2
    assert torch.equal(part.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        "smollm2-135m-instruct-0.1.2-2-layers",
        "smollm2-135m-instruct-0.1.2-all",
    ]
    with pytest.raises(ValueError, match="keep at least one layer"):
        smollm2_path(num_hidden_layers=0, cache_dir=tmp_path)
