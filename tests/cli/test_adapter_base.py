"""`output_dir/base` is written all or nothing (issue 46, found attacking it: a run killed while writing it left a
half-written base, which the resumed run then kept because its config.json was there)."""

from __future__ import annotations

import pytest

from hf_llmkit.cli.adapter_base import write_base
from hf_llmkit.testing import corpus_tokenizer, tiny_llama


class _Failing:
    def save_pretrained(self, folder):
        raise OSError("disk full")


def test_a_base_is_written_whole_or_not_at_all(tmp_path):
    base = tmp_path / "base"
    with pytest.raises(OSError, match="disk full"):
        write_base(tiny_llama(), _Failing(), base)
    assert list(tmp_path.iterdir()) == []  # neither the base nor its temporary
    write_base(tiny_llama(), corpus_tokenizer(), base)
    written = sorted(p.name for p in base.iterdir())
    assert "model.safetensors" in written and "tokenizer.json" in written
    with pytest.raises(OSError, match="disk full"):
        write_base(tiny_llama(seed=1), _Failing(), base)  # a rewrite that fails keeps the base as it was
    assert sorted(p.name for p in base.iterdir()) == written and [p.name for p in tmp_path.iterdir()] == ["base"]
