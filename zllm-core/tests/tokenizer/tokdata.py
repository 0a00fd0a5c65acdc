"""Test data for the tokenizer tests: paths of the small real vocabularies in ``assets/models``,
llama.cpp's tokenizer test vectors, and hypothesis strategies for text.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st

# DESIGN.md "Data in ../shared": the repository's sibling folder holds the model files.
MODELS = Path(__file__).resolve().parents[3] / "assets" / "models"
VOCABS = MODELS / "llama.cpp-vocab"
STORIES_HF = MODELS / "stories260k" / "hf"
STORIES_GGUF = MODELS / "stories260k" / "gguf" / "stories260K-f32.gguf"
TINY_RANDOM_GGUF = MODELS / "llama-2-tiny-random-gguf" / "llama-2-tiny-random.gguf"

# Llama-3-Instruct's chat template, shortened: BOS in the template, content trimmed, helpers.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

VOCAB_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def read_vocab_vectors(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of llama.cpp's ``ggml-vocab-NAME.gguf.inp``/``.out`` test vectors.

    Each input string is *terminated* by the separator (llama.cpp's test-tokenizer-0 splits on
    it), so the split leaves one empty trailing element, which is not a test case; the empty
    string earlier in the file is one.
    """
    inp = (VOCABS / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    out = (VOCABS / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8")
    texts = inp.split(VOCAB_TEST_SEPARATOR)
    assert texts[-1] == "", "the .inp file must end with a separator"
    texts = texts[:-1]
    lines = out.split("\n")
    assert lines[-1] == ""
    ids = [[int(t) for t in line.split()] for line in lines[:-1]]
    assert len(texts) == len(ids), (len(texts), len(ids))
    return list(zip(texts, ids, strict=True))


def load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


# Pieces that stress the tokenizers: leading/repeated spaces, newlines, tabs, special-token
# text, the ▁ meta symbol itself, byte-fallback material (emoji, CJK, Khmer, combining marks).
FRAGMENTS = [
    " ", "  ", "   ", "\n", "\n\n", "\t", "Hello", "hello", " world", "Zoo", "Once upon a time",
    "Lily", "'s", "!", "?", ".", ",", "3", "333", "<s>", "</s>", "<unk>", "<0x41>", "<", ">",
    "\u2581", "é", "Äpfel", "ñ", "🦙", "😁", "🚀", "😶\u200d🌫️", "✅", "中文", "我想在", "天～",
    "нещо", "Cửa Việt", "ពិសេស", "e\u0301", "\u00a0", "\r\n",
]

texts = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
    st.text(max_size=24),
)
