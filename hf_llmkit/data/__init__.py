"""The data path of the main jobs: where the text comes from, how it is read, tokenised and cached.

```
 the user's files (--dataset_dir)        the embedded texts (no download)
   files.py: find, check, stream rows      corpus.py: pydoc_data.topics paragraphs + its BPE tokenizer
   json_text.py: JSON / JSON lines         instructions.py: the embedded instruction set
            |                                         |
            +--------------------+--------------------+
                                 v
     pre-training (run_clm): rows of text          fine-tuning (run_sft): instruction records
                                 |                                      |
     blocks.py: tokenised, cut into block_size       sft.py: prompt template, labels on the response
     blocks, seeded train / validation split         only, length budget, packing, the collator
                                 |
     cache.py: the blocks cached under a key of everything that decides them, published whole by a rename
```

Each module is imported on its own (`from hf_llmkit.data.blocks import build_lm_datasets`); the names below are
also importable from `hf_llmkit.data`, loaded on first use so that `python -m hf_llmkit.data.corpus DIR` and
`python -m hf_llmkit.data.instructions FILE` run their module once.
"""

from __future__ import annotations

import importlib
from typing import Any

# fmt: off
_NAMES = {
    "blocks": ("build_lm_datasets", "validation_block_count"),
    "cache": ("publish_once", "remove_stale_temporaries", "replace_folder", "temporary_sibling"),
    "corpus": ("corpus_texts", "corpus_tokenizer", "default_cache_dir", "write_corpus_files"),
    "files": ("TextFiles", "find_data_files", "read_file_rows", "read_text_rows", "split_long_text"),
    "instructions": ("instruction_records", "write_instruction_file"),
    "sft": ("InstructionCollator", "PromptTemplate", "TruncationReport", "check_length_budget", "pack_examples",
            "read_instruction_records", "tokenize_record", "tokenize_records"),
}
# fmt: on
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_llmkit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hf_llmkit.data.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
