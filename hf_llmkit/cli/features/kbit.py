"""k-bit loading: `--load_in_kbits 4/8` (`hf_llmkit.cli.quantization.KbitArguments`), a frozen bitsandbytes base
under a PEFT adapter (QLoRA-style)."""

from __future__ import annotations

from hf_llmkit.cli.features.base import BuildState, Feature
from hf_llmkit.cli.quantization import KbitArguments

__all__ = ["KBIT"]


class Kbit(Feature):
    name = "kbit"
    arguments = KbitArguments
    stage = 40  # prepared for training just before the adapter wraps it
    row = "quantization"

    def check(self, args) -> None:
        if args.kbit.load_in_kbits == 16:
            return
        if args.peft.peft_method == "none":
            raise ValueError(
                f"--load_in_kbits {args.kbit.load_in_kbits} freezes the quantized base: train an adapter on it "
                "with --peft_method (e.g. lora), or drop --load_in_kbits"
            )
        if args.dkm.quantization is not None:
            raise ValueError("--load_in_kbits 4/8 and --quantization dkm both quantize the weights; choose one")
        if args.moe.upcycle_moe:
            raise ValueError(
                "--upcycle_moe copies full-precision MLP weights into experts, --load_in_kbits 4/8 loads them "
                "quantized; drop one"
            )
        if args.model.model_name_or_path is None:
            raise ValueError("--load_in_kbits 4/8 quantizes a pretrained model: add --model_name_or_path")

    def folder_suffix(self, values):
        return f"{values['load_in_kbits']}bit" if values["load_in_kbits"] != 16 else None

    def load_config(self, args):
        import torch

        dtype = args.model.torch_dtype
        compute = getattr(torch, dtype) if dtype not in (None, "auto") else None
        return args.kbit.build_config(compute_dtype=compute or torch.float32, skip_modules=args.peft.modules_to_save)

    def model_stage(self, args, state: BuildState) -> None:
        if args.kbit.load_in_kbits != 16:
            from peft import prepare_model_for_kbit_training

            state.model = prepare_model_for_kbit_training(
                state.model, use_gradient_checkpointing=args.training.activation_checkpointing
            )

    def describe(self, args):
        return args.kbit.describe()


KBIT = Kbit()
