"""Op declarations, and the data types their signatures use.

An op is declared once, by an :class:`OpDeclaration` in the domain module that holds its f32
reference (``OPS = (OpDeclaration(...), ...)`` at module level); :mod:`zllm.domain.ops`
collects every declaration into the core's :class:`OpTable`, and the capability list, the
reference registrations, the conformance cases and argument names, and the dispatch of
bound ops all derive from it. Each declaration's ``signature`` is the contract a backend
kernel implements (``docs/writing-a-backend-plugin.md`` lists them; a test keeps the list
equal to the declarations).

Dimension legend of the signatures: ``T`` tokens in the batch (all sequences flattened),
``S`` sequences, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``K`` in-features,
``N`` out-features, ``V`` vocabulary, ``NB`` KV blocks, ``BS`` block size (tokens per
block), ``MB`` max blocks per sequence. Activations are f32 on the backend's device;
weights are a dense tensor in their stored dtype or a
:class:`~zllm.weights.formats.QuantizedTensor`.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from zllm.capabilities import Capability


@attrs.frozen
class OpDeclaration:
    """Everything the core knows about one op, in one place.

    Attributes:
        name: the op's name, as kernels are registered and capabilities spelt
            (``linear``).
        variants: the capability variants (``linear[q8_0]``): the weight formats for an op
            with a ``weight_arg``, math variants otherwise (``rope[neox]``, ``rope[gptj]``).
        args: argument names in call order, as in ``signature``.
        signature: the kernel contract: shapes, dtypes, what is written in place.
        reference: lazy ``"module:function"`` of the f32 reference of every variant.
        cases: lazy ``"module:function"`` of the conformance case generator,
            ``(variant, torch.Generator, quick) -> list[Case]``
            (:mod:`zllm.conformance.cases`).
        weight_arg: the argument that is a weight whose format selects the kernel: the
            bound op dispatches on ``format_of`` of it. None for an op whose variant is fixed
            by the model (one bound variant is called as ``ops.<name>``, several through
            ``ops.variant(name, variant)``).
        optional_args: trailing arguments a caller may leave out; they are passed as None
            (``linear``'s ``bias``).
        variant_references: ``variant -> "module:function"`` where a variant's math differs
            from ``reference`` (``rope[gptj]``).

    Raises:
        ValueError: no variants, ``weight_arg`` or an optional argument not in ``args``,
            optional arguments that are not trailing, or a ``variant_references`` key that
            is not a variant.
    """

    name: str
    variants: tuple[str, ...]
    args: tuple[str, ...]
    signature: str
    reference: str
    cases: str
    weight_arg: str | None = None
    optional_args: tuple[str, ...] = ()
    variant_references: dict[str, str] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if not self.variants:
            raise ValueError(f"op {self.name!r} declares no variants")
        if self.weight_arg is not None and self.weight_arg not in self.args:
            raise ValueError(f"op {self.name!r}: weight_arg {self.weight_arg!r} is not one of its args {self.args}")
        if self.optional_args and self.args[-len(self.optional_args):] != self.optional_args:
            raise ValueError(f"op {self.name!r}: optional args {self.optional_args} must be the last of {self.args}")
        stray = sorted(set(self.variant_references) - set(self.variants))
        if stray:
            raise ValueError(f"op {self.name!r}: variant_references for undeclared variants {stray}")

    @property
    def capabilities(self) -> frozenset[Capability]:
        """``name[variant]`` for every variant."""
        return frozenset(Capability(self.name, v) for v in self.variants)

    def reference_for(self, variant: str) -> str:
        """The lazy reference of ``variant``."""
        return self.variant_references.get(variant, self.reference)


@attrs.frozen
class OpTable:
    """A set of op declarations, by name. The core's is :data:`zllm.domain.ops.CORE_OPS`.

    Raises:
        ValueError: two declarations share a name (names it).
    """

    ops: tuple[OpDeclaration, ...]

    def __attrs_post_init__(self) -> None:
        seen: set[str] = set()
        for op in self.ops:
            if op.name in seen:
                raise ValueError(f"op {op.name!r} is declared twice")
            seen.add(op.name)

    def __getitem__(self, name: str) -> OpDeclaration:
        """The declaration of ``name``. Raises KeyError naming the declared ops."""
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op {name!r} is declared (declared: {', '.join(self.names)})")

    def __contains__(self, name: object) -> bool:
        return any(op.name == name for op in self.ops)

    @property
    def names(self) -> list[str]:
        return sorted(op.name for op in self.ops)

    @property
    def capabilities(self) -> frozenset[Capability]:
        """Every ``op[variant]`` declared."""
        return frozenset(c for op in self.ops for c in op.capabilities)

    def extended(self, ops: Iterable[OpDeclaration]) -> OpTable:
        """This table plus ``ops`` (a table for a test or a tool; duplicates raise)."""
        return OpTable(self.ops + tuple(ops))


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Where each token of a flattened batch lives in the paged KV cache.

    Sequences appear in the batch in order; sequence ``s`` contributes ``query_lens[s]``
    consecutive tokens, which are the last ``query_lens[s]`` of its ``context_lens[s]``
    cached tokens (so a New Prefill has ``query_len == context_len``, an Append Prefill
    ``query_len < context_len``, a decode step ``query_len == 1``). Attention is causal.

    Attributes:
        slot_mapping: int64 ``[T]``, cache slot ``block * BS + offset`` of each new token.
        block_tables: int64 ``[S, MB]``, physical block ids of each sequence (padding -1).
        query_lens: ``S`` ints, new tokens per sequence.
        context_lens: ``S`` ints, cached tokens per sequence including the new ones.
        scale: softmax scale, usually ``D ** -0.5``.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    scale: float


@attrs.frozen(eq=False)
class SamplingRow:
    """Sampling settings and state for one sequence (one row of the logits), as the runtime's
    sampler (:mod:`zllm.runtime.sampler`) and its f32 reference take them; exported in
    ``zllm.plugin_api`` so a backend's fused piece of sampling can take the same rows.

    Order of application (vLLM / HF ``generate``): repetition penalty, presence and
    frequency penalties, temperature, top-k, top-p, min-p, then a draw. ``temperature == 0``
    is greedy (argmax of the penalised logits).

    Attributes:
        temperature: >= 0.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        min_p: drop tokens whose probability is below ``min_p * max_prob``; 0 disables.
        repetition_penalty: > 0; 1 disables. Divides positive logits, multiplies negative
            ones, for tokens in the prompt or output (CTRL, Keskar et al. 2019; HF).
        presence_penalty, frequency_penalty: OpenAI semantics over output tokens only:
            ``logit -= presence * (count > 0) + frequency * count``.
        prompt_token_ids, output_token_ids: int64 ``[P]`` / ``[O]`` on the logits' device.
        generator: a per-request ``torch.Generator`` (seeded when the request gives a seed).
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor
    generator: torch.Generator | None
