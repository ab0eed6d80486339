"""Export a saved DKM checkpoint: `python -m hf_llmkit.quantization.export {coreml,onnx} CHECKPOINT OUTPUT`.

    python -m hf_llmkit.quantization.export onnx out/dkm-model served    # a folder optimum's ORTModelForCausalLM loads
    python -m hf_llmkit.quantization.export onnx out/dkm-model model.onnx
    python -m hf_llmkit.quantization.export coreml out/dkm-model model.mlpackage --seq_len 512

The output and the options are checked before the checkpoint is read; anything that fails (a missing package, a
damaged checkpoint, a model the converter refuses) prints one `error: ...` line naming the fix and exits 2, with
nothing written under the output's name.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

NEEDS = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "coreml": ("coremltools",)}


def _parser() -> argparse.ArgumentParser:
    prog = "python -m hf_llmkit.quantization.export"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("format", choices=("coreml", "onnx"), help="coreml: an .mlpackage; onnx: .onnx file or folder")
    parser.add_argument("checkpoint", help="folder of a DKM model saved with save_pretrained")
    parser.add_argument(
        "output", help="coreml: the .mlpackage; onnx: a .onnx file, or a new folder (model, config, tokenizer)"
    )
    parser.add_argument("--seq_len", type=int, default=None, help="coreml: the longest context (default 512)")
    parser.add_argument("--batch_size", type=int, default=None, help="coreml: the program's batch size (default 1)")
    return parser


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken or half-removed installation counts as missing
        return False


def _check(args) -> str | None:
    """The one-line reason the command cannot run (before any work), or None."""
    missing = [name for name in NEEDS[args.format] if not _installed(name)]
    if missing:
        return f"the {args.format} export needs {', '.join(missing)} (not installed): pip install 'hf_llmkit[export]'"
    if args.format == "onnx" and (args.seq_len is not None or args.batch_size is not None):
        return "--seq_len / --batch_size apply to coreml only: the ONNX export's sizes are dynamic; drop them"
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        what = "does not exist" if not checkpoint.exists() else "has no config.json"
        return f"checkpoint {args.checkpoint!r} {what}: pass the folder save_pretrained wrote"
    output = Path(args.output)
    try:
        if args.format == "onnx":
            from hf_llmkit.quantization.export._common import check_output
            from hf_llmkit.quantization.export.onnx import check_onnx_target

            check_onnx_target(output)
            check_output(output, "export_onnx", kind="file" if output.suffix == ".onnx" else "folder")
        else:
            from hf_llmkit.quantization.export.coreml import check_coreml_options

            check_coreml_options(output, *_coreml_sizes(args))
    except ValueError as error:
        return str(error)
    return None


def _coreml_sizes(args) -> tuple[int, int]:
    return (512 if args.seq_len is None else args.seq_len), (1 if args.batch_size is None else args.batch_size)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _one_line(error: BaseException) -> str:
    """The first line of the error's real cause: the innermost error it was raised from (torch.onnx's wrapper is a
    "step 1/3 ... Next steps:" banner around the tracer's error), terminal colour codes removed."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = [line for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    return f"{type(error).__name__}: {text[0].strip()[:300]}" if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    reason = _check(args)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2

    from transformers import AutoModelForCausalLM

    import hf_llmkit  # noqa: F401  (registers the "dkm" quantization method)
    from hf_llmkit.quantization.export import export_coreml, export_onnx

    try:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
    except Exception as error:  # noqa: BLE001 - any reader's failure (damaged safetensors, bad config...): one line
        print(
            f"error: cannot load the checkpoint {args.checkpoint!r} ({_one_line(error)}): save it again with "
            "save_pretrained (a damaged or partial copy cannot be exported)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.format == "coreml":
            seq_len, batch_size = _coreml_sizes(args)
            path = export_coreml(model, args.output, seq_len=seq_len, batch_size=batch_size)
        else:
            path = export_onnx(model, args.output, tokenizer_from=Path(args.checkpoint))
    except ValueError as error:  # ours: the message names the fix
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - the converter's own failure: one line, nothing written
        print(
            f"error: the {args.format} conversion failed ({_one_line(error)}); nothing was written. Run "
            f"hf_llmkit.quantization.export_{args.format}(model, ...) in Python for the full traceback",
            file=sys.stderr,
        )
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
