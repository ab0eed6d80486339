"""hf_llmkit: plugins for the Hugging Face training stack.

Importing this package registers every plugin (PEFT methods with peft, the DKM quantization method with
transformers) exactly once; importing it again, or importing peft/transformers before or after, is safe.
It also drops a few upstream console messages nobody can act on (`hf_llmkit.noise`), before peft,
bitsandbytes and DeepSpeed are imported.
"""

from hf_llmkit.noise import silence_known_noise

silence_known_noise()

from hf_llmkit.args import LLMKitTrainingArguments  # noqa: E402
from hf_llmkit.parallel import MoELayer, apply_sequence_parallel, upcycle_to_moe  # noqa: E402
from hf_llmkit.quantization import DKMConfig  # noqa: E402
from hf_llmkit.tuners.bitfit import BitFitConfig  # noqa: E402
from hf_llmkit.tuners.bottleneck import BottleneckConfig  # noqa: E402
from hf_llmkit.tuners.ptuning import PTuningConfig, PTuningTemplate, build_ptuning_template  # noqa: E402
from hf_llmkit.tuners.ptuning_v2 import PTuningV2Config  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BitFitConfig",
    "BottleneckConfig",
    "DKMConfig",
    "LLMKitTrainingArguments",
    "MoELayer",
    "PTuningConfig",
    "PTuningTemplate",
    "PTuningV2Config",
    "__version__",
    "apply_sequence_parallel",
    "build_ptuning_template",
    "upcycle_to_moe",
]
