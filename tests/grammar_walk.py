"""A stand-in for a model under a grammar: a seeded random walk through the grammar's masks.

Each step unpacks the constraint's bitmask, picks an allowed token at random — weighted
towards tokens that close strings and containers, so free text ends in a few tokens — and
accepts it, until the constraint is finished or an allowed EOS is picked. Whatever the walk
produces is text a model could produce under the same grammar.
"""

from __future__ import annotations

import random
import string

import torch
from hypothesis import strategies as st

from zllm.runtime.sampler import unpack_bitmask
from zllm.tokenizer import IncrementalDetokenizer, Tokenizer

CLOSERS = ('"', "}", "]", "<", ">", "\n", ",")


def closer_weights(tokenizer: Tokenizer, vocab: int) -> list[float]:
    """Per token id: 400 for a special token (grammars allow them only where a structure
    opens or closes), 40 for a token whose text has a closing character, else 1."""
    weights = []
    for i in range(vocab):
        text = tokenizer.decode([i], skip_special_tokens=False) if i < tokenizer.vocab_size else ""
        weights.append(400.0 if i in tokenizer.special_token_ids else 40.0 if any(c in text for c in CLOSERS) else 1.0)
    return weights


def walk(constraint, tokenizer: Tokenizer, vocab: int, weights: list[float], seed: int, *,
         eos: frozenset[int], max_steps: int = 600, keep_special_ids: frozenset[int] = frozenset()) -> str:
    """Tokens through ``constraint`` until it is finished or an EOS is drawn; their text.

    Raises:
        AssertionError: an EOS allowed before the grammar could end, or no end in ``max_steps``.
    """
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        mask = constraint.allowed_tokens()
        allowed = torch.ones(vocab, dtype=torch.bool) if mask is None else unpack_bitmask(mask, vocab)
        choices = allowed.nonzero().flatten().tolist()
        assert choices, "the grammar allows no token"
        token = rng.choices(choices, weights=[weights[t] for t in choices])[0]
        if token in eos:
            break
        constraint.accept(token)
        ids.append(token)
        if constraint.finished:
            break
    else:
        raise AssertionError(f"no end after {max_steps} tokens: {tokenizer.decode(ids)!r}")
    detok = IncrementalDetokenizer(tokenizer, keep_special_ids=keep_special_ids)
    return detok.push(ids) + detok.flush()


NAMES = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6)
LEAVES = st.one_of(
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 500)).map(
        lambda p: {"type": "integer", "minimum": p[0], "maximum": p[0] + p[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(NAMES, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


@st.composite
def json_schemas(draw, depth: int = 2):
    """JSON schemas of bounded output: objects, arrays (at most 3 items) and bounded leaves."""
    if depth == 0:
        return draw(LEAVES)
    kind = draw(st.sampled_from(["leaf", "array", "object"]))
    if kind == "leaf":
        return draw(LEAVES)
    if kind == "array":
        return {"type": "array", "items": draw(json_schemas(depth - 1)), "maxItems": 3}
    props = draw(st.dictionaries(NAMES, json_schemas(depth - 1), max_size=3))
    required = draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
