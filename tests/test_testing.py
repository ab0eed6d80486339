"""The multi-rank launcher: real gloo ranks, results in rank order, every rank's stderr on failure."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hf_llmkit.testing import DistributedRunError, distributed_backend, launch, tiny_llama


def _all_reduce_rank_then_abort_at_finalisation() -> tuple[int, int, float, str]:
    """A real all-reduce; then what a library's group destroyed at interpreter exit can do to a rank: abort it after
    its work is done. One launch for both tests (each rank is a fresh interpreter importing hf_llmkit: 6-7 s)."""
    import atexit

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    atexit.register(os.abort)
    return dist.get_rank(), dist.get_world_size(), value.item(), dist.get_backend()


def _fail_on_rank_one(message: str) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError(message)
    dist.barrier()  # rank 0 waits for a peer that never comes: the launcher must not hang


def _sleep_forever() -> None:
    import time

    time.sleep(3600)


@pytest.fixture(scope="module")
def aborting_run() -> list:
    return launch(_all_reduce_rank_then_abort_at_finalisation, nprocs=2, timeout=120)


def test_launch_runs_real_gloo_ranks(aborting_run):
    backend = distributed_backend(2)  # "gloo" here; NCCL joins it on a machine with a GPU per rank (tests/gpu)
    assert aborting_run == [(0, 2, 3.0, backend), (1, 2, 3.0, backend)]
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


def test_a_rank_that_returned_is_not_failed_by_its_interpreter_finalisation(aborting_run):
    assert [rank for rank, *_ in aborting_run] == [0, 1]  # both ranks abort at exit: the launch still returned


def test_timeout_is_bounded():
    with pytest.raises(DistributedRunError, match="timed out after 1s"):
        launch(_sleep_forever, nprocs=2, timeout=1, init_process_group=False)


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


def test_smollm2_path_builds_the_real_model_once_and_slices_it(monkeypatch):
    """Built in the run's shared cache (tests/conftest.py): by this call, or by another test's that came first (the
    whole model is built once per run: about 20 s of CPU); later calls find the folders and build nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_llmkit.testing as testing
    import hf_llmkit.testing_models as testing_models
    from hf_llmkit.data.corpus import default_cache_dir

    whole = testing.smollm2_path()
    part_path = testing.smollm2_path(num_hidden_layers=2)

    def build_again(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(testing_models, "_write_smollm2", build_again)  # where smollm2_path looks them up
    monkeypatch.setattr(testing_models, "_write_smollm2_slice", build_again)
    assert testing.smollm2_path() == whole  # found in the cache, not built again
    assert testing.smollm2_path(num_hidden_layers=2) == part_path
    tokenizer = AutoTokenizer.from_pretrained(whole)
    model = AutoModelForCausalLM.from_pretrained(whole)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the GGUF file
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    answer = tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :])
    assert "Paris" in answer  # real weights: a sensible greedy answer

    part = AutoModelForCausalLM.from_pretrained(part_path)
    assert part.config.num_hidden_layers == len(part.model.layers) == 2
    assert torch.equal(part.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)
    models = default_cache_dir() / "models"
    assert (whole, part_path) == (
        models / "smollm2-135m-instruct-0.1.2-all",
        models / "smollm2-135m-instruct-0.1.2-2-layers",
    )
    assert not list(models.glob("*.tmp-*"))  # no temporary left behind
    with pytest.raises(ValueError, match="keep at least one layer"):
        testing.smollm2_path(num_hidden_layers=0)
