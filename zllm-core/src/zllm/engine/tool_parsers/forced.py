"""Forced tool calls as grammars: ``tool_choice`` ``required`` or a named function.

Each chat format declares how it writes a block of calls (its ``call_grammar``, beside its
parser); :func:`calls_grammar` turns that into a Lark grammar (llguidance's dialect) whose
arguments are JSON valid under each tool's ``parameters`` schema. Decoding under it can only
produce text the format's parser reads as calls to the allowed tools — the call is enforced,
not hoped for (vLLM does the same with its structured-output backends).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""The arguments schema of a tool that gives no ``parameters``."""


@attrs.frozen
class ForcedCalls:
    """What one request's forced-call grammar is built from.

    Attributes:
        tools: ``(name, parameters schema)`` of each tool the answer may call.
        parallel: one or more calls (True) or exactly one.
        literal: a marker text → a Lark expression (a special token by id, else a string).
        json_rule: a JSON schema → a Lark rule body for JSON valid under it.
        template: the model's chat template (formats with several versions tell them apart by it).
    """

    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    parallel: bool
    literal: Callable[[str], str]
    json_rule: Callable[[Mapping[str, Any]], str]
    template: str


CallSyntax = Callable[[ForcedCalls, str, str], str]
"""``(request, tool name, arguments rule name) ->`` the Lark expression of one call."""


def quoted(text: str) -> str:
    """A Lark string literal for plain ``text``."""
    return json.dumps(text)


def json_call_head(name: str, arguments_key: str) -> str:
    """The text before a JSON call object's arguments: ``{"name": "NAME", "KEY": ``."""
    return "{" + f'"name": {json.dumps(name)}, {json.dumps(arguments_key)}: '


def calls_grammar(forced: ForcedCalls, call: CallSyntax, *, begin: Sequence[str] = (), separator: str = "",
                  end: Sequence[str] = (), parallel: bool = True) -> str:
    """A Lark grammar: the ``begin`` expressions, one call (or, when both ``parallel`` and
    ``forced.parallel``, one or more joined by ``separator``), the ``end`` expressions.
    ``begin``, ``separator`` and ``end`` are Lark expressions (use ``forced.literal``)."""
    rules = []
    names = []
    for i, (name, schema) in enumerate(forced.tools):
        expr = call(forced, name, f"args_{i}")
        rules.append(f"call_{i}: {expr}")
        if f"args_{i}" in expr.split():  # formats that spell arguments their own way (XML) use no JSON rule
            rules.append(f"args_{i}: {forced.json_rule(schema)}")
        names.append(f"call_{i}")
    more = f"({separator} call)*" if parallel and forced.parallel else ""
    start = " ".join([*begin, "call", more, *end])
    return "\n".join([f"start: {start}", f"call: {' | '.join(names)}", *rules]) + "\n"


CallGrammar = Callable[[ForcedCalls], str]
"""A format's whole forced-call grammar (a Lark text) for one request."""
