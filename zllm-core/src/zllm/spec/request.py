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
                       (null only for an assistant message
                       with tool_calls); see below
tools                  list of function tools (below)     — (none)
tool_choice            "auto", "none", "required" or     — ("auto")
                       {type: function, function: {name}}
                       ("required" and a named function
                       are enforced by a grammar)
response_format        null, {type: text}, {type:         — (null: unconstrained)
                       json_object}, {type: json_schema,
                       json_schema: {name, schema,
                       strict, description}}, {type:
                       regex, regex}, {type: grammar,
                       grammar}; see below
parallel_tool_calls    bool; false keeps the first call   — (true)
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
logprobs               int in [0, 20]: report each        — (null: none)
                       output token's logprob and the
                       n most likely alternatives
=====================  =================================  ====================================

Logprobs are natural logs of the **raw model distribution** (``log_softmax`` of the model's
logits, before penalties, temperature, top-k/p, min-p and any logits mask, as vLLM reports
by default), floored at ``-9999.0`` so that ``-inf`` stays valid JSON
(:data:`zllm.runtime.sampler.LOGPROB_FLOOR`). See :func:`make_logprobs` for their shape.

``messages`` is a conversation that the model's chat template turns into the prompt (the
engine ends it with the template's generation prompt); special-token text inside a message's
content stays plain text. ``true``/``false`` are never accepted as numbers.

``response_format`` constrains the answer, token by token, with a grammar
(:mod:`zllm.runtime.grammar`): ``json_object`` any JSON object, ``json_schema`` JSON valid
under ``json_schema.schema`` (OpenAI's shape; ``strict`` is accepted and the schema is always
enforced), and two zllm extensions: ``regex`` text matching ``regex`` as a whole (Rust
``regex`` syntax) and ``grammar`` text of a Lark grammar (llguidance's dialect) or a GBNF
grammar (llama.cpp's). The JSON is compact (no whitespace between tokens). A reasoning
model's ``<think>`` section is not constrained; the grammar starts after it. A forced tool
call (``tool_choice`` ``required`` or a named function) is enforced the same way, in the
model's tool-call syntax; it and a ``response_format`` other than ``text`` exclude each other.

Tools follow OpenAI's shape: ``{"type": "function", "function": {"name", "description",
"parameters", "strict"}}``, the name matching :data:`TOOL_NAME_PATTERN`, ``parameters`` a JSON
schema object. The chat template renders them (``tools=``). An assistant message may carry
``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``,
``arguments`` a JSON object or its JSON text); a ``tool`` message answers one of them by
``tool_call_id``, after the assistant message that made the call and before the next
assistant message. Streaming is not a request field: the
caller picks it by API (``Engine.generate`` vs ``Engine.generate_stream``, SSE vs plain HTTP).

A result is :func:`make_response`; a stream is :func:`make_delta_event` events followed by
one :func:`make_final_event`.
"""

from __future__ import annotations

import functools
import json
import re
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

FinishReason = Literal["stop", "length", "tool_calls"]
"""``stop``: a stop string, stop token or EOS ended generation; ``length``: ``max_tokens``
or the context window did; ``tool_calls``: the answer ended with tool calls (a request with
``tools``)."""

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "tool_calls")

TOOL_NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""Function names OpenAI and Anthropic accept (``^[a-zA-Z0-9_-]{1,64}$``)."""

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

MAX_LOGPROBS = 20
"""The most alternatives per token ``logprobs`` may ask for (OpenAI's ``top_logprobs`` limit)."""

LOGPROBS = Check(f"an int in [0, {MAX_LOGPROBS}]",
                 lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS)

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id")
_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_CALL_KEYS = ("id", "type", "function")
_CALL_FUNCTION_KEYS = ("name", "arguments")


@attrs.frozen
class ToolCallRecord:
    """A tool call of an earlier assistant turn: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        # HF chat templates read arguments as a mapping (``tool_call.arguments | tojson``).
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.loads(self.arguments)}}


@attrs.frozen
class ChatMessage:
    """One message of a conversation: ``role`` in :data:`CHAT_ROLES`, text ``content`` (None
    only for an assistant message with ``tool_calls``), the calls an assistant made, the call
    a ``tool`` message answers."""

    role: str
    content: str | None
    tool_calls: tuple[ToolCallRecord, ...] = ()
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message as chat templates see it (HF's shape)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _check_keys(m: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in m:
        if key not in allowed:
            raise RequestError(f"{where}.{key}", unknown_name_message("key", key, allowed))


def _object(v: Any, where: str, what: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise RequestError(where, f"expected {what}, got {_short(v)}")
    return v


def _function_name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not TOOL_NAME_PATTERN.fullmatch(v):
        raise RequestError(where, f"expected a function name of 1 to 64 letters, digits, '_' or '-' "
                                  f"(^[a-zA-Z0-9_-]{{1,64}}$), got {_short(v)}")
    return v


def _to_tool_call(v: Any, where: str) -> ToolCallRecord:
    m = _object(v, where, "a tool call object {id, type, function}")
    _check_keys(m, _CALL_KEYS, where)
    if not isinstance(m.get("id"), str) or not m["id"]:
        raise RequestError(f"{where}.id", f"expected a non-empty string, got {_short(m.get('id'))}")
    if m.get("type", "function") != "function":
        raise RequestError(f"{where}.type", f"expected 'function', got {_short(m.get('type'))}")
    fn = _object(m.get("function"), f"{where}.function", "an object {name, arguments}")
    _check_keys(fn, _CALL_FUNCTION_KEYS, f"{where}.function")
    name = _function_name(fn.get("name"), f"{where}.function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError as exc:
            raise RequestError(f"{where}.function.arguments", f"is not valid JSON: {exc}") from None
    else:
        parsed = args
    if not isinstance(parsed, Mapping):
        raise RequestError(f"{where}.function.arguments", f"expected a JSON object, got {_short(parsed)}")
    return ToolCallRecord(m["id"], name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _to_message(m: Any, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise RequestError(where, f"expected an object with role and content, got {_short(m)}")
    _check_keys(m, _MESSAGE_KEYS, where)
    if "role" not in m:
        raise RequestError(f"{where}.role", "is required")
    if m["role"] not in CHAT_ROLES:
        raise RequestError(f"{where}.role", f"expected one of {', '.join(CHAT_ROLES)}, got {_short(m['role'])}")
    role = m["role"]
    raw_calls = m.get("tool_calls")
    if raw_calls is not None and role != "assistant":
        raise RequestError(f"{where}.tool_calls", f"only assistant messages make tool calls, not {role!r} ones")
    if raw_calls is not None and (not isinstance(raw_calls, (list, tuple)) or not raw_calls):
        raise RequestError(f"{where}.tool_calls", f"expected a non-empty list of tool calls, got {_short(raw_calls)}")
    tool_calls = tuple(_to_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls or ()))
    if "content" not in m:
        raise RequestError(f"{where}.content", "is required")
    content = m["content"]
    if content is None and not tool_calls:
        raise RequestError(f"{where}.content", "is null; only an assistant message with tool_calls may have no content")
    if content is not None and not STR.ok(content):
        raise RequestError(f"{where}.content", STR.describe_failure(content))
    call_id = m.get("tool_call_id")
    if role == "tool" and not (isinstance(call_id, str) and call_id):
        raise RequestError(f"{where}.tool_call_id", "is required for a tool message: the id of the call it answers")
    if call_id is not None and role != "tool":
        raise RequestError(f"{where}.tool_call_id", f"only tool messages answer tool calls, not {role!r} ones")
    return ChatMessage(role, content, tool_calls, call_id)


def _check_tool_answers(messages: tuple[ChatMessage, ...]) -> None:
    """Every tool message answers a call of the latest assistant message, once."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            open_calls = {c.id for c in m.tool_calls}
        elif m.role == "tool":
            if m.tool_call_id not in open_calls:
                raise RequestError(f"messages[{i}].tool_call_id",
                                   f"{m.tool_call_id!r} answers no open tool call: a tool message must follow the "
                                   "assistant message whose tool_calls has that id, once")
            open_calls.discard(m.tool_call_id)


def _to_messages(v: Any) -> Any:
    """Check a ``messages`` value and turn it into a tuple of :class:`ChatMessage`.

    Raises:
        RequestError: naming ``messages``, ``messages[i]`` or ``messages[i].key`` (down to
            ``messages[i].tool_calls[j].function.arguments``).
    """
    if v is None or (isinstance(v, tuple) and all(isinstance(m, ChatMessage) for m in v) and v):
        return v
    if not isinstance(v, (list, tuple)) or not v:
        raise RequestError("messages", f"expected a non-empty list of {{role, content}} objects, got {_short(v)}")
    out = tuple(m if isinstance(m, ChatMessage) else _to_message(m, i) for i, m in enumerate(v))
    _check_tool_answers(out)
    return out


def _to_tools(v: Any) -> Any:
    """Check ``tools`` and return them as a tuple of ``{"type": "function", "function": {...}}``.

    Raises:
        RequestError: naming ``tools``, ``tools[i]`` or ``tools[i].function.name`` (a name
            outside :data:`TOOL_NAME_PATTERN` or given twice).
    """
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)):
        raise RequestError("tools", f"expected a list of function tools, got {_short(v)}")
    out, names = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        t = _object(t, where, "a tool object {type: 'function', function}")
        _check_keys(t, _TOOL_KEYS, where)
        if t.get("type") != "function":
            raise RequestError(f"{where}.type", f"expected 'function' (the only tool type zllm runs), "
                                                f"got {_short(t.get('type'))}")
        fn = _object(t.get("function"), f"{where}.function", "an object {name, description, parameters}")
        _check_keys(fn, _FUNCTION_KEYS, f"{where}.function")
        name = _function_name(fn.get("name"), f"{where}.function.name")
        if name in names:
            raise RequestError(f"{where}.function.name", f"{name!r} names two tools")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise RequestError(f"{where}.function.description", f"expected a string, got {_short(fn['description'])}")
        if fn.get("parameters") is not None:
            _object(fn["parameters"], f"{where}.function.parameters", "a JSON schema object")
            check_json_schema(fn["parameters"], f"{where}.function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise RequestError(f"{where}.function.strict", f"expected true or false, got {_short(fn['strict'])}")
        out.append({"type": "function", "function": {k: fn[k] for k in _FUNCTION_KEYS if fn.get(k) is not None}})
    return tuple(out)


TOOL_CHOICE = Check(
    "'auto', 'none', 'required' or {type: 'function', function: {name}}",
    lambda v: v in ("auto", "none", "required")
    or (isinstance(v, Mapping) and v.get("type") == "function" and isinstance(v.get("function"), Mapping)
        and isinstance(v["function"].get("name"), str)),
)


RESPONSE_FORMAT_TYPES: tuple[str, ...] = ("text", "json_object", "json_schema", "regex", "grammar")
_RESPONSE_FORMAT_KEYS = {"text": (), "json_object": (), "json_schema": ("json_schema",), "regex": ("regex",),
                         "grammar": ("grammar",)}
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def _to_response_format(v: Any) -> Any:
    """Check ``response_format``; ``{"type": "text"}`` becomes None (no constraint).

    Raises:
        RequestError: naming ``response_format`` or the key below it that is wrong, an
            invalid JSON schema included (checked against its metaschema by ``jsonschema``).
    """
    if v is None:
        return None
    m = _object(v, "response_format", "an object {type, ...}")
    kind = m.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise RequestError("response_format.type", unknown_name_message("type", kind, RESPONSE_FORMAT_TYPES))
    _check_keys(m, ("type", *_RESPONSE_FORMAT_KEYS[kind]), "response_format")
    if kind == "text":
        return None
    if kind in ("regex", "grammar"):
        text = m.get(kind)
        if not isinstance(text, str) or not text:
            raise RequestError(f"response_format.{kind}", f"expected a non-empty string, got {_short(text)}")
    if kind == "json_schema":
        spec = _object(m.get("json_schema"), "response_format.json_schema", "an object {name, schema, strict}")
        _check_keys(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema")
        for key, types, what in (("name", str, "a string"), ("description", str, "a string"),
                                 ("strict", bool, "true or false")):
            if spec.get(key) is not None and not isinstance(spec[key], types):
                raise RequestError(f"response_format.json_schema.{key}", f"expected {what}, got {_short(spec[key])}")
        schema = _object(spec.get("schema"), "response_format.json_schema.schema", "a JSON schema object")
        check_json_schema(schema, "response_format.json_schema.schema")
    return dict(m)


def check_json_schema(schema: Mapping[str, Any], where: str) -> None:
    """Raise RequestError naming ``where`` when ``schema`` is not a valid JSON schema (its
    draft's metaschema, via ``jsonschema``; draft 2020-12 when it names none). A schema seen
    before is not checked again (a client sends the same schema with every request)."""
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError):  # not JSON data: the metaschema check names what is wrong
        text = None
    problem = _schema_problem(text) if text is not None else _check_schema(schema)
    if problem is not None:
        at, message = problem
        raise RequestError(f"{where}{at}", f"is not a valid JSON schema: {message}")


@functools.lru_cache(maxsize=512)
def _schema_problem(text: str) -> tuple[str, str] | None:
    return _check_schema(json.loads(text))


def _check_schema(schema: Any) -> tuple[str, str] | None:
    """``(path below the schema, message)`` of its first metaschema violation, or None."""
    import jsonschema  # a well-kept validator; imported here, off the import path of the CLI

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path), exc.message
    return None


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
    tools: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=_to_tools)
    tool_choice: Any = _request_field(TOOL_CHOICE, "auto")
    parallel_tool_calls: bool = _request_field(BOOL, True)
    response_format: dict[str, Any] | None = attrs.field(default=None, converter=_to_response_format)
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
    logprobs: int | None = _request_field(LOGPROBS.or_null(), None)

    def __attrs_post_init__(self) -> None:
        given = [name for name in _PROMPT_FORMS if getattr(self, name) is not None]
        if len(given) != 1:
            # The wording ("neither" / "both") is pinned by tests/spec/test_request_contract.py.
            got = (
                f"{' and '.join(given)}: {'both' if len(given) == 2 else 'all three'} were given"
                if given else "neither was given"
            )
            raise RequestError(
                "prompt", f"give exactly one of prompt (a string), prompt_token_ids or messages; {got}"
            )
        self._check_tool_choice()

    def _check_tool_choice(self) -> None:
        if self.tool_choice in ("auto", "none"):
            return
        if not self.tools:
            raise RequestError("tool_choice", f"{_short(self.tool_choice)} needs tools, and the request has none")
        if isinstance(self.tool_choice, Mapping):
            name = self.tool_choice["function"]["name"]
            known = [t["function"]["name"] for t in self.tools]
            if name not in known:
                raise RequestError("tool_choice", unknown_name_message("tool", name, known))
        if self.response_format is not None:
            raise RequestError("response_format", "a forced tool call (tool_choice required or a named function) "
                                                  "and a response_format both constrain the answer; give one")

    @property
    def forced_tools(self) -> tuple[dict[str, Any], ...]:
        """The tools the answer must call (one or more calls), or () when it need not call one:
        all tools for ``required``, the named one for a named ``tool_choice``."""
        if self.tool_choice == "required":
            return self.tools
        if isinstance(self.tool_choice, Mapping):
            return tuple(t for t in self.tools if t["function"]["name"] == self.tool_choice["function"]["name"])
        return ()

    @property
    def parses_tools(self) -> bool:
        """Whether tool calls in the answer are read as calls (tools given, choice not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"


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
_UNDEFAULTED_FIELDS = {*_PROMPT_FORMS, "ignore_eos", "tools", "tool_choice", "parallel_tool_calls", "logprobs",
                       "response_format"}
assert set(_DEFAULTED_FIELDS) | _UNDEFAULTED_FIELDS == {f.name for f in attrs.fields(GenerationRequest)}


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


def _answer(text: str, content: str | None, reasoning_content: str,
            tool_calls: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    return {"content": text if content is None else content, "reasoning_content": reasoning_content,
            "tool_calls": [dict(c) for c in tool_calls]}


def make_logprobs(entries: Sequence[Any], token_text: Callable[[int], str]) -> list[dict[str, Any]]:
    """The JSON of output tokens' logprobs, one object per token, in output order.

    Args:
        entries: per token, an object with ``token_id`` (int), ``logprob`` (float) and
            ``top`` (``(token id, logprob)`` pairs, most likely first) — the runtime's
            ``TokenLogprob``.
        token_text: a token id's text (the tokenizer's decoding of that one token).

    Returns:
        ``[{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token", "logprob"}]}]``.
    """
    return [{"token_id": e.token_id, "token": token_text(e.token_id), "logprob": e.logprob,
             "top_logprobs": [{"token_id": t, "token": token_text(t), "logprob": lp} for t, lp in e.top]}
            for e in entries]


def make_response(
    text: str,
    token_ids: Sequence[int],
    finish_reason: FinishReason,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    *,
    content: str | None = None,
    reasoning_content: str = "",
    tool_calls: Sequence[Mapping[str, str]] = (),
    logprobs: list[dict[str, Any]] | None = None,
    stop_sequence: str | None = None,
) -> dict[str, Any]:
    """The JSON result of a finished, non-streamed request.

    Args:
        text: the generated text (stop string excluded).
        token_ids: the generated token ids.
        finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"``.
        prompt_tokens: tokens in the prompt, >= 0.
        completion_tokens: tokens generated, >= 0.
        cached_tokens: prompt tokens whose KV came from the prefix cache, 0..prompt_tokens.
        content: the answer part of ``text`` (a chat answer without its reasoning and tool
            calls); None = all of ``text``.
        reasoning_content: the ``<think>`` (or analysis-channel) text, "" for none.
        tool_calls: ``{"id", "name", "arguments"}`` per call, ``arguments`` JSON text.
        logprobs: :func:`make_logprobs` of every generated token, or None when the request
            did not ask for them.
        stop_sequence: the request's ``stop`` string that ended generation, as matched in
            the generated text; None when EOS, a stop token or the length limit did.

    Returns:
        ``{"text", "token_ids", "finish_reason", "stop_sequence", "content", "reasoning_content",
        "tool_calls", "logprobs", "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
        "cached_tokens"}}``.
    """
    assert finish_reason in FINISH_REASONS, finish_reason
    return {
        "text": text,
        "token_ids": list(token_ids),
        "finish_reason": finish_reason,
        "stop_sequence": stop_sequence,
        **_answer(text, content, reasoning_content, tool_calls),
        "logprobs": logprobs,
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def make_delta_event(text: str, token_ids: Sequence[int], *, content: str | None = None, reasoning_content: str = "",
                     tool_calls: Sequence[Mapping[str, Any]] = (),
                     logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A stream event carrying newly generated text and the token ids behind it.

    ``text`` may be empty while a multi-byte character is incomplete; concatenating every
    delta's ``text`` gives the final text. ``content``, ``reasoning_content`` and
    ``tool_calls`` are the same text parsed (a chat request's answer, reasoning and
    ``{"index", "id", "name", "arguments"}`` call pieces: ``id`` and ``name`` on a call's
    first piece only, else None; ``arguments`` fragments concatenate); ``content`` None =
    ``text``. A parser may hold text back, so a delta's ``content`` can lag its ``text``.
    ``logprobs`` is :func:`make_logprobs` of this delta's ``token_ids`` (None when the
    request did not ask for logprobs).

    Returns:
        ``{"type": "delta", "text", "token_ids", "content", "reasoning_content", "tool_calls",
        "logprobs"}``.
    """
    return {"type": "delta", "text": text, "token_ids": list(token_ids),
            **_answer(text, content, reasoning_content, tool_calls), "logprobs": logprobs}


def make_final_event(
    finish_reason: FinishReason, prompt_tokens: int, completion_tokens: int, cached_tokens: int, *,
    content: str = "", reasoning_content: str = "", tool_calls: Sequence[Mapping[str, str]] = (),
    stop_sequence: str | None = None,
) -> dict[str, Any]:
    """The last event of a stream (arguments as in :func:`make_response`; ``content``,
    ``reasoning_content`` and ``tool_calls`` are the whole answer, as the deltas add up to).

    Returns:
        ``{"type": "final", "finish_reason", "stop_sequence", "content", "reasoning_content",
        "tool_calls", "usage": {...}}``, ``usage`` as in :func:`make_response`.
    """
    assert finish_reason in FINISH_REASONS, finish_reason
    return {
        "type": "final",
        "finish_reason": finish_reason,
        "stop_sequence": stop_sequence,
        **_answer(content, None, reasoning_content, tool_calls),
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }
