"""`--dkm_recipe calibrated` in the main jobs: the calibration before the first step, said, timed and evaluated.

The trainer's `DKMTrainingStateCallback` calibrates a fresh run's start when training begins (minutes on a real
model). Around it, `CalibratedStart` says in one line that it runs and on how many examples, then how long it took;
the progress bar starts after it (its rate and remaining time are the steps', not the calibration's); and the run's
"eval perplexity before" is measured on that calibrated start, the model training continues from (an evaluation
before `train()` would measure the k-means start, which training never uses).

    start = CalibratedStart(trainer, samples=128, evaluate=True)   # after the trainer is built, before train()
    trainer.train()
    start.eval_loss                                                 # the calibrated start's evaluation loss
"""

from __future__ import annotations

import logging
import time

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

__all__ = ["CalibratedStart"]

logger = logging.getLogger(__name__)


class _Announce(TrainerCallback):
    def __init__(self, owner: CalibratedStart) -> None:
        self.owner = owner

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.owner.began = time.perf_counter()
            if state.is_world_process_zero:
                logger.info(
                    "calibrating the DKM start on %d training examples before the first step (--dkm_recipe "
                    "calibrated: refit tables, GPTQ rounding; minutes on a large model)", self.owner.samples,
                )  # fmt: skip


class CalibratedStart(TrainerCallback):
    """Placed around `trainer`'s `DKMTrainingStateCallback` (see the module docstring); `eval_loss` is the
    calibrated start's evaluation loss once `train()` began (None: not evaluated, or a resumed run)."""

    def __init__(self, trainer, *, samples: int, evaluate: bool) -> None:
        from hf_llmkit.quantization import DKMTrainingStateCallback

        self.trainer, self.samples, self.evaluate = trainer, samples, evaluate
        self.began: float | None = None
        self.eval_loss: float | None = None
        calibrating = trainer.pop_callback(DKMTrainingStateCallback)
        progress = trainer.pop_callback(ProgressCallback)
        for callback in (_Announce(self), calibrating, self, progress):
            if callback is not None:
                trainer.add_callback(callback)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.began is None:
            return  # resumed: the start was calibrated by the run that began
        if state.is_world_process_zero:
            logger.info("calibrated the DKM start in %.1f s", time.perf_counter() - self.began)
        if self.evaluate:
            self.eval_loss = self.trainer.evaluate()["eval_loss"]


def calibrated_start(args, trainer, *, fresh: bool, evaluate: bool) -> CalibratedStart | None:
    """A `CalibratedStart` around `trainer`'s calibration when the run's DKM recipe calibrates its start (a fresh
    run that trains); None otherwise."""
    config = args.dkm.build_config()
    if config is None or config.recipe != "calibrated" or not config.calibration_samples:
        return None
    if not (fresh and args.training.do_train):
        return None
    samples = min(config.calibration_samples, len(trainer.train_dataset))
    return CalibratedStart(trainer, samples=samples, evaluate=evaluate)


def calibrate_untrained(args, trainer, train, collator) -> dict:
    """`--dkm_recipe calibrated --do_train false`: the recipe's start is the model to evaluate (the post-training
    result), so it is calibrated here, on the first training examples, with the same lines; returns what the
    results report of it (empty for any other run)."""
    config = args.dkm.build_config()
    if config is None or config.recipe != "calibrated" or not config.calibration_samples or args.training.do_train:
        return {}
    import torch

    from hf_llmkit.quantization import calibrate
    from hf_llmkit.quantization.calibration import first_examples

    samples = min(config.calibration_samples, len(train))
    loader = torch.utils.data.DataLoader(train, collate_fn=collator)
    began = time.perf_counter()
    if args.training.should_log:
        logger.info(
            "calibrating the DKM start on %d training examples (--dkm_recipe calibrated, no training)", samples
        )
    calibrate(trainer.model, first_examples(loader, samples, args.training.per_device_train_batch_size))
    if args.training.should_log:
        logger.info("calibrated the DKM start in %.1f s", time.perf_counter() - began)
    return {"dkm_calibration_samples": samples, "dkm_recipe": config.recipe}
