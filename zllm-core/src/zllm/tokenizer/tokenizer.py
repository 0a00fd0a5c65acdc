"""Tokenizer: text ↔ token ids, from an HF ``tokenizer.json`` or a GGUF vocabulary.

Both sources end up as a ``tokenizers.Tokenizer`` without a post-processor; this class adds
BOS/EOS itself from explicit ``add_bos``/``add_eos`` flags, so both paths share one rule.

Special-token text typed by a user (``"</s>"``) is plain text unless ``parse_special=True``,
as in llama.cpp (``parse_special``) and transformers (``split_special_tokens=True``).

Chat templates (Jinja source text) travel with the tokenizer; :mod:`zllm.tokenizer.chat`
renders them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from zllm.spec.errors import CheckpointError
from zllm.tokenizer.gguf_vocab import vocab_from_gguf_metadata

# Post-processor types whose only effect on ids is special tokens around the text.
_SUPPORTED_POST_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel", "Sequence")


class Tokenizer:
    """Encode and decode text for one model.

    Build with :meth:`from_hf_files`, :meth:`from_gguf_metadata` or :meth:`from_gguf_file`.

    Attributes (read-only properties):
        source: the file the vocabulary came from.
        vocab_size: number of token ids, added tokens included.
        bos_token_id: the beginning-of-sequence id, or ``None`` if the model has none.
        eos_token_ids: ids that end generation; the first is the one ``add_eos`` appends.
        add_bos, add_eos: whether ``encode(..., add_special_tokens=True)`` adds them.
        special_token_ids: ids of special (control) tokens, which ``skip_special_tokens`` drops.
        byte_fallback_ids: ids of the ``<0xXX>`` byte tokens of a byte-fallback BPE model.
        chat_template: the default chat template (Jinja source), or ``None``.
        chat_templates: every named chat template (``"default"`` included when there is one).
        bos_token, eos_token: the text of the BOS / first EOS token (what templates see as
            ``bos_token`` / ``eos_token``), or ``None``.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        source: str,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
        add_eos: bool,
        chat_templates: Mapping[str, str] | None = None,
    ):
        """Wrap ``hf``, taking ownership: its post-processor is removed, since BOS/EOS are added
        here from ``add_bos``/``add_eos``. Prefer the ``from_*`` constructors.

        Raises:
            CheckpointError: ``add_bos``/``add_eos`` is set but there is no BOS/EOS id.
        """
        if add_bos and bos_token_id is None:
            raise CheckpointError(source, "add_bos_token is true but the tokenizer has no BOS token")
        if add_eos and not eos_token_ids:
            raise CheckpointError(source, "add_eos_token is true but the tokenizer has no EOS token")
        hf.post_processor = None
        self._hf = hf
        # Whether special-token text is parsed is the tokenizer's own state
        # (encode_special_tokens), set for each encode under this lock so that concurrent
        # encodes cannot see each other's setting (a second copy of the tokenizer with the
        # other setting doubled its memory and load time).
        self._encode_lock = threading.Lock()
        self._source = source
        self._bos = bos_token_id
        self._eos = eos_token_ids
        self._add_bos = add_bos
        self._add_eos = add_eos
        self._vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
        byte_ids: set[int] = set()
        if isinstance(hf.model, BPE) and hf.model.byte_fallback:
            found = (hf.token_to_id(f"<0x{b:02X}>") for b in range(256))
            byte_ids = {i for i in found if i is not None} - self._special_ids
        self._byte_ids = frozenset(byte_ids)
        self._chat_templates = dict(chat_templates or {})

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: Path | str,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template_files: Mapping[str, str] | None = None,
    ) -> Tokenizer:
        """Load an HF ``tokenizer.json`` with the contents of its sibling config files.

        BOS/EOS: ``bos_token``/``eos_token`` and ``add_bos_token``/``add_eos_token`` of
        ``tokenizer_config.json`` win when present (transformers' ``LlamaTokenizerFast``
        rebuilds its post-processor from them); otherwise they are read from the
        ``tokenizer.json`` post-processor (special tokens before / after ``$A`` in the single
        template; ``cls``/``sep`` of Bert/Roberta processing). ``eos_token_id`` of
        ``generation_config.json`` (int or list) adds stop ids after the tokenizer's EOS.
        transformers' ``clean_up_tokenization_spaces`` is not applied by :meth:`decode`.

        Chat templates, as transformers 5 loads them: the checkpoint's template files when
        there are any (``chat_template.jinja`` is ``"default"``,
        ``additional_chat_templates/NAME.jinja`` is ``NAME``), else ``chat_template`` of
        ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``).

        Args:
            tokenizer_json: path of ``tokenizer.json``.
            tokenizer_config: parsed ``tokenizer_config.json``, if the checkpoint has one.
            generation_config: parsed ``generation_config.json``, if the checkpoint has one.
            chat_template_files: template name → text of the checkpoint's ``.jinja`` files.

        Raises:
            CheckpointError: the file is missing or unreadable, its post-processor is of a
                type that does more than add special tokens, a named special token is not
                in the vocabulary, or ``chat_template`` has the wrong shape.
        """
        path = str(tokenizer_json)
        try:
            text = Path(tokenizer_json).read_text(encoding="utf-8")
            spec = json.loads(text)
            hf = HFTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - tokenizers reports a bad file as a plain Exception
            raise CheckpointError(path, f"cannot load tokenizer: {exc}") from exc
        config = dict(tokenizer_config or {})

        prefix, suffix = _post_processor_specials(spec.get("post_processor"), path)

        def config_id(key: str) -> int | None:
            tok = config.get(key)
            if isinstance(tok, Mapping):  # serialized AddedToken
                tok = tok.get("content")
            if tok is None:
                return None
            tid = hf.token_to_id(tok)
            if tid is None:
                raise CheckpointError(path, f"tokenizer_config {key} {tok!r} is not in the vocabulary")
            return tid

        bos = config_id("bos_token")
        if bos is None and len(prefix) == 1:
            bos = prefix[0]
        eos = config_id("eos_token")
        if eos is None and len(suffix) == 1:
            eos = suffix[0]
        eos_ids = [eos] if eos is not None else []
        gen_eos = (generation_config or {}).get("eos_token_id")
        for tid in [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []):
            if tid not in eos_ids:
                eos_ids.append(tid)

        add_bos = _template_flag(config, "add_bos_token", prefix, bos, "before", path)
        add_eos = _template_flag(config, "add_eos_token", suffix, eos, "after", path)
        templates = dict(chat_template_files or {}) or _config_chat_templates(
            config.get("chat_template"), str(Path(path).with_name("tokenizer_config.json")))
        return cls(hf, source=path, bos_token_id=bos, eos_token_ids=tuple(eos_ids), add_bos=add_bos, add_eos=add_eos,
                   chat_templates=templates)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str) -> Tokenizer:
        """Build the tokenizer stored in GGUF metadata (see :mod:`zllm.tokenizer.gguf_vocab`).

        Args:
            meta: decoded key/values, ``{k: f.contents() for k, f in GGUFReader(p).fields.items()}``.
            source: the GGUF file's path, for messages and :attr:`source`.

        Raises:
            CheckpointError: no vocabulary, an unsupported ``tokenizer.ggml.model`` (the
                message names it and lists the supported ones), inconsistent token lists.
        """
        v = vocab_from_gguf_metadata(meta, source)
        return cls(
            v.hf, source=source, bos_token_id=v.bos_token_id, eos_token_ids=v.eos_token_ids, add_bos=v.add_bos,
            add_eos=v.add_eos, chat_templates=v.chat_templates,
        )

    @classmethod
    def from_gguf_file(cls, path: Path | str) -> Tokenizer:
        """Read a GGUF file's metadata with ``gguf.GGUFReader`` and build its tokenizer.

        Vocabulary-only files (no tensors) are fine.

        Raises:
            CheckpointError: the file is missing, truncated or not GGUF, or as
                :meth:`from_gguf_metadata`.
        """
        import gguf  # the reader pulls in numpy memmaps; only GGUF users pay for it

        source = str(path)
        try:
            reader = gguf.GGUFReader(source)
            meta = {k: f.contents() for k, f in reader.fields.items()}
        except OSError as exc:
            raise CheckpointError(source, f"cannot read GGUF file: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - GGUFReader reports corrupt data as ValueError, IndexError, struct errors…
            raise CheckpointError(source, f"corrupt or truncated GGUF file: {type(exc).__name__}: {exc}") from exc
        return cls.from_gguf_metadata(meta, source)

    # -- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text.
            add_special_tokens: prepend BOS / append EOS as :attr:`add_bos` / :attr:`add_eos` say.
            parse_special: turn special-token text (``"<s>"``) into its id; by default it is
                tokenized as plain text. Non-special added tokens are always matched.
        """
        ids = self._encode(text, parse_special).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self._bos)
            if self._add_eos:
                ids.append(self._eos[0])
        return ids

    def encode_keeping_plain(self, text: str, plain_spans: Sequence[tuple[int, int]]) -> list[int]:
        """Token ids of ``text`` with special-token text parsed, except inside ``plain_spans``.

        A special token whose text overlaps a span ``[start, end)`` (character offsets) stays
        plain text; the text between the special tokens that are kept is encoded as by
        ``encode(..., parse_special=False)``. No BOS/EOS is added. With no overlap this equals
        ``encode(text, add_special_tokens=False, parse_special=True)`` up to added tokens with
        ``lstrip``/``rstrip``, which GGUF vocabularies never have.
        """
        enc = self._encode(text, parse_special=True)
        ids: list[int] = []
        pos = 0
        for tid, (start, end) in zip(enc.ids, enc.offsets, strict=True):
            if tid not in self._special_ids or any(start < b and a < end for a, b in plain_spans):
                continue
            if start > pos:
                ids += self._encode(text[pos:start], parse_special=False).ids
            ids.append(tid)
            pos = end
        if pos < len(text):
            ids += self._encode(text[pos:], parse_special=False).ids
        return ids

    def _encode(self, text: str, parse_special: bool):
        """``tokenizers`` encoding of ``text`` without BOS/EOS, special-token text parsed or not."""
        with self._encode_lock:
            self._hf.encode_special_tokens = not parse_special
            return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (the ``tokenizers`` decoder; ``<0xXX>`` runs that are not valid
        UTF-8 decode to one U+FFFD per byte token).

        Raises:
            ValueError: an id is outside ``0..vocab_size-1``.
        """
        ids = list(ids)
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise ValueError(
                    f"token id {i} is outside the vocabulary (0..{self._vocab_size - 1}) of {self._source}"
                )
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The vocabulary as ``tokenizers`` JSON (``tokenizer.json``'s format, without a
        post-processor), for libraries that build their own token table from it."""
        return self._hf.to_str()

    def token_to_id(self, token: str) -> int | None:
        """The id of the token whose text is ``token``, or ``None``."""
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The text of token ``token_id`` as stored in the vocabulary (``▁`` not unescaped), or ``None``."""
        return self._hf.id_to_token(token_id)

    # -- properties --------------------------------------------------------------------------

    @property
    def source(self) -> str:
        return self._source

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        return self._byte_ids

    @property
    def special_token_texts(self) -> tuple[str, ...]:
        """The text of every special token (what ``parse_special`` turns into an id)."""
        return tuple(str(self._hf.id_to_token(i)) for i in sorted(self._special_ids))

    @property
    def chat_template(self) -> str | None:
        return self._chat_templates.get("default")

    @property
    def chat_templates(self) -> dict[str, str]:
        return dict(self._chat_templates)

    @property
    def bos_token(self) -> str | None:
        return None if self._bos is None else self._hf.id_to_token(self._bos)

    @property
    def eos_token(self) -> str | None:
        return self._hf.id_to_token(self._eos[0]) if self._eos else None

    def __repr__(self) -> str:
        return f"Tokenizer(source={self._source!r}, vocab_size={self._vocab_size})"


def _config_chat_templates(value: Any, path: str) -> dict[str, str]:
    """``chat_template`` of ``tokenizer_config.json``: a string (the default template) or a list
    of ``{"name": ..., "template": ...}`` (transformers' multi-template form).

    Raises:
        CheckpointError: any other shape.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(
        path, "tokenizer_config chat_template must be a string or a list of {\"name\": ..., \"template\": ...} objects"
    )


def _template_flag(
    config: Mapping[str, Any], key: str, ids: list[int], token_id: int | None, where: str, path: str
) -> bool:
    """Whether to add BOS (EOS): ``config[key]`` when present, else whether the post-processor does.

    Raises:
        CheckpointError: the post-processor adds anything but that one token.
    """
    if key in config:
        return bool(config[key])
    if ids and ids != [token_id]:
        raise CheckpointError(
            path,
            f"post-processor adds ids {ids} {where} the text; zllm supports only the tokenizer's own BOS/EOS there",
        )
    return bool(ids)


def _post_processor_specials(pp: Mapping[str, Any] | None, path: str) -> tuple[list[int], list[int]]:
    """Ids a ``tokenizer.json`` post-processor puts before and after a single sequence.

    Raises:
        CheckpointError: a post-processor type outside ``_SUPPORTED_POST_PROCESSORS``.
    """
    if pp is None:
        return [], []
    kind = pp.get("type")
    if kind == "Sequence":
        prefix: list[int] = []
        suffix: list[int] = []
        for sub in pp.get("processors", []):
            p, s = _post_processor_specials(sub, path)
            prefix += p
            suffix = s + suffix
        return prefix, suffix
    if kind == "ByteLevel":
        return [], []
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [pp["cls"][1]], [pp["sep"][1]]
    if kind == "TemplateProcessing":
        prefix, suffix = [], []
        seen_sequence = False
        for piece in pp["single"]:
            if "Sequence" in piece:
                seen_sequence = True
                continue
            ids = pp["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
            (suffix if seen_sequence else prefix).extend(ids)
        return prefix, suffix
    raise CheckpointError(
        path, f"unsupported post_processor type {kind!r}; supported: {', '.join(_SUPPORTED_POST_PROCESSORS)}"
    )
