"""GGUF vocabularies → ``tokenizers`` objects that reproduce llama.cpp's tokenizers.

Two vocabulary types are supported: ``tokenizer.ggml.model = "llama"`` (SentencePiece BPE,
llama.cpp's ``LLAMA_VOCAB_TYPE_SPM``) and ``"gpt2"`` (byte-level BPE, ``LLAMA_VOCAB_TYPE_BPE``;
see :func:`_bpe_vocab`). llama.cpp's SPM tokenizer (``src/llama-vocab.cpp``, ``llm_tokenizer_spm_session``)
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

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from zllm.spec.errors import CheckpointError
from zllm.tokenizer.bpe_pre import BPE_PRE_TYPES_BY_NAME, BPEPreType

log = logging.getLogger(__name__)

SUPPORTED_GGUF_TOKENIZER_MODELS = ("llama", "gpt2")

# llama.cpp's llama_token_type / LLAMA_TOKEN_ATTR_* values as stored in tokenizer.ggml.token_type
# (gguf-py: gguf.constants.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

# llama_vocab::impl::load finds end-of-generation and FIM tokens by their text and makes a
# control token of any that the file typed otherwise ("control-looking token ... its type will
# be overridden"). End of generation: its EOG list, the EOT/EOM candidates and the FIM
# pad/repo/file-separator tokens.
EOG_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})
FIM_TOKEN_TEXTS = frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
    "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
    "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
    "\u2581<MID>", "<|code_middle|>", "<|middle|>",
})
# gpt-oss harmony markers llama.cpp always renders (user-defined), whatever the file says.
ALWAYS_RENDERED_TOKEN_TEXTS = frozenset(
    {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}
)

SPIECE_UNDERLINE = "\u2581"


class GGUFVocab:
    """The tokenizer facts of a GGUF file, decoded from its ``tokenizer.ggml.*`` metadata.

    Attributes:
        hf: the ``tokenizers.Tokenizer`` (no post-processor: BOS/EOS are the caller's job).
        bos_token_id, eos_token_ids, add_bos, add_eos: as llama.cpp reads them, with its
            defaults when a key is absent (SPM: bos 1, eos 2, add_bos true, add_eos false;
            BPE: see :func:`_bpe_vocab`).
        chat_templates: ``tokenizer.chat_template`` as ``"default"`` and every
            ``tokenizer.chat_template.NAME`` as ``NAME``; empty when the file has none.
    """

    def __init__(self, hf: HFTokenizer, bos_token_id: int | None, eos_token_ids: tuple[int, ...], add_bos: bool,
                 add_eos: bool, chat_templates: dict[str, str] | None = None):
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_templates = dict(chat_templates or {})


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
    vocab = _bpe_vocab(meta, source) if model == "gpt2" else _spm_vocab(meta, source)
    vocab.chat_templates = _chat_templates(meta, source)
    return vocab


CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def _chat_templates(meta: Mapping[str, Any], source: str) -> dict[str, str]:
    """``tokenizer.chat_template`` (as ``"default"``) and ``tokenizer.chat_template.NAME`` keys
    (llama.cpp's ``LLM_KV_TOKENIZER_CHAT_TEMPLATE`` with an optional name suffix)."""
    templates: dict[str, str] = {}
    for key in meta:
        if key == CHAT_TEMPLATE_KEY or key.startswith(CHAT_TEMPLATE_KEY + "."):
            name = key[len(CHAT_TEMPLATE_KEY) + 1 :] or "default"
            templates[name] = _key(meta, key, source, str)
    return templates


def _token_table(meta: Mapping[str, Any], source: str) -> tuple[list[str], list[int], dict[str, int]]:
    """Tokens, token types (llama.cpp treats a missing list as all normal; then corrected by
    :func:`_apply_llama_cpp_token_rules`) and text → id.

    Raises:
        CheckpointError: no tokens, lists of different lengths, a token text given twice.
    """
    tokens = _key(meta, "tokenizer.ggml.tokens", source, list)
    if not tokens:
        raise CheckpointError(source, "'tokenizer.ggml.tokens' is missing or empty")
    types = _key(meta, "tokenizer.ggml.token_type", source, list, [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(source, f"token lists disagree: {len(tokens)} tokens, {len(types)} token types")
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if text in vocab:
            raise CheckpointError(source, f"token text {text!r} appears twice (ids {vocab[text]} and {i})")
        vocab[text] = i
    return tokens, _apply_llama_cpp_token_rules(tokens, types), vocab


def _add_typed_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens are special (skipped when decoding, text unless
    parse_special); user-defined tokens are always split out and always rendered (llama.cpp
    token attributes; its ``tokenizer_st_partition`` matches their raw text)."""
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


def _special_id(meta: Mapping[str, Any], key: str, source: str, n: int, default: int | None) -> int | None:
    tid = _key(meta, key, source, int, default)
    if tid is not None and not 0 <= tid < n:
        raise CheckpointError(source, f"{key} {tid} is outside the vocabulary (0..{n - 1})")
    return tid


def _apply_llama_cpp_token_rules(tokens: list[str], types: list[int]) -> list[int]:
    """Token types after llama.cpp's by-text corrections (``llama_vocab::impl::load``):
    end-of-generation and FIM tokens become control tokens, gpt-oss's harmony markers become
    user-defined, and the harmony / Solar ``<|end|>`` and Gemma 4's ``</s>`` lose their
    end-of-generation role (:func:`_eog_ids`) and become user-defined / normal tokens.
    llama.cpp overrides only the first FIM candidate per role it meets; this overrides all."""
    types = list(types)
    index = {t: i for i, t in enumerate(tokens)}
    for text in (EOG_TOKEN_TEXTS | FIM_TOKEN_TEXTS) & index.keys():
        types[index[text]] = TOKEN_TYPE_CONTROL
    for text in ALWAYS_RENDERED_TOKEN_TEXTS & index.keys():
        types[index[text]] = TOKEN_TYPE_USER_DEFINED
    if "<|end|>" in index and _end_is_not_eog(index.keys()):
        types[index["<|end|>"]] = TOKEN_TYPE_USER_DEFINED
    if "</s>" in index and _eos_marker_is_normal(index.keys()):
        types[index["</s>"]] = TOKEN_TYPE_NORMAL
    return types


def _end_is_not_eog(texts) -> bool:
    # o200k_harmony ends a message with <|return|> / <|call|>, Solar with <|calls|> / <|flush|>.
    harmony = "<|return|>" in texts and "<|call|>" in texts
    return harmony or ("<|calls|>" in texts and "<|flush|>" in texts)


def _eos_marker_is_normal(texts) -> bool:
    return "<|tool_response>" in texts or "<|plamo:eos|>" in texts


def _eog_ids(
    meta: Mapping[str, Any], source: str, tokens: list[str], eos_id: int | None
) -> tuple[int, ...]:
    """The ids that end generation, as llama.cpp's ``special_eog_ids``: EOS, the
    ``eot_token_id`` / ``eom_token_id`` keys, then every token whose text is in
    :data:`EOG_TOKEN_TEXTS` (by id), less the exceptions of :func:`_apply_llama_cpp_token_rules`.
    EOS comes first: it is the id ``add_eos`` appends."""
    n = len(tokens)
    eog = [] if eos_id is None else [eos_id]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _key(meta, key, source, int)
        if extra is not None and 0 <= extra < n and extra not in eog:
            eog.append(extra)
    texts = set(tokens)
    dropped: set[str] = set()
    if _end_is_not_eog(texts):
        dropped.add("<|end|>")
    if _eos_marker_is_normal(texts):
        dropped.add("</s>")
    eog += [i for i, t in enumerate(tokens) if t in EOG_TOKEN_TEXTS and i not in eog]
    return tuple(i for i in eog if tokens[i] not in dropped)


def _bpe_vocab(meta: Mapping[str, Any], source: str) -> GGUFVocab:
    """A byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``), as llama.cpp's
    ``llm_tokenizer_bpe_session::tokenize`` runs it:

    1. Split special tokens out first (as for SPM: user-defined always, control only when
       special-token parsing is on).
    2. Split each fragment with the regexes of its ``tokenizer.ggml.pre`` type
       (:mod:`zllm.tokenizer.bpe_pre`), then map each piece's UTF-8 bytes to GPT-2's printable
       byte alphabet (``Ġ`` for a space).
    3. A piece that is a token is that token when the type sets ``ignore_merges``; otherwise
       merge pairs by ``tokenizer.ggml.merges`` rank (``"left right"``, split at the first
       space after the first character, as llama.cpp does).

    Steps 2-3 are ``tokenizers``' Split + ByteLevel pre-tokenizers and a BPE model; the
    ByteLevel decoder maps bytes back and decodes UTF-8 (invalid bytes → U+FFFD).

    A file without a ``tokenizer.ggml.pre`` key gets llama.cpp's ``default`` type, with the
    warning llama.cpp prints. Defaults when keys are absent (llama_vocab::impl::load): add_bos
    false unless the pre type sets it, add_eos false. llama.cpp defaults a BPE vocabulary's BOS
    and EOS ids to 11 (a placeholder from GPT-NeoX times); zllm takes no BOS and no EOS instead,
    since token 11 of an arbitrary vocabulary would stop generation at a random word (for
    ``chatglm-bpe`` llama.cpp's own default is no BOS, too).

    Raises:
        CheckpointError: no merges, an unknown ``tokenizer.ggml.pre`` (the message names it
            and lists the known ones), bad token lists or special ids.
    """
    pre = _bpe_pre_type(meta, source)
    tokens, types, vocab = _token_table(meta, source)
    raw_merges = _key(meta, "tokenizer.ggml.merges", source, list)
    if not raw_merges:
        raise CheckpointError(source, "'tokenizer.ggml.merges' is missing or empty; a gpt2 (BPE) vocabulary needs it")
    merges: list[tuple[str, str]] = []
    for rank, merge in enumerate(raw_merges):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise CheckpointError(source, f"tokenizer.ggml.merges[{rank}] {merge!r} is not 'left right'")
        merges.append((merge[:cut], merge[cut + 1 :]))

    n = len(tokens)
    bos_id = _special_id(meta, "tokenizer.ggml.bos_token_id", source, n, None)
    eos_id = _special_id(meta, "tokenizer.ggml.eos_token_id", source, n, None)
    add_bos = _key(meta, "tokenizer.ggml.add_bos_token", source, bool, pre.add_bos)
    add_eos = _key(meta, "tokenizer.ggml.add_eos_token", source, bool, False)

    hf = HFTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    hf.normalizer = None
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    _add_typed_tokens(hf, tokens, types)
    return GGUFVocab(hf, bos_id, _eog_ids(meta, source, tokens, eos_id), add_bos, add_eos)


def _bpe_pre_type(meta: Mapping[str, Any], source: str) -> BPEPreType:
    """The pre type ``tokenizer.ggml.pre`` names; ``default`` when the key is absent.

    Raises:
        CheckpointError: a name that is not in :data:`BPE_PRE_TYPES_BY_NAME`.
    """
    name = _key(meta, "tokenizer.ggml.pre", source, str)
    if name is None:
        log.warning(
            "%s: byte-level BPE vocabulary without 'tokenizer.ggml.pre'; using llama.cpp's 'default' "
            "pre-tokenizer regexes (llama.cpp warns that generation quality will be degraded; consider "
            "regenerating the file)",
            source,
        )
        name = "default"
    pre = BPE_PRE_TYPES_BY_NAME.get(name)
    if pre is None:
        raise CheckpointError(
            source,
            f"unknown pre-tokenizer type tokenizer.ggml.pre {name!r}; known: "
            + ", ".join(sorted(BPE_PRE_TYPES_BY_NAME)),
        )
    return pre


def _spm_vocab(meta: Mapping[str, Any], source: str) -> GGUFVocab:
    tokens, types, vocab = _token_table(meta, source)
    scores = _key(meta, "tokenizer.ggml.scores", source, list)
    if scores is None:
        # SentencePiece BPE merge order is the piece score; without scores there is no model.
        raise CheckpointError(source, "'tokenizer.ggml.scores' is missing; a llama (SentencePiece) vocabulary needs it")
    if len(scores) != len(tokens):
        raise CheckpointError(
            source, f"token lists disagree: {len(tokens)} tokens, {len(scores)} scores, {len(types)} token types"
        )

    n = len(tokens)
    # Defaults for SPM vocabularies: llama_vocab::impl::load, LLAMA_VOCAB_TYPE_SPM branch.
    bos_id = _special_id(meta, "tokenizer.ggml.bos_token_id", source, n, 1)
    eos_id = _special_id(meta, "tokenizer.ggml.eos_token_id", source, n, 2)
    unk_id = _special_id(meta, "tokenizer.ggml.unknown_token_id", source, n, 0)
    assert unk_id is not None  # defaulted: never None
    add_bos = _key(meta, "tokenizer.ggml.add_bos_token", source, bool, True)
    add_eos = _key(meta, "tokenizer.ggml.add_eos_token", source, bool, False)
    add_space_prefix = _key(meta, "tokenizer.ggml.add_space_prefix", source, bool, True)
    eos_ids = _eog_ids(meta, source, tokens, eos_id)

    has_bytes = any(t == TOKEN_TYPE_BYTE for t in types)
    bpe = BPE(
        vocab=vocab,
        merges=_merges_by_score(tokens, scores, vocab),
        unk_token=tokens[unk_id],
        fuse_unk=True,
        byte_fallback=has_bytes,
    )
    hf = HFTokenizer(bpe)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPIECE_UNDERLINE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_UNDERLINE))
    hf.normalizer = normalizers.Sequence(steps)
    hf.pre_tokenizer = None
    dec = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(dec)

    _add_typed_tokens(hf, tokens, types)
    return GGUFVocab(hf, bos_id, eos_ids, add_bos, add_eos)


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary: every split of every token into two tokens.

    Ranked by the merged token's score, highest first (llama.cpp merges the highest-scoring
    bigram first); equal scores by merged token id. Same construction as transformers'
    ``generate_merges`` with ``vocab_scores``.
    """
    ranked: list[tuple[float, int, int]] = []
    for tid, text in enumerate(tokens):
        for cut in range(1, len(text)):
            if text[:cut] in vocab and text[cut:] in vocab:
                ranked.append((-scores[tid], tid, cut))
    ranked.sort()
    return [(tokens[tid][:cut], tokens[tid][cut:]) for _, tid, cut in ranked]
