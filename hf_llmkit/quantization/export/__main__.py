"""Export a saved DKM checkpoint: `python -m hf_llmkit.quantization.export {coreml,onnx} CHECKPOINT OUTPUT`.

    python -m hf_llmkit.quantization.export onnx out/dkm-model model.onnx
    python -m hf_llmkit.quantization.export coreml out/dkm-model model.mlpackage --seq_len 128

Bad input prints one `error: ...` line and exits 2.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    prog = "python -m hf_llmkit.quantization.export"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("format", choices=("coreml", "onnx"), help="coreml: an .mlpackage; onnx: an .onnx file")
    parser.add_argument("checkpoint", help="folder of a DKM model saved with save_pretrained")
    parser.add_argument("output", help="the file to write (.mlpackage or .onnx)")
    parser.add_argument("--seq_len", type=int, default=64, help="coreml: the program's sequence length")
    parser.add_argument("--batch_size", type=int, default=1, help="coreml: the program's batch size")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    import hf_llmkit  # noqa: F401  (registers the "dkm" quantization method)
    from hf_llmkit.quantization.export import export_coreml, export_onnx

    try:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
        if args.format == "coreml":
            path = export_coreml(model, args.output, seq_len=args.seq_len, batch_size=args.batch_size)
        else:
            path = export_onnx(model, args.output)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
