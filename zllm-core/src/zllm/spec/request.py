"""The Request JSON contract: one schema for ``zllm.Engine`` and the HTTP server.

A request is a JSON object; :func:`parse_request` checks it and fills every field it
leaves out (or sets to ``null``) from the config's ``generation:`` section
(:class:`~zllm.spec.config.GenerationDefaults`)::

    {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.8, "stop": "\\n"}

=====================  =================================  ====================================
field                  type and range                     default from ``generation:``
=====================  =================================  ====================================
prompt                 string                             — (exactly one of prompt,
prompt_token_ids       non-empty list of ints >= 0        prompt_token_ids and messages
messages               non-empty list of {role, content}  is required)
                       objects: role one of system, user,
                       assistant, tool; content a string
max_tokens             int >= 1                           max_new_tokens
temperature            number >= 0; 0 = greedy            temperature
top_p                  number in (0, 1]                   top_p
top_k                  int >= -1; 0 or -1 disables        top_k
min_p                  number in [0, 1]                   min_p
repetition_penalty     number > 0                         repetition_penalty
presence_penalty       number in [-2, 2]                  presence_penalty
frequency_penalty      number in [-2, 2]                  frequency_penalty
seed                   int in [0, 2**64)                  seed
stop                   string or list of <= 16 non-empty  stop
                       strings
stop_token_ids         list of ints >= 0                  stop_token_ids
add_bos                bool (alias add_special_tokens)    add_bos
ignore_eos             bool; true = EOS ids do not stop  — (false)
                       (only stop / stop_token_ids do)
=====================  =================================  ====================================

``messages`` is a conversation that the model's chat template turns into the prompt (the
engine ends it with the template's generation prompt); special-token text inside a message's
content stays plain text. ``true``/``false`` are never accepted as numbers. Streaming is not a request field: the
caller picks it by API (``Engine.generate`` vs ``Engine.generate_stream``, SSE vs plain HTTP).

A result is :func:`make_response`; a stream is :func:`make_delta_event` events followed by
one :func:`make_final_event`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from zllm.spec.config import (
    MIN_P,
    OPENAI_PENALTY,
    OPTIONAL_BOOL,
    POSITIVE_INT,
    REPETITION_PENALTY,
    SEED,
    STOP,
    STR,
    TEMPERATURE,
    TOKEN_IDS,
    TOP_K,
    TOP_P,
    Check,
    GenerationDefaults,
    to_float,
    to_tuple,
    unknown_name_message,
)
from zllm.spec.errors import RequestError

FinishReason = Literal["stop", "length"]
"""``stop``: a stop string, stop token or EOS ended generation; ``length``: ``max_tokens``
or the context window did."""

FINISH_REASONS: tuple[str, ...] = ("stop", "length")

PROMPT_TOKEN_IDS = Check(
    "a non-empty list of token ids (ints >= 0)", lambda v: TOKEN_IDS.ok(v) and len(v) > 0
)


def _request_field(check: Check, default: Any = attrs.NOTHING, converter: Callable | None = None) -> Any:
    """An attrs field whose validator raises RequestError naming the field."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not check.ok(value):
            raise RequestError(attribute.name, check.describe_failure(value))

    return attrs.field(default=default, validator=validate, converter=converter)


BOOL = Check("true or false", lambda v: isinstance(v, bool))

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = ("role", "content")


@attrs.frozen
class ChatMessage:
    """One message of a conversation: ``role`` in :data:`CHAT_ROLES`, text ``content``."""

    role: str
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def _to_messages(v: Any) -> Any:
    """Check a ``messages`` value and turn it into a tuple of :class:`ChatMessage`.

    Raises:
        RequestError: naming ``messages``, ``messages[i]`` or ``messages[i].key``.
    """
    if v is None or (isinstance(v, tuple) and all(isinstance(m, ChatMessage) for m in v) and v):
        return v
    if not isinstance(v, (list, tuple)) or not v:
        raise RequestError("messages", f"expected a non-empty list of {{role, content}} objects, got {_short(v)}")
    out = []
    for i, m in enumerate(v):
        if isinstance(m, ChatMessage):
            out.append(m)
            continue
        if not isinstance(m, Mapping):
            raise RequestError(f"messages[{i}]", f"expected an object with role and content, got {_short(m)}")
        for key in m:
            if key not in _MESSAGE_KEYS:
                raise RequestError(f"messages[{i}].{key}", unknown_name_message("key", key, _MESSAGE_KEYS))
        for key in _MESSAGE_KEYS:
            if key not in m:
                raise RequestError(f"messages[{i}].{key}", "is required")
        if m["role"] not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role", f"expected one of {', '.join(CHAT_ROLES)}, got {_short(m['role'])}")
        if not STR.ok(m["content"]):
            raise RequestError(f"messages[{i}].content", STR.describe_failure(m["content"]))
        out.append(ChatMessage(m["role"], m["content"]))
    return tuple(out)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
REQUEST_STOP = Check(f"a non-empty string or {STOP.expect}", STOP.ok)


def _to_stop_tuple(v: Any) -> Any:
    # OpenAI lets `stop` be one string or a list; normalise so the runtime sees one shape.
    # An empty string stays as it is, so the error shows what the client sent.
    return (v,) if isinstance(v, str) and v else to_tuple(v)


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One validated, complete generation request (see the module's table for each field).

    Sampling fields have no class defaults on purpose: the only defaults are the config's
    ``generation:`` section, applied by :func:`parse_request`.

    Raises:
        RequestError: from the constructor (and ``attrs.evolve``), naming the first bad
            field; ``prompt`` when not exactly one of ``prompt``, ``prompt_token_ids`` and
            ``messages`` is given.
    """

    prompt: str | None = _request_field(STR.or_null(), None)
    prompt_token_ids: tuple[int, ...] | None = _request_field(PROMPT_TOKEN_IDS.or_null(), None, converter=to_tuple)
    messages: tuple[ChatMessage, ...] | None = attrs.field(default=None, converter=_to_messages)
    max_tokens: int = _request_field(POSITIVE_INT)
    temperature: float = _request_field(TEMPERATURE, converter=to_float)
    top_p: float = _request_field(TOP_P, converter=to_float)
    top_k: int = _request_field(TOP_K)
    min_p: float = _request_field(MIN_P, converter=to_float)
    repetition_penalty: float = _request_field(REPETITION_PENALTY, converter=to_float)
    presence_penalty: float = _request_field(OPENAI_PENALTY, converter=to_float)
    frequency_penalty: float = _request_field(OPENAI_PENALTY, converter=to_float)
    seed: int | None = _request_field(SEED)
    stop: tuple[str, ...] = _request_field(REQUEST_STOP, converter=_to_stop_tuple)
    stop_token_ids: tuple[int, ...] = _request_field(TOKEN_IDS, converter=to_tuple)
    add_bos: bool | None = _request_field(OPTIONAL_BOOL)
    ignore_eos: bool = _request_field(BOOL, False)

    def __attrs_post_init__(self) -> None:
        given = [name for name in _PROMPT_FORMS if getattr(self, name) is not None]
        if len(given) != 1:
            # The wording ("neither" / "both") is pinned by tests/spec/test_request_contract.py.
            got = f"{' and '.join(given)}: {'both' if len(given) == 2 else 'all three'} were given" if given else "neither was given"
            raise RequestError(
                "prompt", f"give exactly one of prompt (a string), prompt_token_ids or messages; {got}"
            )


_PROMPT_FORMS = ("prompt", "prompt_token_ids", "messages")

# Request field -> GenerationDefaults attribute that fills it when the request leaves it out.
_DEFAULTED_FIELDS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "add_bos": "add_bos",
}
_ALIASES = {"add_special_tokens": "add_bos"}  # vLLM's and HF's name for the same switch
_ACCEPTED_FIELDS = tuple(f.name for f in attrs.fields(GenerationRequest)) + tuple(_ALIASES)
assert set(_DEFAULTED_FIELDS) | {*_PROMPT_FORMS, "ignore_eos"} == {f.name for f in attrs.fields(GenerationRequest)}


def parse_request(data: Mapping[str, Any], defaults: GenerationDefaults) -> GenerationRequest:
    """Check a request object and complete it from the config's defaults.

    Args:
        data: the decoded JSON object. A field that is absent or ``null`` takes its value
            from ``defaults``.
        defaults: the config's ``generation:`` section.

    Returns:
        The complete request; lists become tuples and a single ``stop`` string a 1-tuple.

    Raises:
        RequestError: naming the field: an unknown field (with a did-you-mean and the valid
            fields), a wrong type or out-of-range value (with the expected type and range),
            both ``add_bos`` and its alias ``add_special_tokens``, or not exactly one of
            ``prompt``, ``prompt_token_ids`` and ``messages``; a bad message names
            ``messages[i]`` or ``messages[i].role`` / ``.content``. A non-object ``data`` names field ``""``.
    """
    if not isinstance(data, Mapping):
        raise RequestError("", f"expected a JSON object, got {type(data).__name__}")
    for name in data:
        if name not in _ACCEPTED_FIELDS:
            raise RequestError(str(name), unknown_name_message("field", name, _ACCEPTED_FIELDS))
    values = {name: value for name, value in data.items() if value is not None}
    for alias, name in _ALIASES.items():
        if alias in values:
            if name in values:
                raise RequestError(alias, f"is an alias of {name}; give only one of them")
            values[name] = values.pop(alias)
    for name, default_name in _DEFAULTED_FIELDS.items():
        values.setdefault(name, getattr(defaults, default_name))
    return GenerationRequest(**values)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, int]:
    assert 0 <= cached_tokens <= prompt_tokens and completion_tokens >= 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "cached_tokens": cached_tokens,
    }


def make_response(
    text: str,
    token_ids: Sequence[int],
    finish_reason: FinishReason,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
) -> dict[str, Any]:
    """The JSON result of a finished, non-streamed request.

    Args:
        text: the generated text (stop string excluded).
        token_ids: the generated token ids.
        finish_reason: ``"stop"`` or ``"length"``.
        prompt_tokens: tokens in the prompt, >= 0.
        completion_tokens: tokens generated, >= 0.
        cached_tokens: prompt tokens whose KV came from the prefix cache, 0..prompt_tokens.

    Returns:
        ``{"text", "token_ids", "finish_reason", "usage": {"prompt_tokens",
        "completion_tokens", "total_tokens", "cached_tokens"}}``.
    """
    assert finish_reason in FINISH_REASONS, finish_reason
    return {
        "text": text,
        "token_ids": list(token_ids),
        "finish_reason": finish_reason,
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def make_delta_event(text: str, token_ids: Sequence[int]) -> dict[str, Any]:
    """A stream event carrying newly generated text and the token ids behind it.

    ``text`` may be empty while a multi-byte character is incomplete; concatenating every
    delta's ``text`` gives the final text.

    Returns:
        ``{"type": "delta", "text", "token_ids"}``.
    """
    return {"type": "delta", "text": text, "token_ids": list(token_ids)}


def make_final_event(
    finish_reason: FinishReason, prompt_tokens: int, completion_tokens: int, cached_tokens: int
) -> dict[str, Any]:
    """The last event of a stream (arguments as in :func:`make_response`).

    Returns:
        ``{"type": "final", "finish_reason", "usage": {...}}``, ``usage`` as in
        :func:`make_response`.
    """
    assert finish_reason in FINISH_REASONS, finish_reason
    return {
        "type": "final",
        "finish_reason": finish_reason,
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }
