"""The config contract: what one ``--config`` YAML file may say, checked before anything runs.

A file looks like this (every key but ``model.path`` is optional; defaults shown)::

    schema_version: 1
    model:
      path: ./SmolLM2-135M        # HF checkpoint directory or a .gguf file
      format: auto                # auto | hf | gguf
      dtype: auto                 # auto | f32 | f16 | bf16
    backend:
      name: auto                  # auto or a backend plugin name, e.g. cpu
      device: null                # device index of the first rank (cuda:N); null = each rank its local rank
      threads: null               # null = number of cores (a rank of N on one node: cores / N)
      force_reference: []         # ops that must run their f32 reference, e.g. [linear]
    parallel: {tensor: 1, pipeline: 1, data: 1, timeout_s: 60.0, startup_timeout_s: 600.0}
    runtime:
      kv_cache: {block_size: 16, num_blocks: null, dtype: f32}   # dtype: f32 | f16 | bf16
      max_num_seqs: 8
      max_prefill_tokens: 512
      max_batch_tokens: null      # null = max_num_seqs + max_prefill_tokens
      context_length: null
      prefix_cache_seqs: 4
      batch_invariant: false
    generation: {prompt: "", max_new_tokens: 256, temperature: 0.0, ...}
    server: {host: 127.0.0.1, port: 8000, served_model_name: null, request_timeout_s: null,
             shutdown_timeout_s: 5.0, header_timeout_s: 10.0, max_connections: 256, tool_parser: auto}

Files are read with ruamel.yaml, migrated to :data:`SCHEMA_VERSION` by
:mod:`zllm.spec.migrations`, structured into frozen attrs classes by cattrs, and validated by
the classes' own attrs validators, so ``attrs.evolve(cfg.runtime, max_num_seqs=0)`` is
rejected exactly like the same value in a file. Every failure is one
:class:`~zllm.spec.errors.ConfigError` whose ``path`` is the dotted key path
(``runtime.kv_cache.block_size``).

The value rules (:class:`Check` constants below) are shared with
:mod:`zllm.spec.request`, so a request and the config's ``generation`` defaults accept
the same ranges.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import reprlib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
from attrs import AttrsInstance
from cattrs.gen import make_dict_structure_fn

from zllm.spec.errors import ConfigError
from zllm.spec.migrations import SCHEMA_VERSION, load_yaml_text, migrate

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Value rules, shared by the config and by zllm.spec.request
# ---------------------------------------------------------------------------------------


@attrs.frozen
class Check:
    """One value rule. ``expect`` completes "expected ..." in an error; ``ok`` tests a value."""

    expect: str
    ok: Callable[[Any], bool]

    def or_null(self) -> Check:
        """The same rule, also accepting ``None`` (YAML ``null``, JSON ``null``)."""
        return Check(f"{self.expect} or null", lambda v: v is None or self.ok(v))

    def describe_failure(self, value: Any) -> str:
        """``"expected <expect>, got <value>"``, the value's repr cut to about 60 characters."""
        # Converters have already turned lists into tuples; show what the user wrote.
        shown = list(value) if isinstance(value, tuple) else value
        texts = (
            [value] if isinstance(value, str)
            else [v for v in value if isinstance(v, str)] if isinstance(value, (list, tuple))
            else []
        )
        if any(not _is_unicode(t) for t in texts):
            # A str, but not text: Python decodes undecodable bytes (argv, files) to lone surrogates.
            return (f"expected {self.expect}, got {_short_repr(shown)}, which is not valid Unicode text: it holds "
                    "a lone surrogate (bytes that are not UTF-8?)")
        return f"expected {self.expect}, got {_short_repr(shown)}"


def _is_int(v: Any) -> bool:
    # bool is a subclass of int in Python; `block_size: true` is a mistake, not a 1.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_unicode(v: str) -> bool:
    """False for a str holding a lone surrogate: it cannot be encoded, tokenized or sent as JSON."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and _is_unicode(v)


def _is_number(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _is_list_of(v: Any, item_ok: Callable[[Any], bool], max_len: int | None = None) -> bool:
    # Lists arrive as lists (YAML, JSON) and leave our converters as tuples; accept both.
    # A bare string is not a list of strings: iterating it would yield characters.
    return (
        isinstance(v, (list, tuple))
        and (max_len is None or len(v) <= max_len)
        and all(item_ok(x) for x in v)
    )


def _one_of(*choices: str) -> Check:
    return Check(f"one of {', '.join(map(repr, choices))}", lambda v: isinstance(v, str) and v in choices)


def _make_short_repr() -> Callable[[Any], str]:
    # Repr's keyword arguments need Python 3.12; zllm supports 3.10.
    r = reprlib.Repr()
    r.maxstring = r.maxother = 60
    r.maxlist = r.maxtuple = r.maxdict = 8
    return r.repr


_short_repr = _make_short_repr()

MAX_STOP_STRINGS = 16
"""Most stop strings a request (or the config's defaults) may give; matching cost grows with each."""

POSITIVE_INT = Check("a positive int", lambda v: _is_int(v) and v >= 1)
NON_NEGATIVE_INT = Check("an int >= 0", lambda v: _is_int(v) and v >= 0)
NON_EMPTY_STR = Check("a non-empty string", lambda v: isinstance(v, str) and v != "")
STR = Check("a string", _is_text)
OPTIONAL_BOOL = Check("true, false or null", lambda v: v is None or isinstance(v, bool))
POSITIVE_NUMBER = Check("a number > 0", lambda v: _is_number(v) and v > 0)
NON_NEGATIVE_NUMBER = Check("a number >= 0", lambda v: _is_number(v) and v >= 0)
PORT = Check("an int in 1..65535", lambda v: _is_int(v) and 1 <= v <= 65535)

TEMPERATURE = Check("a number >= 0 (0 = greedy)", lambda v: _is_number(v) and v >= 0)
TOP_P = Check("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1)
TOP_K = Check("an int >= -1 (0 or -1 disables)", lambda v: _is_int(v) and v >= -1)
MIN_P = Check("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1)
REPETITION_PENALTY = Check("a number > 0", lambda v: _is_number(v) and v > 0)
OPENAI_PENALTY = Check("a number in [-2, 2]", lambda v: _is_number(v) and -2 <= v <= 2)
# torch.Generator.manual_seed takes at most 64 bits; a larger seed would fail mid-run.
SEED = Check("an int in [0, 2**64) or null", lambda v: v is None or (_is_int(v) and 0 <= v < 2**64))
STOP = Check(
    f"a list of at most {MAX_STOP_STRINGS} non-empty strings",
    lambda v: _is_list_of(v, lambda x: NON_EMPTY_STR.ok(x) and _is_unicode(x), MAX_STOP_STRINGS),
)
TOKEN_IDS = Check("a list of token ids (ints >= 0)", lambda v: _is_list_of(v, NON_NEGATIVE_INT.ok))
OP_NAMES = Check("a list of non-empty op names", lambda v: _is_list_of(v, NON_EMPTY_STR.ok))


def to_float(v: Any) -> Any:
    """attrs converter: an int becomes a float; anything else is left for the validator to judge."""
    if not _is_int(v):
        return v
    try:
        return float(v)
    except OverflowError:  # an int beyond float range; inf fails every finite-number rule
        return math.inf


def to_tuple(v: Any) -> Any:
    """attrs converter: a list becomes a tuple (frozen classes stay hashable); else unchanged."""
    return tuple(v) if isinstance(v, list) else v


def _fspath(v: Any) -> Any:
    # Python callers may pass a pathlib.Path; YAML always gives a str.
    return os.fspath(v) if isinstance(v, os.PathLike) else v


def unknown_name_message(kind: str, name: object, valid: Iterable[str]) -> str:
    """``"unknown <kind> 'blok_size'; did you mean 'block_size'? valid <kind>s: ..."``.

    The suggestion comes from :func:`difflib.get_close_matches` and is left out when nothing
    is close.
    """
    valid = sorted(valid)
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown {kind} {_short_repr(name)}; {hint}valid {kind}s: {', '.join(valid)}"


def _config_field(check: Check, default: Any = attrs.NOTHING, converter: Callable | None = None) -> Any:
    """An attrs field whose validator raises ConfigError at the field's full key path."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not check.ok(value):
            raise ConfigError(_key_path(type(instance), attribute.name), check.describe_failure(value))

    return attrs.field(default=default, validator=validate, converter=converter)


# ---------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------


@attrs.frozen
class ModelConfig:
    """``model:`` — which weights to load.

    Attributes:
        path: HF checkpoint directory or ``.gguf`` file. Relative paths are resolved
            against the config file's directory; after :func:`config_from_dict` it is an
            absolute path that exists.
        format: ``auto`` | ``hf`` | ``gguf``. ``auto`` is resolved by
            :func:`config_from_dict`: a directory is ``hf``, a file is ``gguf``.
        dtype: ``auto`` (keep the stored dtype) | ``f32`` | ``f16`` | ``bf16``; dense
            weights are converted at load, quantized ones stay quantized.
    """

    path: str = _config_field(NON_EMPTY_STR, converter=_fspath)
    format: str = _config_field(_one_of("auto", "hf", "gguf"), "auto")
    dtype: str = _config_field(_one_of("auto", "f32", "f16", "bf16"), "auto")


@attrs.frozen
class BackendConfig:
    """``backend:`` — where the ops run.

    Attributes:
        name: ``auto`` (pick by declared priority) or a backend plugin name, e.g. ``cpu``.
        device: index of the device the (first) rank runs on, >= 0 (``cuda:1``); with several
            ranks on a node, local rank ``i`` runs on device ``device + i``. ``None`` = device
            ``i`` for local rank ``i`` (device 0 without parallelism). A device-less backend
            (cpu) has one device and ignores it.
        threads: CPU threads, >= 1; ``None`` = the cores this process may use, divided among
            the ranks started on this node (``parallel``), so ranks do not fight for cores.
        force_reference: op names (e.g. ``linear``, ``attention``) whose f32 reference
            kernel runs instead of the backend's. The kernel registry checks the names.
    """

    name: str = _config_field(NON_EMPTY_STR, "auto")
    device: int | None = _config_field(NON_NEGATIVE_INT.or_null(), None)
    threads: int | None = _config_field(POSITIVE_INT.or_null(), None)
    force_reference: tuple[str, ...] = _config_field(OP_NAMES, (), converter=to_tuple)


@attrs.frozen
class KvCacheConfig:
    """``runtime.kv_cache:`` — the paged KV cache.

    Attributes:
        block_size: tokens per cache block, >= 1.
        num_blocks: blocks to allocate, >= 1; ``None`` = sized from free memory.
        dtype: storage type of cached keys and values: ``f32`` (the compute type: exact),
            ``f16`` or ``bf16`` (half the memory and half the bytes a decode step's attention
            reads; keys/values are rounded once when written — llama.cpp caches f16 by
            default, vLLM's ``kv_cache_dtype``). Attention still computes in f32.
    """

    block_size: int = _config_field(POSITIVE_INT, 16)
    num_blocks: int | None = _config_field(POSITIVE_INT.or_null(), None)
    dtype: str = _config_field(_one_of("f32", "f16", "bf16"), "f32")


def _check_max_batch_tokens(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    # A step carries a Decode Round of up to max_num_seqs - 1 sequences next to the one
    # sequence in prefill; the budget must leave that chunk at least one token.
    if not POSITIVE_INT.or_null().ok(value):
        raise ConfigError(_key_path(type(instance), attribute.name), POSITIVE_INT.or_null().describe_failure(value))
    if value is not None and value < instance.max_num_seqs:
        raise ConfigError(_key_path(type(instance), attribute.name),
                          f"expected an int >= runtime.max_num_seqs ({instance.max_num_seqs}) or null, got {value}")


@attrs.frozen
class RuntimeConfig:
    """``runtime:`` — scheduling limits (policy: :mod:`zllm.runtime.scheduler`).

    Attributes:
        kv_cache: see :class:`KvCacheConfig`.
        max_num_seqs: sequences running at once, >= 1.
        max_prefill_tokens: tokens per prefill chunk (chunked prefill), >= 1.
        max_batch_tokens: tokens computed in one step: the Decode Round (one token for every
            running sequence in decode) plus at most one prefill chunk of
            ``min(max_prefill_tokens, max_batch_tokens - decodes)`` tokens, so a long prompt
            is interleaved with running streams rather than stalling them. >=
            ``max_num_seqs``; ``None`` = ``max_num_seqs + max_prefill_tokens`` (decodes
            never shorten a chunk).
        context_length: tokens per sequence, >= 1; ``None`` = the model's own.
        prefix_cache_seqs: finished sequences whose KV is kept for prefix reuse, >= 0.
        batch_invariant: ``true`` binds only kernels declared batch-invariant (each token's
            numbers are bit-identical whatever else runs in the batch: other sequences, row
            count, row position, how a prompt was chunked, prefix reuse, recompute after
            preemption), so a request's tokens never depend on its batch-mates. A backend
            without a batch-invariant kernel for a needed op fails the load naming op and
            backend. ``false`` (default) uses the fastest kernels: results are reproducible
            for the same batch composition and seed, but on CPU a matmul's rounding changes
            with the number of rows (f32 ``[1, K]`` vs ``[16, K]`` against the same weight:
            row 0 differs by up to 3e-6 at K = 64, 3e-5 at K = 512, 5e-5 at K = 1376), which
            can flip a near-tie. Cost on the CPU backend, decode with 8 concurrent
            sequences: 0-15% fewer tokens/s on stories260K, 13-30% on a random Llama of
            hidden 512 (``docs/server.md``, "Batch-invariant mode").
    """

    kv_cache: KvCacheConfig = attrs.Factory(KvCacheConfig)
    max_num_seqs: int = _config_field(POSITIVE_INT, 8)
    max_prefill_tokens: int = _config_field(POSITIVE_INT, 512)
    max_batch_tokens: int | None = attrs.field(default=None, validator=_check_max_batch_tokens)
    context_length: int | None = _config_field(POSITIVE_INT.or_null(), None)
    prefix_cache_seqs: int = _config_field(NON_NEGATIVE_INT, 4)
    batch_invariant: bool = _config_field(Check("true or false", lambda v: isinstance(v, bool)), False)

    @property
    def step_token_budget(self) -> int:
        """``max_batch_tokens`` with its default resolved."""
        return (
            self.max_batch_tokens if self.max_batch_tokens is not None else self.max_num_seqs + self.max_prefill_tokens
        )


@attrs.frozen
class ParallelConfig:
    """``parallel:`` — spreading one model over several processes (:mod:`zllm.parallel`).

    World size = ``tensor * pipeline`` ranks per engine replica; ``data`` replicas run behind
    one HTTP front end. Whether the numbers fit the model (heads, KV heads, layers) is checked
    when its config is read, before any weight is.

    Attributes:
        tensor: tensor-parallel ranks (Megatron-LM style), >= 1; must divide the model's query
            heads, and its KV heads divide it or it divides them.
        pipeline: pipeline stages (contiguous layer ranges), >= 1; at most the model's layers.
        data: engine replicas behind one endpoint, >= 1.
        timeout_s: seconds a collective of a step may wait for a peer before the rank gives up
            (torch's process-group timeout once every rank has loaded); a dead or hung rank ends
            the job within it rather than hanging it. An idle rank 0 keeps the others waiting
            no longer than a fraction of it.
        startup_timeout_s: seconds the ranks may take to meet (the rendezvous) and to load
            their shards, before the first step: import and load times, kept apart from
            :attr:`timeout_s` so a small step bound catches hangs soon.
    """

    tensor: int = _config_field(POSITIVE_INT, 1)
    pipeline: int = _config_field(POSITIVE_INT, 1)
    data: int = _config_field(POSITIVE_INT, 1)
    timeout_s: float = _config_field(POSITIVE_NUMBER, 60.0, converter=to_float)
    startup_timeout_s: float = _config_field(POSITIVE_NUMBER, 600.0, converter=to_float)

    @property
    def world_size(self) -> int:
        """Ranks of one engine replica: ``tensor * pipeline``."""
        return self.tensor * self.pipeline


@attrs.frozen
class GenerationDefaults:
    """``generation:`` — defaults for every request field a request leaves unset.

    Ranges are those of :class:`zllm.spec.request.GenerationRequest`; see
    :class:`zllm.capabilities.ops.SamplingRow` for what each sampling knob does.

    Attributes:
        prompt: the prompt ``zllm run`` uses when none is given on the command line.
        max_new_tokens: tokens to generate at most, >= 1.
        temperature: >= 0; 0 = greedy.
        top_p: in (0, 1]; 1 disables.
        top_k: >= -1; 0 or -1 disables.
        min_p: in [0, 1]; 0 disables.
        repetition_penalty: > 0; 1 disables.
        presence_penalty, frequency_penalty: in [-2, 2]; 0 disables.
        seed: in [0, 2**64) or ``None`` (unseeded).
        stop: up to 16 non-empty strings that end generation.
        stop_token_ids: token ids (>= 0) that end generation.
        add_bos: prepend BOS to text prompts; ``None`` = the tokenizer's default.
    """

    prompt: str = _config_field(STR, "")
    max_new_tokens: int = _config_field(POSITIVE_INT, 256)
    temperature: float = _config_field(TEMPERATURE, 0.0, converter=to_float)
    top_p: float = _config_field(TOP_P, 1.0, converter=to_float)
    top_k: int = _config_field(TOP_K, 0)
    min_p: float = _config_field(MIN_P, 0.0, converter=to_float)
    repetition_penalty: float = _config_field(REPETITION_PENALTY, 1.0, converter=to_float)
    presence_penalty: float = _config_field(OPENAI_PENALTY, 0.0, converter=to_float)
    frequency_penalty: float = _config_field(OPENAI_PENALTY, 0.0, converter=to_float)
    seed: int | None = _config_field(SEED, None)
    stop: tuple[str, ...] = _config_field(STOP, (), converter=to_tuple)
    stop_token_ids: tuple[int, ...] = _config_field(TOKEN_IDS, (), converter=to_tuple)
    add_bos: bool | None = _config_field(OPTIONAL_BOOL, None)


SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft", "mtp")
"""Proposers of speculative decoding (zllm.runtime.speculative)."""


def _check_ngram_sizes(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not POSITIVE_INT.ok(value):
        raise ConfigError(_key_path(type(instance), attribute.name), POSITIVE_INT.describe_failure(value))
    if attribute.name == "max_n" and value < instance.min_n:
        raise ConfigError(_key_path(type(instance), attribute.name),
                          f"expected an int >= speculative.ngram.min_n ({instance.min_n}), got {value}")


@attrs.frozen
class NgramConfig:
    """``speculative.ngram:`` — prompt-lookup proposals.

    Attributes:
        min_n, max_n: the n-gram sizes matched against the sequence's own tokens, longest
            first; ``1 <= min_n <= max_n``.
    """

    min_n: int = attrs.field(default=1, validator=_check_ngram_sizes)
    max_n: int = attrs.field(default=4, validator=_check_ngram_sizes)


@attrs.frozen
class DraftModelConfig(ModelConfig):
    """``speculative.draft.model:`` — the draft model's weights, with the keys of ``model:``
    (its own class only so that its errors name their own key path)."""


@attrs.frozen
class DraftConfig:
    """``speculative.draft:`` — proposals decoded by a smaller model with the same tokenizer
    (:mod:`zllm.runtime.draft`).

    Attributes:
        model: the draft checkpoint, a section shaped like ``model:``; required when
            ``speculative.method`` is ``draft`` (ignored otherwise).
    """

    model: DraftModelConfig | None = None


def _check_draft(instance: Any, attribute: attrs.Attribute, value: DraftConfig) -> None:
    if instance.method == "draft" and value.model is None:
        raise ConfigError("speculative.draft.model", "required key is missing (speculative.method is draft)")


@attrs.frozen
class SpeculativeConfig:
    """``speculative:`` — speculative decoding (:mod:`zllm.runtime.speculative`): a proposer
    guesses up to ``num_tokens`` tokens, one verify step of the model keeps what it agrees
    with. The output is distributed exactly as without it (greedy: the same tokens, bit for
    bit with ``runtime.batch_invariant``).

    Attributes:
        method: the proposer: ``ngram`` (the sequence's own earlier tokens), ``draft`` (a
            smaller model, ``draft.model``), ``mtp`` (the checkpoint's own
            multi-token-prediction layer, DeepSeek-V3's nextn layer), or ``None`` (default)
            for no speculation.
        num_tokens: the most tokens proposed per step, 1..16 (``K``).
        adaptive: adapt each sequence's ``K`` to its measured acceptance, down to none (with
            an occasional probe); ``false`` always proposes ``num_tokens``.
        ngram: see :class:`NgramConfig`.
        draft: see :class:`DraftConfig`.
    """

    method: str | None = _config_field(_one_of(*SPECULATIVE_METHODS).or_null(), None)
    num_tokens: int = _config_field(Check("an int in 1..16", lambda v: _is_int(v) and 1 <= v <= 16), 4)
    adaptive: bool = _config_field(Check("true or false", lambda v: isinstance(v, bool)), True)
    ngram: NgramConfig = attrs.Factory(NgramConfig)
    draft: DraftConfig = attrs.field(factory=DraftConfig, validator=_check_draft)


TOOL_PARSER_FORMATS: tuple[str, ...] = ("harmony", "qwen3_coder", "hermes", "deepseek_v3", "mistral", "llama3_json")
"""The chat formats whose tool calls zllm reads (zllm.engine.tool_parsers declares each)."""
TOOL_PARSERS: tuple[str, ...] = ("auto", "none", *TOOL_PARSER_FORMATS)


@attrs.frozen
class ServerConfig:
    """``server:`` — ``zllm serve``.

    Attributes:
        host: interface to bind, e.g. ``127.0.0.1`` (local only) or ``0.0.0.0``.
        port: TCP port, 1..65535.
        served_model_name: the model id the HTTP APIs report and accept (vLLM's name for
            it); ``None`` = the stem of ``model.path``.
        request_timeout_s: seconds a request may run, from arrival to its last token; when
            it runs out the sequence is aborted and its KV blocks freed within one round,
            and the client gets a 408 (or a last ``error`` event once streaming); a request
            still queued for admission leaves the queue unprefilled. ``None`` = no limit.
        shutdown_timeout_s: seconds a graceful shutdown (SIGTERM, SIGINT) lets running
            requests finish; then each remaining one ends with a 503 (or a last ``error``
            event) and the process exits 0. 0 = end them at once.
        header_timeout_s: seconds a connection may take to send a request's headers (from
            its opening, or from the first byte of a request on a kept-alive connection);
            slower connections are closed (slowloris).
        max_connections: open connections (streaming or not, idle keep-alive ones too) at
            once; a request arriving over it gets a 503.
        tool_parser: how tool calls (and ``<think>`` reasoning) are read from a chat answer:
            ``auto`` (the format the chat template names, see docs/server.md), ``none`` (answers
            stay text), or a format: one of :data:`TOOL_PARSER_FORMATS`.
    """

    host: str = _config_field(NON_EMPTY_STR, "127.0.0.1")
    port: int = _config_field(PORT, 8000)
    served_model_name: str | None = _config_field(NON_EMPTY_STR.or_null(), None)
    request_timeout_s: float | None = _config_field(POSITIVE_NUMBER.or_null(), None, converter=to_float)
    shutdown_timeout_s: float = _config_field(NON_NEGATIVE_NUMBER, 5.0, converter=to_float)
    header_timeout_s: float = _config_field(POSITIVE_NUMBER, 10.0, converter=to_float)
    max_connections: int = _config_field(POSITIVE_INT, 256)
    tool_parser: str = _config_field(_one_of(*TOOL_PARSERS), "auto")


def _check_parallel(instance: Any, attribute: attrs.Attribute, value: ParallelConfig) -> None:
    # The draft and MTP proposers run their own model beside the target's, on one rank only.
    if value.world_size > 1 and instance.speculative.method is not None:
        key = "parallel.tensor" if value.tensor > 1 else "parallel.pipeline"
        raise ConfigError(key, f"speculative decoding (speculative.method: {instance.speculative.method}) runs on "
                               f"one rank; set {key}: 1 or speculative.method: null")


@attrs.frozen(kw_only=True)
class ZllmConfig:
    """One whole config file. Build it with :func:`load_config` or :func:`config_from_dict`;
    override with ``attrs.evolve`` (validators run again).

    Attributes:
        schema_version: always :data:`SCHEMA_VERSION`; older files are migrated first.
        model, backend, runtime, generation, server, speculative, parallel: the sections.
    """

    # kw_only lets schema_version come first (as in a file) ahead of the required `model`.
    schema_version: int = _config_field(
        Check(f"{SCHEMA_VERSION} (files are migrated to it)", lambda v: _is_int(v) and v == SCHEMA_VERSION),
        SCHEMA_VERSION,
    )
    model: ModelConfig
    backend: BackendConfig = attrs.Factory(BackendConfig)
    runtime: RuntimeConfig = attrs.Factory(RuntimeConfig)
    generation: GenerationDefaults = attrs.Factory(GenerationDefaults)
    server: ServerConfig = attrs.Factory(ServerConfig)
    speculative: SpeculativeConfig = attrs.Factory(SpeculativeConfig)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig, validator=_check_parallel)


def _section_paths(cl: type, prefix: str) -> dict[type, str]:
    # Derived from the field tree, so a key path can never disagree with the classes.
    attrs.resolve_types(cl)
    paths = {cl: prefix}
    for f in attrs.fields(cl):
        section = _optional_section(f.type) or f.type
        if isinstance(section, type) and attrs.has(section):
            paths.update(_section_paths(section, _join(prefix, f.name)))
    return paths


def _optional_section(t: Any) -> type | None:
    """``C`` for a field typed ``C | None`` with ``C`` a section class, else None."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1 and attrs.has(args[0]):
        return args[0]
    return None


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


_SECTION_PATHS = _section_paths(ZllmConfig, "")


def _key_path(section: type, key: str) -> str:
    return _join(_SECTION_PATHS[section], key)


# ---------------------------------------------------------------------------------------
# Structuring
# ---------------------------------------------------------------------------------------

_T = TypeVar("_T", bound=AttrsInstance)


def _make_converter() -> cattrs.Converter:
    # cattrs only walks the section tree and rejects bad keys; every leaf value passes
    # through untouched to the attrs validators. cattrs' own leaf hooks would coerce
    # (int("16"), int(True), list("abc")) and hide the user's mistake.
    conv = cattrs.Converter(detailed_validation=False)
    for leaf in (int, float, str, bool):
        conv.register_structure_hook(leaf, lambda v, _: v)
    conv.register_structure_hook_func(lambda t: not attrs.has(t), lambda v, _: v)

    def section_hook(cl: type[_T]) -> Callable[[Any, type], _T]:
        inner = make_dict_structure_fn(cl, conv)
        path = _SECTION_PATHS[cl]
        fields = attrs.fields(cl)
        names = [f.name for f in fields]

        def structure(data: Any, _: type) -> _T:
            if data is None:  # `runtime:` with every child commented out
                data = {}
            if not isinstance(data, Mapping):
                raise ConfigError(path, f"expected a mapping of keys, got {_short_repr(data)}")
            for key in data:
                if key not in names:
                    raise ConfigError(_join(path, key), unknown_name_message("key", key, names))
            for f in fields:
                if f.default is attrs.NOTHING and f.name not in data:
                    raise ConfigError(_join(path, f.name), "required key is missing")
            return inner(data, cl)

        return structure

    conv.register_structure_hook_factory(attrs.has, section_hook)

    def optional_section(data: Any, t: Any) -> Any:
        section = _optional_section(t)
        assert section is not None  # the predicate below admits only such types
        return None if data is None else conv.structure(data, section)

    conv.register_structure_hook_func(lambda t: _optional_section(t) is not None, optional_section)
    return conv


_converter = _make_converter()


_M = TypeVar("_M", bound=ModelConfig)


def _resolve_model(model: _M, base_dir: Path) -> _M:
    # abspath, not resolve(): keep the user's symlinked names (HF cache snapshots) readable.
    path = Path(os.path.abspath(base_dir / Path(model.path).expanduser()))
    section = _SECTION_PATHS[type(model)]
    if not path.exists():
        raise ConfigError(f"{section}.path", f"{path} does not exist")
    detected = "hf" if path.is_dir() else "gguf"
    if model.format not in ("auto", detected):
        kind = "a directory" if path.is_dir() else "a file"
        needs = "an HF checkpoint directory" if model.format == "hf" else "a .gguf file"
        raise ConfigError(f"{section}.format", f"format {model.format!r} needs {needs}, but {path} is {kind}")
    return attrs.evolve(model, path=str(path), format=detected)


def config_from_dict(data: Mapping[str, Any], base_dir: Path | None = None) -> ZllmConfig:
    """Migrate, structure and validate a config given as a mapping (parsed YAML or JSON).

    Args:
        data: the top-level mapping; not modified. Without ``schema_version`` it is taken
            as version 0 and migrated (see :mod:`zllm.spec.migrations`).
        base_dir: directory that a relative ``model.path`` is relative to; ``None`` = the
            current working directory.

    Returns:
        The validated config, with ``model.path`` (and ``speculative.draft.model.path``)
        absolute and its ``format`` resolved to ``hf`` or ``gguf``.

    Raises:
        ConfigError: at the first bad key path: an unknown key (with a did-you-mean and the
            valid keys), a missing required key, a wrong type or out-of-range value, a
            ``model.path`` that does not exist (naming the resolved path), a
            ``model.format`` that contradicts the path, or a ``schema_version`` newer than
            :data:`SCHEMA_VERSION`.
    """
    if not isinstance(data, Mapping):
        raise ConfigError("", f"expected a mapping of config sections, got {_short_repr(data)}")
    migrated, changes = migrate(_plain_copy(data))
    if changes:
        # Info, not warning: a dict without schema_version (common from Python) only gets stamped.
        log.info(
            "config migrated in memory to schema_version %d: %s (update the file with "
            "zllm.spec.migrations.migrate_file_text)", SCHEMA_VERSION, "; ".join(changes)
        )
    cfg = _converter.structure(migrated, ZllmConfig)
    base = base_dir or Path.cwd()
    cfg = attrs.evolve(cfg, model=_resolve_model(cfg.model, base))
    draft = cfg.speculative.draft
    if draft.model is not None:
        draft = attrs.evolve(draft, model=_resolve_model(draft.model, base))
        cfg = attrs.evolve(cfg, speculative=attrs.evolve(cfg.speculative, draft=draft))
    return cfg


def _plain_copy(data: Any) -> Any:
    # Migrations edit in place, and the caller's mapping must survive. The copy is also made
    # of plain Python types: ruamel's round-trip loader returns str/float/int subclasses
    # that carry formatting, and those must not leak into the frozen config.
    if isinstance(data, Mapping):
        return {_plain_copy(k): _plain_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_plain_copy(v) for v in data]
    for plain in (bool, int, float, str):
        if isinstance(data, plain):
            return plain(data)
    return data


def config_to_dict(cfg: ZllmConfig) -> dict[str, Any]:
    """The config as plain dicts, lists and scalars (YAML/JSON ready), every key present.

    ``config_from_dict(config_to_dict(cfg)) == cfg`` for any config built by
    :func:`config_from_dict`.
    """
    return _converter.unstructure(cfg)


def load_config(path: str | os.PathLike[str]) -> ZllmConfig:
    """Read a YAML config file and return the validated config.

    Args:
        path: the YAML file. A relative ``model.path`` inside it is resolved against the
            file's directory.

    Raises:
        ConfigError: the file cannot be read (path ``""``, message names the file); the
            YAML is malformed or has a duplicate key (message names the file, line and
            column); the top level is not a mapping; or anything
            :func:`config_from_dict` rejects.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"cannot read config file {file}: {exc}") from exc
    data = load_yaml_text(text, str(file))
    return config_from_dict(data, base_dir=file.parent)
