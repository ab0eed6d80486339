"""hf_llmkit: plugins for the Hugging Face training stack.

Importing this package registers every plugin (PEFT methods with peft, the DKM quantization method with
transformers) exactly once; importing it again, or importing peft/transformers before or after, is safe.
"""

from hf_llmkit.args import LLMKitTrainingArguments
from hf_llmkit.parallel import MoELayer, apply_sequence_parallel, upcycle_to_moe
from hf_llmkit.quantization import DKMConfig
from hf_llmkit.tuners.bitfit import BitFitConfig
from hf_llmkit.tuners.bottleneck import BottleneckConfig
from hf_llmkit.tuners.ptuning import PTuningConfig, PTuningTemplate, build_ptuning_template
from hf_llmkit.tuners.ptuning_v2 import PTuningV2Config

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
