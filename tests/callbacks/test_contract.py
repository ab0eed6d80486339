"""Contract: every hf_llmkit callback handles every TrainerCallback event, alone and together in a real run.

Every callback of the library is here: the three of `hf_llmkit.callbacks`, `DKMTrainingStateCallback`
(hf_llmkit.quantization) and the main job's `ResumePoint` (hf_llmkit.cli.results)."""

from __future__ import annotations

import json
import signal

import pytest
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import ExportableState

from hf_llmkit.callbacks import FaultToleranceCallback, LossScaleCallback, SavePeftModelCallback, verify_checkpoint
from hf_llmkit.checkpoints.names import MANIFEST_NAME
from hf_llmkit.cli.results import ResumePoint
from hf_llmkit.quantization import DKMTrainingStateCallback
from tests.callbacks.support import Blocks, make_trainer, small_model

FACTORIES = {  # fault_tolerance first, save_peft in the middle: the reversed order puts fault_tolerance last
    "fault_tolerance": lambda: FaultToleranceCallback(),
    "save_peft": lambda: SavePeftModelCallback(save_merged=True),
    "loss_scale": lambda: LossScaleCallback(),
    "dkm_training_state": lambda: DKMTrainingStateCallback(),
    "resume_point": lambda: ResumePoint(),
}

# Every event in the order a training run with evaluation, prediction and a push would fire them.
LIFECYCLE = [
    ("on_init_end", {}),
    ("on_train_begin", {}),
    ("on_epoch_begin", {}),
    ("on_step_begin", {}),
    ("on_substep_end", {}),
    ("on_pre_optimizer_step", {}),
    ("on_optimizer_step", {}),
    ("on_step_end", {}),
    ("on_log", {"logs": {"loss": 1.0, "learning_rate": 1e-3}}),
    ("on_prediction_step", {}),
    ("on_evaluate", {"metrics": {"eval_loss": 1.0}}),
    ("on_predict", {"metrics": {"test_loss": 1.0}}),
    ("on_save", {}),
    ("on_push_begin", {}),
    ("on_epoch_end", {}),
    ("on_train_end", {}),
]


def _lora_model():
    return get_peft_model(small_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_lifecycle_covers_every_event():
    events = {name for name in dir(TrainerCallback) if name.startswith("on_")}
    assert events == {name for name, _ in LIFECYCLE}, "a new TrainerCallback event: add it to LIFECYCLE"


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_event_with_live_trainer_objects(tmp_path, name):
    callback = FACTORIES[name]()
    trainer = make_trainer(tmp_path, model=_lora_model(), callbacks=[callback], max_steps=1, save_total_limit=3)
    trainer.train()  # real optimizer, scheduler and dataloader in the handler; a real checkpoint-1 on disk
    handler = trainer.callback_handler
    control = TrainerControl()
    exportable = [cb for cb in [*handler.callbacks, control] if isinstance(cb, ExportableState)]
    state = TrainerState(max_steps=1, logging_steps=1, save_steps=1, train_batch_size=4, stateful_callbacks=exportable)
    trainer.control = control
    sigterm = signal.getsignal(signal.SIGTERM)
    for event, kwargs in LIFECYCLE:
        if event == "on_step_end":
            state.global_step += 1  # as the Trainer does right before on_step_end
        if event == "on_save":
            trainer.state = state
            trainer._save_checkpoint(trainer.model, trial=None)  # the real write on_save follows
        result = (
            getattr(handler, event)(trainer.args, state, control, **kwargs)
            if event != "on_init_end"
            else (handler.call_event(event, trainer.args, state, control))
        )
        assert result is None or isinstance(result, TrainerControl), (name, event)
        control = result or control
    assert signal.getsignal(signal.SIGTERM) == sigterm  # nothing left installed after on_train_end
    assert trainer.args.save_total_limit == 3  # never changed
    if name == "fault_tolerance":
        assert verify_checkpoint(tmp_path / "checkpoint-1") is None
    if name == "save_peft":
        assert (tmp_path / "checkpoint-1" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_event_without_training_objects(tmp_path, name):
    """evaluate()/predict() before any training: no optimizer, no scheduler, no checkpoint folder."""
    callback = FACTORIES[name]()
    trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=1)
    control = TrainerControl()
    for event, kwargs in LIFECYCLE:
        result = getattr(callback, event)(
            trainer.args,
            trainer.state,
            control,
            model=None,
            processing_class=None,
            optimizer=None,
            lr_scheduler=None,
            train_dataloader=None,
            eval_dataloader=None,
            **kwargs,
        )
        assert result is None or isinstance(result, TrainerControl), (name, event)


@pytest.mark.parametrize(
    "order",
    [tuple(FACTORIES), tuple(reversed(FACTORIES))],
    ids=["ft-first", "ft-last"],
)
def test_all_together_in_either_order(tmp_path, order):
    trainer = make_trainer(
        tmp_path,
        model=_lora_model(),
        callbacks=[FACTORIES[n]() for n in order],
        max_steps=4,
        save_steps=2,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=2,
        eval_data=Blocks(8),
        auto_resume=True,
    )
    trainer.train()
    checkpoint = tmp_path / "checkpoint-4"
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-4"]
    assert verify_checkpoint(checkpoint) is None
    files = json.loads((checkpoint / MANIFEST_NAME).read_text())["files"]
    # Whichever runs first, the manifest covers the adapter and merged model saved by SavePeftModelCallback.
    assert "adapter/adapter_model.safetensors" in files and "merged/model.safetensors" in files
