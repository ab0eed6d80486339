"""run_sft.py composes with the columns of the composition matrix as run_clm.py does: a PEFT method under ZeRO-2
on 2 ranks and DKM, each SIGKILLed after its first checkpoint and re-run, end with every final artifact
byte-identical to an uninterrupted run (one kill-and-resume harness process serves both); MoE upcycling trains."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.callbacks.test_kill_resume_run_clm import _check_same_final_artifacts, _harness
from tests.conftest import REPO
from tests.examples.test_run_sft import TINY

ZERO2 = "examples/ds_zero2_no_offload.json"
KILLED = {
    "lora-x-zero2-2ranks": {
        "flags": ["--peft_method", "lora", "--lora_rank", "4", "--deepspeed", str(REPO / ZERO2)],
        "ranks": 2,
    },
    "dkm": {"flags": ["--quantization", "dkm", "--dkm_bits", "3"]},
}  # fmt: skip
STEPS = ["--max_steps", "4", "--save_steps", "2", "--max_train_samples", "48"]  # the kill lands after checkpoint-2


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sft_kill")
    return workdir, _harness(workdir, KILLED, example="run_sft", tiny=[*TINY, *STEPS])


@pytest.mark.parametrize("name", list(KILLED))
def test_killed_sft_run_resumes_to_the_same_final_artifacts(name, killed):
    workdir, results = killed
    _check_same_final_artifacts(name, KILLED[name], results[name], workdir)


def test_upcycled_moe_trains_and_saves_a_native_mixtral(tmp_path):
    from tests.examples.test_run_sft import load_example

    run_sft = load_example("run_sft")
    flags = ["--upcycle_moe", "true", "--moe_num_experts", "4", "--max_steps", "2", "--output_dir", str(tmp_path)]
    results = run_sft.run([*TINY, *flags])
    assert results["global_step"] == 2 and type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == (
        "MixtralForCausalLM"
    )
