"""GGUF vocabularies → ``tokenizers`` objects that reproduce llama.cpp's tokenizers.

Only ``tokenizer.ggml.model = "llama"`` (SentencePiece BPE, llama.cpp's ``LLAMA_VOCAB_TYPE_SPM``)
is supported. llama.cpp's SPM tokenizer (``src/llama-vocab.cpp``, ``llm_tokenizer_spm_session``)
works like SentencePiece's BPE model:

1. Split special tokens out of the raw text first (``tokenizer_st_partition``): user-defined
   tokens always, control/unknown tokens only when special-token parsing is on.
2. In every remaining text fragment, prepend a space (``add_space_prefix``, default true) and
   replace each ``" "`` with ``"▁"`` (U+2581).
3. Start from single UTF-8 characters and repeatedly merge the adjacent pair whose concatenation
   is a vocabulary token with the highest score (ties: leftmost pair).
4. Any remaining symbol that is not a token becomes its UTF-8 bytes as ``<0xXX>`` tokens.

A ``tokenizers`` BPE model with byte fallback does steps 3-4 when its merge ranks follow the
merged token's score, which is how HF transformers converts SentencePiece models
(``SentencePieceExtractor`` / ``generate_merges``). Step 1 maps to added tokens (special ones are
kept as plain text by ``encode_special_tokens``), step 2 to a Prepend + Replace normalizer, which
``tokenizers`` applies to each fragment between added tokens, as llama.cpp prefixes the text
after every special token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from zllm.spec.errors import CheckpointError

SUPPORTED_GGUF_TOKENIZER_MODELS = ("llama",)

# llama.cpp's llama_token_type / LLAMA_TOKEN_ATTR_* values as stored in tokenizer.ggml.token_type
# (gguf-py: gguf.constants.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

SPIECE_UNDERLINE = "\u2581"


class GGUFVocab:
    """The tokenizer facts of a GGUF file, decoded from its ``tokenizer.ggml.*`` metadata.

    Attributes:
        hf: the ``tokenizers.Tokenizer`` (no post-processor: BOS/EOS are the caller's job).
        bos_token_id, eos_token_ids, add_bos, add_eos: as llama.cpp reads them, with its SPM
            defaults when a key is absent (bos 1, eos 2, add_bos true, add_eos false).
    """

    def __init__(self, hf: HFTokenizer, bos_token_id: int | None, eos_token_ids: tuple[int, ...], add_bos: bool, add_eos: bool):
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.add_eos = add_eos


def _key(meta: Mapping[str, Any], key: str, source: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise CheckpointError(source, f"metadata key {key!r} has type {type(value).__name__}, expected {kind}")
    return value


def vocab_from_gguf_metadata(meta: Mapping[str, Any], source: str) -> GGUFVocab:
    """Build the tokenizer described by a GGUF file's ``tokenizer.ggml.*`` keys.

    Args:
        meta: decoded GGUF key/value pairs, ``{k: f.contents() for k, f in reader.fields.items()}``.
        source: the file the metadata came from, for error messages.

    Raises:
        CheckpointError: no ``tokenizer.ggml.model`` key, an unsupported model (the message lists
            the supported ones), missing or inconsistent token lists, duplicate token texts.
    """
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise CheckpointError(source, "no 'tokenizer.ggml.model' key: the file holds no vocabulary")
    if model not in SUPPORTED_GGUF_TOKENIZER_MODELS:
        raise CheckpointError(
            source,
            f"unsupported tokenizer.ggml.model {model!r}; supported: "
            + ", ".join(repr(m) for m in SUPPORTED_GGUF_TOKENIZER_MODELS),
        )
    return _spm_vocab(meta, source)


def _spm_vocab(meta: Mapping[str, Any], source: str) -> GGUFVocab:
    tokens = _key(meta, "tokenizer.ggml.tokens", source, list)
    if not tokens:
        raise CheckpointError(source, "'tokenizer.ggml.tokens' is missing or empty")
    scores = _key(meta, "tokenizer.ggml.scores", source, list)
    if scores is None:
        # SentencePiece BPE merge order is the piece score; without scores there is no model.
        raise CheckpointError(source, "'tokenizer.ggml.scores' is missing; a llama (SentencePiece) vocabulary needs it")
    # llama.cpp treats a missing type list as all-normal tokens (llama_vocab::impl::load).
    types = _key(meta, "tokenizer.ggml.token_type", source, list, [TOKEN_TYPE_NORMAL] * len(tokens))
    if not len(tokens) == len(scores) == len(types):
        raise CheckpointError(
            source, f"token lists disagree: {len(tokens)} tokens, {len(scores)} scores, {len(types)} token types"
        )
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if text in vocab:
            raise CheckpointError(source, f"token text {text!r} appears twice (ids {vocab[text]} and {i})")
        vocab[text] = i

    n = len(tokens)
    # Defaults for SPM vocabularies: llama_vocab::impl::load, LLAMA_VOCAB_TYPE_SPM branch.
    bos_id = _key(meta, "tokenizer.ggml.bos_token_id", source, int, 1)
    eos_id = _key(meta, "tokenizer.ggml.eos_token_id", source, int, 2)
    unk_id = _key(meta, "tokenizer.ggml.unknown_token_id", source, int, 0)
    add_bos = _key(meta, "tokenizer.ggml.add_bos_token", source, bool, True)
    add_eos = _key(meta, "tokenizer.ggml.add_eos_token", source, bool, False)
    add_space_prefix = _key(meta, "tokenizer.ggml.add_space_prefix", source, bool, True)
    for name, tid in (("bos", bos_id), ("eos", eos_id), ("unknown", unk_id)):
        if not 0 <= tid < n:
            raise CheckpointError(source, f"tokenizer.ggml.{name}_token_id {tid} is outside the vocabulary (0..{n - 1})")
    # End-of-turn / end-of-message ids also end generation (llama.cpp's end-of-generation set).
    eos_ids = [eos_id]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _key(meta, key, source, int)
        if extra is not None and 0 <= extra < n and extra not in eos_ids:
            eos_ids.append(extra)

    has_bytes = any(t == TOKEN_TYPE_BYTE for t in types)
    bpe = BPE(
        vocab=vocab,
        merges=_merges_by_score(tokens, scores, vocab),
        unk_token=tokens[unk_id],
        fuse_unk=True,
        byte_fallback=has_bytes,
    )
    hf = HFTokenizer(bpe)
    steps = [normalizers.Replace(" ", SPIECE_UNDERLINE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_UNDERLINE))
    hf.normalizer = normalizers.Sequence(steps)
    hf.pre_tokenizer = None
    dec = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(dec)

    # Control and unknown tokens are special (skipped when decoding, text unless parse_special);
    # user-defined tokens are always split out and always rendered (llama.cpp token attributes).
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == TOKEN_TYPE_USER_DEFINED
    ]
    hf.add_special_tokens(special)
    hf.add_tokens(user)
    return GGUFVocab(hf, bos_id, tuple(eos_ids), add_bos, add_eos)


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary: every split of every token into two tokens.

    Ranked by the merged token's score, highest first (llama.cpp merges the highest-scoring
    bigram first); equal scores by merged token id. Same construction as transformers'
    ``generate_merges`` with ``vocab_scores``.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for tid, text in enumerate(tokens):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[tid], tid, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]
