"""hf_llmkit: plugins for the Hugging Face training stack.

Importing this package registers every plugin (PEFT methods with peft, the DKM quantization method with
transformers) exactly once; importing it again, or importing peft/transformers before or after, is safe.
"""

from hf_llmkit.args import LLMKitTrainingArguments

__version__ = "0.1.0"

__all__ = ["LLMKitTrainingArguments", "__version__"]
