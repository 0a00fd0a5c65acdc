"""Chat templates: a conversation → the model's prompt text → token ids.

Templates are Jinja source shipped with the checkpoint (``tokenizer_config.json``
``chat_template``, ``chat_template.jinja``, or GGUF ``tokenizer.chat_template``), so they are
rendered the way HF transformers renders them (``utils/chat_template_utils.py``,
``_compile_jinja_template`` and ``render_jinja_template``): jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not HTML-escape, the globals
``raise_exception``, ``strftime_now``, ``dict`` and a ``namespace`` that refuses underscore
names, and the variables ``messages``, ``add_generation_prompt``, ``tools`` (the request's
function tools, or ``None``), ``documents`` (``None``), ``bos_token`` and ``eos_token``. Messages
are HF's shape: ``content`` may be None for an assistant turn with ``tool_calls``
(``[{"id", "type", "function": {"name", "arguments": {...}}}]``), and a ``tool`` message carries
``tool_call_id``. A template that ignores the tools or tool calls it is given (the output is the
same without them) cannot serve them, and the request is refused naming the field. The sandbox
refuses attribute access to Python internals (``''.__class__``), so a template cannot escape to
Python.

Tokenizing the rendered text (:func:`render_chat`):

- The template's own special-token text (``<|im_start|>``, ``{{ bos_token }}``) becomes
  special ids, as transformers' ``apply_chat_template`` does.
- Special-token text that a *message* carries stays plain text: a user typing
  ``<|im_end|>`` does not end their turn. The messages that hold such text are rendered a
  second time wrapped in two Unicode noncharacters; where the wrapped content lands in the
  output is untrusted text, and special tokens overlapping it are encoded as plain text. A
  template that changes such a message's content (``| trim``, slicing) makes the two
  renderings disagree, and the request is refused rather than guessed at.
- BOS: when the model adds BOS (``Tokenizer.add_bos``, or the request's ``add_bos``) and the
  rendered prompt does not already start with it, it is prepended — never doubled
  (transformers never adds it; llama.cpp adds it and warns when that doubles it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from zllm.spec.errors import CheckpointError, RequestError
from zllm.tokenizer.tokenizer import Tokenizer

# Unicode noncharacters (never assigned, "for internal use"): mark untrusted message content.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' override: jinja's own tojson HTML-escapes ``<``, ``>``, ``&`` and ``'``.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without handing them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` that refuses underscore-prefixed names (no dunder smuggling)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox (cached by its text).

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _template_source(tokenizer: Tokenizer, template_name: str | None) -> str:
    templates = tokenizer.chat_templates
    name = template_name or "default"
    if name in templates:
        return templates[name]
    if not templates:
        raise RequestError("messages", f"model has no chat template ({tokenizer.source})")
    raise RequestError(
        "messages", f"no chat template named {name!r} in {tokenizer.source}; it has: {', '.join(sorted(templates))}"
    )


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        ok_content = isinstance(content, str) or (content is None and bool(m.get("tool_calls")))
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not ok_content:
            raise RequestError(f"messages[{i}]", "expected an object with string 'role' and 'content'")
        out.append(dict(m))
    return out


def _check_renders_tools(tokenizer: Tokenizer, source: str, messages: list[dict[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool, text: str) -> None:
    """Refuse tools or tool calls that the template drops (it renders the same without them)."""
    if tools and _render(tokenizer, source, messages, add_generation_prompt, None) == text:
        raise RequestError("tools", f"the chat template of {tokenizer.source} does not render tools; serve a model "
                                    "whose template does, or send the request without tools")
    with_calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
    if with_calls:
        stripped = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        for m in stripped:
            if m.get("content") is None:
                m["content"] = ""
        if _render(tokenizer, source, stripped, add_generation_prompt, tools) == text:
            raise RequestError(f"messages[{with_calls[0]}].tool_calls",
                               f"the chat template of {tokenizer.source} does not render tool calls")


def _render(tokenizer: Tokenizer, source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    try:
        template = compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(
            tokenizer.source, f"chat template does not parse: line {exc.lineno}: {exc.message}"
        ) from exc
    try:
        return template.render(
            messages=messages,
            tools=[dict(t) for t in tools] if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except jinja2.exceptions.SecurityError as exc:
        # A template that reaches for Python internals is a broken (or hostile) checkpoint.
        raise CheckpointError(tokenizer.source, f"chat template blocked by the jinja2 sandbox: {exc}") from exc
    except jinja2.TemplateError as exc:  # raise_exception(...) and undefined-call errors
        raise RequestError("messages", f"the chat template rejected the conversation: {exc.message}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise RequestError(
            "messages", f"the chat template failed on this conversation: {type(exc).__name__}: {exc}"
        ) from exc


def render_chat_text(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    template_name: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation, rendered by the model's chat template.

    Args:
        tokenizer: the model's tokenizer; its :attr:`~Tokenizer.chat_templates` are used.
        messages: ``{"role": str, "content": str}`` objects, oldest first (HF's tool-call
            shape allowed, see the module docstring).
        add_generation_prompt: end with the template's "assistant turn starts" text.
        template_name: a named template; default ``"default"``.
        tools: function tools (``{"type": "function", "function": {...}}``) for the template.

    Raises:
        RequestError: the model has no (such) template (field ``messages``); the template
            rejects the conversation (``raise_exception``), the message named; the template
            drops the tools (``tools``) or tool calls (``messages[i].tool_calls``).
        CheckpointError: the template does not parse, or the sandbox blocked it.
    """
    source = _template_source(tokenizer, template_name)
    plain = _plain_messages(messages)
    text = _render(tokenizer, source, plain, add_generation_prompt, tools)
    _check_renders_tools(tokenizer, source, plain, tools, add_generation_prompt, text)
    return text


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    template_name: str | None = None,
    add_bos: bool | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The prompt token ids of a conversation (see the module docstring for the rules).

    Args:
        tokenizer, messages, add_generation_prompt, template_name, tools: as :func:`render_chat_text`.
        add_bos: prepend BOS unless the rendered prompt starts with it; ``None`` follows
            ``tokenizer.add_bos``.

    Raises:
        RequestError, CheckpointError: as :func:`render_chat_text`; also a RequestError
            naming ``messages[i].content`` when a message carries special-token text and the
            template changes that message's content (so it cannot be kept plain text).
    """
    source = _template_source(tokenizer, template_name)
    plain = _plain_messages(messages)
    text = _render(tokenizer, source, plain, add_generation_prompt, tools)
    _check_renders_tools(tokenizer, source, plain, tools, add_generation_prompt, text)
    specials = [s for s in tokenizer.special_token_texts if s]
    risky = [i for i, m in enumerate(plain) if m["content"] and any(s in m["content"] for s in specials)]
    if not risky:
        ids = tokenizer.encode(text, add_special_tokens=False, parse_special=True)
    else:
        spans = _untrusted_spans(tokenizer, source, plain, risky, text, add_generation_prompt, tools)
        ids = tokenizer.encode_keeping_plain(text, spans)
    bos = tokenizer.bos_token_id
    if (tokenizer.add_bos if add_bos is None else add_bos) and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


def _untrusted_spans(
    tokenizer: Tokenizer,
    source: str,
    messages: list[dict[str, Any]],
    risky: list[int],
    text: str,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[tuple[int, int]]:
    """Character spans of ``text`` that come from the contents of the ``risky`` messages."""
    first = f"messages[{risky[0]}].content"
    if _OPEN in text or _CLOSE in text:
        raise RequestError(first, "contains the Unicode noncharacters U+FDD0/U+FDD1, which zllm reserves")
    marked_messages = [dict(m) for m in messages]
    for i in risky:
        marked_messages[i]["content"] = _OPEN + messages[i]["content"] + _CLOSE
    marked = _render(tokenizer, source, marked_messages, add_generation_prompt, tools)
    if marked.replace(_OPEN, "").replace(_CLOSE, "") != text:
        raise RequestError(
            first,
            "holds special-token text and the chat template changes message content, so zllm cannot keep "
            "that text plain; remove the special-token text from the message",
        )
    spans: list[tuple[int, int]] = []
    pos, start = 0, None
    for ch in marked:
        if ch == _OPEN:
            if start is not None:
                raise RequestError(first, "the chat template nests message contents; cannot locate them")
            start = pos
        elif ch == _CLOSE:
            if start is None:
                raise RequestError(first, "the chat template splits message contents; cannot locate them")
            spans.append((start, pos))
            start = None
        else:
            pos += 1
    if start is not None:
        raise RequestError(first, "the chat template cuts message contents; cannot locate them")
    return spans
