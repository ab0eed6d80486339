#!/usr/bin/env python
"""The seed recipe's pre-training script (Chinese-LLaMA-Alpaca-2 `scripts/training/run_clm_pt_with_peft.py`), in its
structure and with its flags, on transformers 5, with hf_llmkit's `SavePeftModelCallback` in place of the one the
seed defines. Written here from the seed's documented flow (not copied): tokenize every `.txt` file of
`--dataset_dir`, group the tokens into `--block_size` blocks, cache each file's blocks under `--data_cache_dir`,
hold out `--validation_split_percentage`, load the model (bitsandbytes with `--load_in_kbits 4|8`), wrap it in LoRA
(`--trainable`, `--lora_rank`, `--lora_alpha`, `--lora_dropout`, `--modules_to_save`) and train with the `Trainer`
(DeepSpeed ZeRO-2 through `--deepspeed`, launched with torchrun as the seed's `run_pt.sh` does).

Every line that differs from the seed because transformers 5 removed what it used carries a `# transformers 5:` note;
`docs/main_job.md` ("The seed recipe") lists them as a table. One more line tears the process group down before the
interpreter exits (`# torch:`). `tests/examples/test_seed_recipe.py` runs it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import datasets
import torch
import transformers
from datasets import concatenate_datasets, load_dataset
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    HfArgumentParser,
    Trainer,
    set_seed,
)
from transformers.testing_utils import CaptureLogger
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import is_torch_xla_available  # transformers 5: is_torch_tpu_available is gone

from hf_llmkit import LLMKitTrainingArguments  # a drop-in TrainingArguments (see MyTrainingArguments)
from hf_llmkit.callbacks import SavePeftModelCallback  # the seed defines its own; ours verifies what it writes

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "The model checkpoint to start from."})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "The tokenizer (a folder)."})
    config_name: str | None = field(default=None, metadata={"help": "A config, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloaded models are stored."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    token: str | None = field(  # transformers 5: `use_auth_token` is gone; `token` replaces it
        default=None, metadata={"help": "Hub token for private models."}
    )
    torch_dtype: str | None = field(
        default=None,
        metadata={"help": "dtype to load the model in.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )


@dataclass
class DataTrainingArguments:
    dataset_dir: str | None = field(default=None, metadata={"help": "A folder of .txt training files."})
    block_size: int | None = field(default=None, metadata={"help": "Tokens per training block."})
    validation_split_percentage: float | None = field(
        default=0.05, metadata={"help": "Share of the blocks held out for evaluation."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenizing."})
    data_cache_dir: str | None = field(default="./", metadata={"help": "Where each file's blocks are cached."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation blocks."})


@dataclass
class MyTrainingArguments(LLMKitTrainingArguments):  # the seed: TrainingArguments. Ours runs DeepSpeed on CPU ranks
    # too (gloo, no C++ op build); on GPUs TrainingArguments works as in the seed
    trainable: str | None = field(default="q_proj,v_proj")
    lora_rank: int | None = field(default=8)
    lora_dropout: float | None = field(default=0.1)
    lora_alpha: float | None = field(default=32.0)
    modules_to_save: str | None = field(default=None)
    debug_mode: bool | None = field(default=False)
    peft_path: str | None = field(default=None)
    load_in_kbits: int | None = field(default=16)
    double_quant: bool | None = field(default=True)
    quant_type: str | None = field(default="nf4")
    # transformers 5: `overwrite_output_dir` and `warmup_ratio` left TrainingArguments; the seed's shell script
    # passes both, so the script declares them (warmup_steps takes a fraction of the steps since 5.0)
    overwrite_output_dir: bool = field(default=False)
    warmup_ratio: float | None = field(default=None)

    def __post_init__(self):
        if self.warmup_ratio is not None:
            self.warmup_steps = self.warmup_ratio
        super().__post_init__()


def accuracy(predictions, references):
    from sklearn.metrics import accuracy_score

    return {"accuracy": float(accuracy_score(references, predictions))}


def compute_metrics(eval_preds):
    preds, labels = eval_preds
    labels = labels[:, 1:].reshape(-1)  # predictions at position i are for the token at i + 1
    preds = preds[:, :-1].reshape(-1)
    return accuracy(predictions=preds, references=labels)


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def fault_tolerance_data_collator(features: list) -> dict:
    """The seed's collator: stack every field; fall back to the first feature's keys when a feature lacks one."""
    first = features[0]
    batch = {}
    for key, value in first.items():
        if value is None or isinstance(value, str):
            continue
        try:
            batch[key] = torch.stack([torch.as_tensor(f[key]) for f in features])
        except (KeyError, RuntimeError):
            batch[key] = torch.stack([torch.as_tensor(first[key])] * len(features))
    return batch


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, MyTrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    # transformers 5: `send_example_telemetry` is gone (the seed reported its run to the Hub)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO if training_args.should_log else logging.WARN,
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(
        f"Process rank: {training_args.local_rank}, device: {training_args.device}, "
        f"n_gpu: {training_args.n_gpu}, 16-bits training: {training_args.fp16 or training_args.bf16}"
    )

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train and not training_args.overwrite_output_dir:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is None and any(Path(training_args.output_dir).iterdir()):
            raise ValueError(
                f"Output directory ({training_args.output_dir}) already exists and is not empty. "
                "Use --overwrite_output_dir to overcome."
            )
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")
    set_seed(training_args.seed)

    config_kwargs = {
        "cache_dir": model_args.cache_dir,
        "revision": model_args.model_revision,
        "token": model_args.token,  # transformers 5: was `use_auth_token`
    }
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, **config_kwargs)
    # The seed loads `LlamaTokenizer` (its sentencepiece vocabulary); any tokenizer folder loads through AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name_or_path or model_args.model_name_or_path, **config_kwargs
    )

    tok_logger = transformers.utils.logging.get_logger("transformers.tokenization_utils_base")

    def tokenize_function(examples):
        with CaptureLogger(tok_logger) as cl:
            output = tokenizer(examples["text"])
        if "Token indices sequence length is longer than the" in cl.out:
            tok_logger.warning("^^^^^^^^^ Please ignore the warning above: the long input is chunked into blocks.")
        return output

    block_size = data_args.block_size or min(tokenizer.model_max_length, 1024)
    block_size = min(block_size, tokenizer.model_max_length)

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated[next(iter(examples))])
        total_length = (total_length // block_size) * block_size  # the remainder is dropped
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="dataset map tokenization and grouping"):
        lm_datasets = []
        path = Path(data_args.dataset_dir)
        files = sorted(file.name for file in path.glob("*.txt"))
        if training_args.debug_mode:
            files = [files[0]]
        for idx, file in enumerate(files):
            data_file = os.path.join(path, file)
            filename = "".join(file.split(".")[:-1])
            cache_path = os.path.join(data_args.data_cache_dir, filename + f"_{block_size}")
            os.makedirs(cache_path, exist_ok=True)
            try:
                processed_dataset = datasets.load_from_disk(cache_path, keep_in_memory=False)
                logger.info(f"training datasets-{filename} has been loaded from disk")
            except Exception:  # noqa: BLE001 - the seed's cache miss: build the blocks
                cache_dir = os.path.join(data_args.data_cache_dir, filename + f"_text_{block_size}")
                os.makedirs(cache_dir, exist_ok=True)
                raw_dataset = load_dataset("text", data_files=data_file, cache_dir=cache_dir, keep_in_memory=False)
                logger.info(f"{file} has been loaded")
                tokenized_dataset = raw_dataset.map(
                    tokenize_function, batched=True, num_proc=data_args.preprocessing_num_workers,
                    remove_columns="text", load_from_cache_file=True, keep_in_memory=False,
                    cache_file_names={k: os.path.join(cache_dir, "tokenized.arrow") for k in raw_dataset},
                    desc="Running tokenizer on dataset",
                )  # fmt: skip
                grouped_datasets = tokenized_dataset.map(
                    group_texts, batched=True, num_proc=data_args.preprocessing_num_workers,
                    load_from_cache_file=True, keep_in_memory=False,
                    cache_file_names={k: os.path.join(cache_dir, "grouped.arrow") for k in tokenized_dataset},
                    desc=f"Grouping texts in chunks of {block_size}",
                )  # fmt: skip
                processed_dataset = grouped_datasets
                processed_dataset.save_to_disk(cache_path)
            if idx == 0:
                lm_datasets = processed_dataset["train"]
            else:
                assert lm_datasets.features.type == processed_dataset["train"].features.type
                lm_datasets = concatenate_datasets([lm_datasets, processed_dataset["train"]])
        lm_datasets = lm_datasets.train_test_split(test_size=data_args.validation_split_percentage)

    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
        logger.info(f"Num train_samples  {len(train_dataset)}")
        logger.info("Training example:")
        logger.info(tokenizer.decode(train_dataset[0]["input_ids"]))
    if training_args.do_eval:
        eval_dataset = lm_datasets["test"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))
        logger.info(f"Num eval_samples  {len(eval_dataset)}")

    torch_dtype = (
        model_args.torch_dtype if model_args.torch_dtype in ["auto", None] else getattr(torch, model_args.torch_dtype)
    )
    compute_dtype = torch.float16 if training_args.fp16 else (torch.bfloat16 if training_args.bf16 else torch.float32)
    if training_args.load_in_kbits in [4, 8]:
        logger.info(f"Load model in {training_args.load_in_kbits} bits")
        quantization_config = BitsAndBytesConfig(
            load_in_4bit=training_args.load_in_kbits == 4,
            load_in_8bit=training_args.load_in_kbits == 8,
            llm_int8_threshold=6.0,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=training_args.double_quant,
            bnb_4bit_quant_type=training_args.quant_type,
        )
    else:
        quantization_config = None
    # The seed places each rank's model on its GPU (`{"": LOCAL_RANK}`); a CPU rank has none to name
    device_map = {"": int(os.environ.get("LOCAL_RANK") or 0)} if torch.cuda.is_available() else None
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        dtype=torch_dtype,  # transformers 5: `torch_dtype=` is `dtype=`
        device_map=device_map,
        quantization_config=quantization_config,  # transformers 5: no `load_in_4bit=` / `load_in_8bit=` kwargs
    )  # transformers 5: `from_tf=` and `low_cpu_mem_usage=` are gone (TF checkpoints; low-memory loading is default)
    if training_args.load_in_kbits in [4, 8]:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=training_args.gradient_checkpointing)
    model.config.use_cache = False

    model_vocab_size = model.get_output_embeddings().weight.size(0)
    tokenizer_vocab_size = len(tokenizer)
    logger.info(f"Model vocab size: {model_vocab_size}")
    logger.info(f"Tokenizer vocab size: {tokenizer_vocab_size}")
    if model_vocab_size != tokenizer_vocab_size:
        logger.info(f"Resize model vocab size to {tokenizer_vocab_size}")
        model.resize_token_embeddings(len(tokenizer))

    if training_args.peft_path is not None:
        logger.info("Peft from pre-trained model")
        model = PeftModel.from_pretrained(model, training_args.peft_path, device_map=device_map, is_trainable=True)
    else:
        logger.info("Init new peft model")
        target_modules = training_args.trainable.split(",")
        modules_to_save = training_args.modules_to_save
        if modules_to_save is not None:
            modules_to_save = modules_to_save.split(",")
        logger.info(f"target_modules: {target_modules}")
        logger.info(f"lora_rank: {training_args.lora_rank}")
        peft_config = LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            target_modules=target_modules,
            inference_mode=False,
            r=training_args.lora_rank,
            lora_alpha=training_args.lora_alpha,
            lora_dropout=training_args.lora_dropout,
            modules_to_save=modules_to_save,
        )
        model = get_peft_model(model, peft_config)
    model.print_trainable_parameters()

    do_metrics = training_args.do_eval and not is_torch_xla_available()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,  # transformers 5: `tokenizer=` is `processing_class=`
        data_collator=fault_tolerance_data_collator,
        compute_metrics=compute_metrics if do_metrics else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if do_metrics else None,
    )
    trainer.add_callback(SavePeftModelCallback(subfolder="pt_lora_model"))  # the seed's folder name

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics = train_result.metrics
        max_train_samples = (
            data_args.max_train_samples if data_args.max_train_samples is not None else len(train_dataset)
        )
        metrics["train_samples"] = min(max_train_samples, len(train_dataset))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        max_eval_samples = data_args.max_eval_samples if data_args.max_eval_samples is not None else len(eval_dataset)
        metrics["eval_samples"] = min(max_eval_samples, len(eval_dataset))
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    try:
        main()
    finally:  # torch: a gloo group left to interpreter finalisation can abort the rank after training has finished
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
