"""The docs fragments of `dkm_inference.py` (its three parts) and `dkm_onnx.py`."""

from __future__ import annotations

from harness.common import markdown_table
from harness.registry import fragment, measured

SIZE_NAMES = {"issue": "issue's model", "1b": "~1B-parameter shape"}


@fragment("dkm_inference", "dkm_inference")
def dkm_inference(results: dict) -> str:
    """benchmarks/dkm_inference.py: generate speed, prefill and memory of ours against dense and 3-4 bit peers."""
    from areas.inference.report import heading, table

    data = results["dkm_inference"]
    cpu = data.get("cpu") or data["recorded"]["machine"].get("cpu") or "an unnamed CPU"
    parts = [f"On **{cpu}** (the loops its packed layers took are in the last column where the run recorded them):"]
    for size_name, size in data["sizes"].items():
        for threads in size["threads"]:
            parts.append(heading(size_name, size, threads, data["config"]) + "\n\n" + table(size, threads))
    missing = [name for name in ("issue", "1b") if name not in data["sizes"]]
    if missing and "--quick" not in data["argv"]:
        parts.append(f"Not part of this run: the {' and the '.join(SIZE_NAMES[m] for m in missing)} (`--sizes`).")
    verdict = "\n".join(f"- {line}" for line in data["verdicts"])
    threads = ", ".join(str(t) for t in data["config"]["threads"])
    return (
        "\n\n".join(parts) + "\n\nThe targets:\n\n" + verdict + "\n\n" + measured(data, f"{threads} torch thread(s)")
    )


@fragment("dkm_inference_loops", "dkm_inference_loops")
def dkm_inference_loops(results: dict) -> str:
    """benchmarks/dkm_inference.py --parts loops: every loop level of the DKM CPU kernel on each CPU measured."""
    from areas.inference.loops import kernel_rows, model_rows
    from areas.inference.switch import switch_rows

    parts = []
    for cpu, part in results["dkm_inference_loops"]["machines"].items():
        k = part["kernels"]
        shape = part["shape"]
        parts.append(
            f"**{cpu}**, loop levels {', '.join(k['levels'])}. One packed "
            f"Linear {k['shape'][0]:,} x {k['shape'][1]:,} at batch 1, read from memory (the streaming floor: its "
            f"bytes at the {k['bandwidth_gb_s']:.1f} GB/s a plain sum streams here):\n\n"
            + kernel_rows(k)
            + f"\n\nThe issue's random Llama (hidden {shape['hidden']:,}, {shape['layers']} layers, MLP "
            f"{shape['intermediate']:,}), batch-1 `generate` of {part['new_tokens']} tokens, 1 torch thread, "
            f"{part['rounds']} round(s), each variant a fresh process per round, order rotated:\n\n"
            + model_rows(part, "1")
            + switch_rows(part.get("switch"))
            + "\n\n"
            + "\n".join(f"- {line}" for line in part["verdicts"])
            + "\n\n"
            + measured(part, "1 torch thread")
        )
    return "\n\n".join(parts)


@fragment("dkm_inference_real", "dkm_inference_real")
def dkm_inference_real(results: dict) -> str:
    """benchmarks/dkm_inference.py --parts real: SmolLM2-135M against llama.cpp on each CPU measured."""
    from areas.inference.real import table

    parts = []
    for cpu, part in results["dkm_inference_real"]["machines"].items():
        for threads in part["threads"]:
            parts.append(
                f"**{cpu}**, SmolLM2-135M-Instruct ({part['layers']} layers), {threads} thread(s): greedy "
                f"`generate` of {part['new_tokens']} tokens after a prompt of real text, prefill of 512 tokens; "
                f"{part['rounds']} round(s), each variant a fresh process per round, order rotated; llama.cpp "
                f"built with {part['llama_cpp']}:\n\n" + table(part, threads)
            )
        parts.append("\n".join(f"- {line}" for line in part["verdicts"]) + "\n\n" + measured(part))
    return "\n\n".join(parts)


@fragment("dkm_onnx", "dkm_onnx")
def dkm_onnx(results: dict) -> str:
    """benchmarks/dkm_onnx.py: onnxruntime serving of the DKM export against the dense ONNX export."""
    from areas.inference.onnxrt import onnx_verdicts

    data = results["dkm_onnx"]
    titles = {"tiny": "tiny Llama (smoke test)", "issue": "Llama hidden 1,024, 8 layers, MLP 2,816, vocabulary 4,096",
              "smollm2": "SmolLM2-135M-Instruct (the real model, 30 layers)"}  # fmt: skip
    parts = []
    for size, cell in data["sizes"].items():
        rows = [["onnxruntime, 1 thread", "tokens/s batch 1", "x dense", "prefill s", "x dense",
                 "peak RSS over imports MiB", "x dense", "file MiB", "session load s"]]  # fmt: skip
        for name, v in cell["summary"].items():
            rows.append([name, f"{v['tokens_per_s_b1']:.2f}", f"{v['b1_x_dense']:.2f}", f"{v['prefill_s']:.2f}",
                         f"{v['prefill_x_dense']:.1f}", f"{v['peak_over_base_mib']:,.0f}", f"{v['peak_x_dense']:.2f}",
                         f"{v['file_mib']:,.1f}", f"{v['load_s']:.2f}"])  # fmt: skip
        config = data["config"]
        parts.append(
            f"{titles.get(size, size)}, DKM 3-bit (bf16 tables); batch-1 greedy tokens after a 16-token prompt "
            f"({config['new_tokens']} timed, {config['slow_tokens']} on the standard-op path), prefill of "
            f"{config['prefill']} tokens; {config['rounds']} round(s), a fresh process per variant and round, order "
            "rotated; every variant generated the PyTorch model's tokens:\n\n"
            + markdown_table(rows)
            + "\n\n"
            + "\n".join(f"- {line}" for line in onnx_verdicts(size, cell))
        )
    return "\n\n".join(parts) + "\n\n" + measured(data, "1 onnxruntime thread")
