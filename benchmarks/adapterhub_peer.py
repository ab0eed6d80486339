"""AdapterHub `adapters` timing, run by benchmarks/peft_methods.py inside a separate virtual environment.

`adapters` needs transformers 4.x, so this script imports neither hf_llmkit nor anything from transformers 5. It
reads a JSON spec (workload shapes, rounds, bottleneck settings) from the file named by argv[1] and prints one
JSON object: per workload, per method, trainable parameters and the fastest step time in ms, next to its own
full fine-tuning step so the caller can compare ratios across the two processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _model(workload: dict):
    from transformers import BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if workload["kind"] == "llama":
        return LlamaForCausalLM(LlamaConfig(**workload["config"]))
    return BertForMaskedLM.from_pretrained(workload["path"])


def _adapter_configs(spec: dict) -> dict:
    from adapters import DoubleSeqBnConfig, ParBnConfig, SeqBnConfig

    common = {"reduction_factor": spec["reduction_factor"], "non_linearity": spec["non_linearity"]}
    return {
        "adapters houlsby": DoubleSeqBnConfig(**common),
        "adapters pfeiffer": SeqBnConfig(**common),
        "adapters parallel": ParBnConfig(scaling=spec["parallel_scaling"], **common),
    }


CALIBRATION = "calibration (pure torch)"


def calibration_step(device: torch.device | str = "cpu"):
    """A fixed pure-torch fwd + bwd (same torch in both environments): the machine-speed yardstick that lets
    step times from two processes, run minutes apart on a shared machine, be compared."""
    g = torch.Generator().manual_seed(0)
    # about as long as a workload step: under bursty load a short yardstick finds quiet gaps a long step cannot
    layers = [torch.randn(1024, 1024, generator=g).to(device).requires_grad_() for _ in range(4)]
    x = torch.randn(512, 1024, generator=g).to(device)

    def step() -> None:
        h = x
        for w in layers:
            h = torch.relu(h @ w)
        h.sum().backward()
        for w in layers:
            w.grad = None

    return step


def _runner(model, batch: dict, lr: float):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in params)


def _batch(workload: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, workload["vocab"], (workload["batch"], workload["seq"]), generator=g)
    labels = ids.clone()
    if workload["kind"] != "llama":  # MLM: predict 15% of the positions
        labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
    return {"input_ids": ids, "labels": labels}


def run_adapterhub(python: str | None, workloads: dict, rounds: int, threads: int = 1, *, device: str = "cpu") -> dict:
    """Time AdapterHub's Houlsby/Pfeiffer/parallel adapters in their own venv; {'error': why} if it cannot run."""
    if not python:
        return {"error": "no AdapterHub venv given (--adapters-python or $HF_LLMKIT_ADAPTERS_PYTHON)"}
    if not Path(python).exists():
        return {"error": f"{python} does not exist"}
    spec = {
        "workloads": workloads,
        "rounds": rounds,
        "warmup": 1,
        "reduction_factor": 16,
        "non_linearity": "relu",
        "parallel_scaling": 4.0,
        "threads": threads,
        "device": device,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", OMP_NUM_THREADS=str(threads))
    try:
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), f.name], capture_output=True, text=True, timeout=600, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": "the AdapterHub run timed out after 600 s"}
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return {"error": f"exit code {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:300]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    import adapters

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    torch.set_num_threads(spec.get("threads", 1))
    device = torch.device(spec.get("device", "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # queued kernels belong to the step
    out = {"versions": {"adapters": adapters.__version__, "transformers": __import__("transformers").__version__}}
    for name, workload in spec["workloads"].items():
        batch = {key: value.to(device) for key, value in _batch(workload).items()}
        runners = {
            CALIBRATION: (calibration_step(device), 0),
            "full fine-tuning": _runner(_model(workload).to(device), batch, 1e-5),
        }
        for method, config in _adapter_configs(spec).items():
            model = _model(workload)
            adapters.init(model)
            model.add_adapter("bench", config=config)
            model.train_adapter("bench")
            model.to(device)  # after the adapter exists: its weights move too
            runners[method] = _runner(model, batch, 1e-3)
        times = {m: [] for m in runners}
        for r in range(spec["warmup"] + spec["rounds"]):
            for method, (step, _) in runners.items():  # interleaved rounds: machine noise hits all alike
                sync()
                start = time.perf_counter()
                step()
                sync()
                if r >= spec["warmup"]:
                    times[method].append(time.perf_counter() - start)
        out[name] = {m: {"trainable": runners[m][1], "step_ms": 1e3 * min(t)} for m, t in times.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
