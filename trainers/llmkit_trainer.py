"""`LLMKitTrainer`: the HF `Trainer`, plus the features switched on by `LLMKitTrainingArguments`.

It overrides only documented `Trainer` hooks, and each feature lives in its own module; this class only
dispatches to them, so a run with default arguments behaves exactly like `transformers.Trainer`.
"""

from __future__ import annotations

from transformers import Trainer, TrainingArguments


class LLMKitTrainer(Trainer):
    """Drop-in `transformers.Trainer`; pass `LLMKitTrainingArguments` to enable hf_llmkit's features.

    Example:
        ```python
        from hf_llmkit import LLMKitTrainingArguments
        from hf_llmkit.trainers import LLMKitTrainer

        trainer = LLMKitTrainer(model=model, args=LLMKitTrainingArguments(output_dir="out"), train_dataset=ds)
        trainer.train()
        ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, TrainingArguments):
            raise TypeError(f"LLMKitTrainer needs TrainingArguments, got {type(self.args).__name__}")
