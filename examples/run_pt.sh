#!/usr/bin/env bash
# Continued pre-training with LoRA, DeepSpeed ZeRO-2 and gradient checkpointing: the Chinese-LLaMA-Alpaca-2 script
# scripts/training/run_pt.sh, flag for flag, on examples/run_clm.py. The defaults are small enough to run here on
# 2 CPU ranks, after `make quickstart` (whose model it continues); every value can be set from the environment:
#
#   bash examples/run_pt.sh
#   PRETRAINED_MODEL=path/to/llama DATASET_DIR=path/to/txt_files NPROC_PER_NODE=8 LORA_RANK=64 BLOCK_SIZE=512 \
#       bash examples/run_pt.sh
#
# Differences from the seed: `--peft_method lora` is explicit (the seed's script always trains LoRA); on a machine
# without CUDA it trains in fp32 (DeepSpeed on CPU offers no fp16, and transformers allows bf16 with DeepSpeed only
# on an accelerator; PRECISION=fp16|bf16|fp32 chooses); the defaults below are smaller (the
# seed's are in comments); extra flags after the script name are passed on (`bash examples/run_pt.sh --max_steps 4`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

lr=${LR:-2e-4}
lora_rank=${LORA_RANK:-8}                                   # seed: 64
lora_alpha=${LORA_ALPHA:-16}                                # seed: 128
lora_trainable=${LORA_TRAINABLE:-"q_proj,v_proj,k_proj,o_proj,gate_proj,down_proj,up_proj"}
modules_to_save=${MODULES_TO_SAVE:-"embed_tokens,lm_head"}
lora_dropout=${LORA_DROPOUT:-0.05}

pretrained_model=${PRETRAINED_MODEL:-outputs/run_clm}       # seed: ../merged_chinese_llama_7b/ (here: the quickstart's)
chinese_tokenizer_path=${TOKENIZER:-$pretrained_model}      # seed: ../tokenizer/
dataset_dir=${DATASET_DIR:-outputs/run_pt/dataset}          # seed: ../dataset (a folder of .txt files)
data_cache=${DATA_CACHE:-outputs/run_pt/data_cache}         # seed: temp_data_cache_dir
per_device_train_batch_size=${BATCH_SIZE:-1}
gradient_accumulation_steps=${GRAD_ACC:-8}
block_size=${BLOCK_SIZE:-128}                               # seed: 512
output_dir=${OUTPUT_DIR:-outputs/run_pt}                    # seed: output_dir
nproc_per_node=${NPROC_PER_NODE:-2}                         # seed: 1
num_train_epochs=${EPOCHS:-1}
deepspeed_config_file=${DEEPSPEED_CONFIG:-examples/ds_zero2_no_offload.json}

if [ ! -f "$pretrained_model/config.json" ]; then
    echo "run_pt.sh: error: $pretrained_model holds no model; run 'make quickstart' first or set PRETRAINED_MODEL" >&2
    exit 2
fi
if [ ! -d "$dataset_dir" ]; then  # the embedded English corpus as a folder of .txt files
    "$PYTHON" -m hf_llmkit.data.corpus "$dataset_dir" 8
fi
precision=${PRECISION:-$("$PYTHON" -c 'import torch; print("fp16" if torch.cuda.is_available() else "fp32")')}
case "$precision" in
    fp16) precision_flags=(--fp16 --torch_dtype float16) ;;  # the seed's
    bf16) precision_flags=(--bf16 --torch_dtype bfloat16) ;;
    fp32) precision_flags=(--torch_dtype float32) ;;
    *) echo "run_pt.sh: error: PRECISION=$precision; use fp16, bf16 or fp32" >&2; exit 2 ;;
esac

"$PYTHON" -m torch.distributed.run --nnodes 1 --nproc_per_node "$nproc_per_node" --master_port "${MASTER_PORT:-29500}" \
    examples/run_clm.py \
    --deepspeed "${deepspeed_config_file}" \
    --model_name_or_path "${pretrained_model}" \
    --tokenizer_name_or_path "${chinese_tokenizer_path}" \
    --dataset_dir "${dataset_dir}" \
    --data_cache_dir "${data_cache}" \
    --validation_split_percentage 0.001 \
    --per_device_train_batch_size "${per_device_train_batch_size}" \
    --do_train \
    --seed 4 \
    "${precision_flags[@]}" \
    --num_train_epochs "${num_train_epochs}" \
    --lr_scheduler_type cosine \
    --learning_rate "${lr}" \
    --warmup_ratio 0.05 \
    --weight_decay 0.01 \
    --logging_strategy steps \
    --logging_steps 10 \
    --save_strategy steps \
    --save_total_limit 3 \
    --save_steps 200 \
    --gradient_accumulation_steps "${gradient_accumulation_steps}" \
    --preprocessing_num_workers 2 \
    --block_size "${block_size}" \
    --output_dir "${output_dir}" \
    --overwrite_output_dir \
    --ddp_timeout 30000 \
    --logging_first_step True \
    --peft_method lora \
    --lora_rank "${lora_rank}" \
    --lora_alpha "${lora_alpha}" \
    --trainable "${lora_trainable}" \
    --lora_dropout "${lora_dropout}" \
    --modules_to_save "${modules_to_save}" \
    --load_in_kbits 16 \
    --gradient_checkpointing \
    --ddp_find_unused_parameters False \
    "$@"
