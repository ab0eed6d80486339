"""A record far longer than the window is tokenized only where its kept tokens come from (issue 46: one 50 MB record
took 10.5 GB of peak memory and 165 s, tokenized whole for a window of 256 tokens; measured here before the change:
2 MB took 313 MB and 13-16 s on a loaded 2-core machine, growing with the record). The example is the same: the
prompt's first token and its end, the response's start, as the whole text's tokenization gives them."""

from __future__ import annotations

import subprocess
import sys
from pydoc_data.topics import topics

from hf_llmkit.data import sft
from hf_llmkit.data.sft import ALPACA, tokenize_record
from hf_llmkit.testing import corpus_tokenizer, minilm_path

TEXT = "\n\n".join(topics[key] for key in sorted(topics))  # 465K characters of English and code


def _tokenizers():
    from transformers import AutoTokenizer

    yield "byte-level BPE", corpus_tokenizer()
    yield "WordPiece", AutoTokenizer.from_pretrained(minilm_path())


RECORDS = {
    "long response": {"instruction": "Summarise the reference.", "input": "", "output": TEXT[:90_000]},
    "long prompt": {"instruction": TEXT[:50_000], "input": TEXT[-40_000:], "output": "It is Python's reference."},
    "both long": {"instruction": TEXT[100_000:190_000], "input": "", "output": TEXT[200_000:290_000]},
    "short": {"instruction": "Say hi.", "input": "", "output": "Hi."},
}


def test_the_example_is_the_whole_texts_tokens(monkeypatch, length=48):
    real, tokenized = sft._ids, []
    monkeypatch.setattr(sft, "_ids", lambda tokenizer, text: tokenized.append(len(text)) or real(tokenizer, text))
    for name, tokenizer in _tokenizers():
        got = {
            key: tokenize_record(r, tokenizer, template=ALPACA, max_seq_length=length) for key, r in RECORDS.items()
        }
        assert max(tokenized) < 50_000, name  # no long text was tokenized whole
        with monkeypatch.context() as whole:
            whole.setattr(sft, "_CHARS_PER_TOKEN_FACTOR", 10**9)  # every text tokenized whole
            want = {
                key: tokenize_record(r, tokenizer, template=ALPACA, max_seq_length=length)
                for key, r in RECORDS.items()
            }
        for key in RECORDS:
            assert got[key] == want[key], f"{name}, {key}"
        assert [want[k][1] for k in RECORDS][:3] == ["response", "prompt", "response"]
        tokenized.clear()


PROBE = """
import resource, sys, time
from hf_llmkit.data.sft import ALPACA, tokenize_record
from hf_llmkit.testing import corpus_tokenizer
tokenizer = corpus_tokenizer()
tokenize_record({"instruction": "a", "input": "", "output": "b"}, tokenizer, template=ALPACA, max_seq_length=256)
text = open(sys.argv[1], encoding="utf-8").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
example, cut = tokenize_record({"instruction": "Summarise.", "input": "", "output": text}, tokenizer, template=ALPACA,
                               max_seq_length=256)
print(len(example["input_ids"]), cut, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10,
      time.perf_counter() - start)
"""


def test_an_8_mb_record_takes_what_a_short_one_does(tmp_path):
    record = tmp_path / "long.txt"
    record.write_text((TEXT * (8_000_000 // len(TEXT) + 1))[:8_000_000], encoding="utf-8")
    out = subprocess.run([sys.executable, "-c", PROBE, str(record)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tokens, cut, peak_mb, seconds = out.stdout.split()
    assert (tokens, cut) == ("256", "response")
    assert int(peak_mb) < 128 and float(seconds) < 30  # tokenized whole: over 1.2 GB and a minute
