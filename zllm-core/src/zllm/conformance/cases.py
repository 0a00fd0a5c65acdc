"""Generated input cases, one generator per declared op, for checking kernels against the f32 references.

Dimension legend as in :mod:`zllm.capabilities.ops`: ``T`` tokens, ``S`` sequences, ``H``
query heads, ``Hkv`` KV heads, ``D`` head dim, ``K`` in-features, ``N`` out-features, ``V``
vocabulary, ``NB`` KV blocks, ``BS`` block size, ``MB`` max blocks per sequence.

Every case is made on the CPU from a seeded ``torch.Generator`` (no global RNG), so one seed
gives the same cases on every machine. The cases cover what real batches contain: odd
sizes, one-token decode rows, KV contexts crossing block edges (block sizes 1, 5, 16), GQA
ratios 1, 2, 4, 8 and MQA, MLA latent caches, New Prefill / Append Prefill / decode / mixed batches, sliding
windows whose early blocks were freed (-1 in the block table), activations that are views
into a fused tensor (the q/k/v split of a fused QKV projection, the gate/up halves of a fused
MLP projection), weights in every format of a variant (dense f32/f16/bf16; q8_0, q4_0, q4_1,
q5_0, q5_1 from ``gguf.quants.quantize``; k-quants, which gguf-py cannot encode, as random blocks with
bounded f16 super-block scales).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import attrs
import gguf
import numpy as np
import torch

from zllm.capabilities.ops import AttentionMetadata, OpTable
from zllm.conformance import quantizers
from zllm.domain.attention import first_window_block
from zllm.domain.moe import RouterConfig, SharedExperts
from zllm.domain.ops import CORE_OPS
from zllm.domain.rope import default_inv_freq, rope_cos_sin
from zllm.weights.formats import BLOCK_LAYOUTS, DENSE_FORMATS, DTYPE_OF_FORMAT, FORMATS, QuantizedTensor

#: Tolerance of every op whose spec states none tighter (DESIGN: "atol = rtol = 1e-2").
DEFAULT_ATOL = 1e-2
DEFAULT_RTOL = 1e-2


@attrs.frozen(eq=False)
class Case:
    """One input set for one ``op[variant]``.

    Attributes:
        op, variant: the capability the case exercises.
        label: what the case covers, e.g. ``T=7 K=96 N=33 bias x=transposed view``.
        args: CPU inputs in the op's argument order (tensors keep their strides: a view
            stays a view on the backend).
        placed: indexes of ``args`` that are weights or KV caches, moved with
            ``backend.place()``; the others are activations and metadata, moved to
            ``backend.device`` as the runtime does.
        written: indexes of ``args`` the op writes in place (the KV caches), compared after
            the call as well as the outputs; every other input must come back unchanged.
        atol, rtol: an element passes when ``|out - ref| <= atol + rtol * |ref|``.
        arg_names: the op's declared argument names (set by :func:`cases_for`), for messages.
    """

    op: str
    variant: str
    label: str
    args: tuple
    placed: frozenset[int] = frozenset()
    written: tuple[int, ...] = ()
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    arg_names: tuple[str, ...] = ()


class NoCases(Exception):
    """The kit has no case generator for an op or a variant; the message names it."""


# ---------------------------------------------------------------------------- tensors


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _fused_split(g: torch.Generator, t: int, widths: tuple[int, ...], *rest: int) -> list[torch.Tensor]:
    """Views into one fused f32 ``[t, sum(widths), *rest]`` tensor, split along dim 1 (as
    ``torch.split`` of a fused projection): non-contiguous whenever there are several parts."""
    fused = _randn(g, t, sum(widths), *rest)
    return list(torch.split(fused, list(widths), dim=1))


K_QUANT_F16_OFFSETS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
"""Byte offsets of the f16 super-block scale ``d`` (and ``dmin``) in each k-quant block
(``ggml-common.h``, see :mod:`zllm.weights.formats`)."""

_K_QUANT_MAX_SCALED_Q = {"q2_k": 45, "q3_k": 128, "q4_k": 945, "q5_k": 1953, "q6_k": 4096}
# max |sub-block scale * q| (+ min) per format: bounds |w| <= d * this, so d is chosen from it


def _gguf_quantize(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    """``w`` f32 ``[N, K]`` encoded by gguf-py's reference quantizer (ggml's ``quantize_row_*_ref``)."""
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    data = gguf.quants.quantize(w.numpy().astype(np.float32), qtype)  # uint8 [N, bytes per row]
    return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(data)), fmt, tuple(w.shape))


def _random_kquant(g: torch.Generator, fmt: str, n: int, k: int) -> QuantizedTensor:
    """Random k-quant blocks: random quants and sub-block scales, f16 ``d``/``dmin`` drawn so
    that ``|w| <~ 1 / sqrt(K)`` (gguf-py has no k-quant encoder)."""
    layout = BLOCK_LAYOUTS[fmt]
    raw = torch.randint(0, 256, (n, k // layout.block_size, layout.type_size), dtype=torch.uint8, generator=g)
    for offset in K_QUANT_F16_OFFSETS[fmt]:
        scale = torch.rand(n, k // layout.block_size, 1, generator=g) * 2 / (_K_QUANT_MAX_SCALED_Q[fmt] * math.sqrt(k))
        raw[..., offset : offset + 2] = scale.half().view(torch.uint8)
    return QuantizedTensor(raw.view(n, -1), fmt, (n, k))


def make_weight(g: torch.Generator, fmt: str, n: int, k: int,
                scale: float | None = None) -> torch.Tensor | QuantizedTensor:
    """A weight ``[N, K]`` stored in ``fmt``, entries ~ ``N(0, scale^2)`` (default ``1/sqrt(K)``).

    Raises:
        NoCases: ``fmt`` is neither a dense format nor a block layout zllm knows.
    """
    scale = 1.0 / math.sqrt(k) if scale is None else scale
    if fmt in DTYPE_OF_FORMAT:
        return _randn(g, n, k, scale=scale).to(DTYPE_OF_FORMAT[fmt])
    if fmt in K_QUANT_F16_OFFSETS:
        return _random_kquant(g, fmt, n, k)
    if fmt in BLOCK_LAYOUTS and hasattr(gguf.GGMLQuantizationType, fmt.upper()):
        return _gguf_quantize(_randn(g, n, k, scale=scale), fmt)
    if fmt in FORMATS:
        return quantizers.quantize(_randn(g, n, k, scale=scale), fmt)
    raise NoCases(f"no weight encoder for format {fmt!r}")


def _block(fmt: str) -> int:
    """Columns must be a multiple of this for ``fmt``."""
    if fmt in DENSE_FORMATS.values():
        return 1
    if fmt in BLOCK_LAYOUTS:
        return BLOCK_LAYOUTS[fmt].block_size
    if fmt in FORMATS:
        return 32  # the groups of conformance.quantizers.quantize
    raise NoCases(f"unknown weight format {fmt!r}")


# ---------------------------------------------------------------------------- weight ops


def linear_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``linear``: decode rows (T=1), odd T/N/K, bias or not, a single output row, a transposed
    ``x`` and an ``x`` sliced out of a wider tensor. K is one or three weight blocks."""
    blk = _block(variant)
    k1, k3 = (blk, 3 * blk) if blk > 1 else (64, 97)
    shapes = [  # (T, N, K, bias, x layout)
        (1, 33, k3, False, "contiguous"),
        (7, 64, k1, True, "contiguous"),
        (6, 17, k3, True, "transposed view"),
        (5, 1, k1, True, "column slice"),
        (40, 130, k3, False, "contiguous"),
    ]
    if quick:
        shapes = shapes[:3]
    cases = []
    for t, n, k, bias, layout in shapes:
        w = make_weight(g, variant, n, k)
        if layout == "transposed view":
            x = _randn(g, k, t).t()  # [T, K], strides (1, T)
        elif layout == "column slice":
            x = _randn(g, t, k + 8)[:, 3 : 3 + k]  # [T, K], row stride K + 8
        else:
            x = _randn(g, t, k)
        b = _randn(g, n) if bias else None
        label = f"T={t} N={n} K={k}{' bias' if bias else ''} x={layout}"
        cases.append(Case("linear", variant, label, (x, w, b), placed=frozenset({1, 2})))
    return cases


def embedding_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``embedding``: one id, repeated ids including the first and last row, odd V."""
    blk = _block(variant)
    k = 2 * blk if blk > 1 else 72
    v = 37
    id_sets = [[v - 1], [0, 5, 5, v - 1, 17, 0, 33]]
    if not quick:
        id_sets.append(torch.randint(0, v, (41,), generator=g).tolist())
    cases = []
    for ids in id_sets:
        w = make_weight(g, variant, v, k, scale=1.0)
        cases.append(Case("embedding", variant, f"V={v} K={k} T={len(ids)}", (w, torch.tensor(ids, dtype=torch.int64)),
                          placed=frozenset({0})))
    return cases


def make_expert_stack(g: torch.Generator, fmt: str, e: int, n: int, k: int) -> torch.Tensor | QuantizedTensor:
    """An expert stack ``[E, N, K]`` in ``fmt``: ``E`` weights of :func:`make_weight`, stacked
    (each part of a quantized stack is its experts' parts stacked: ``[E, *part shape]``)."""
    experts = [make_weight(g, fmt, n, k) for _ in range(e)]
    if isinstance(experts[0], QuantizedTensor):
        parts = {name: torch.stack([w.parts[name] for w in experts]) for name in experts[0].parts}  # type: ignore[union-attr]
        return QuantizedTensor(parts, fmt, (e, n, k), block=experts[0].block)
    return torch.stack(experts)  # type: ignore[arg-type]


@attrs.frozen
class _MoeShape:
    """One ``moe`` case: ``t`` tokens, ``e`` experts of width ``n`` over hidden ``k`` (in
    blocks of the format when it has blocks), the router, and what else the case holds."""

    t: int
    e: int
    router: RouterConfig
    shared: str = "none"  # "none", "ungated" (DeepSeek) or "gated" (Qwen2-MoE)
    logits: str = "random"  # "random" or "ties" (values from a 5-value set: many exact ties)
    x_layout: str = "contiguous"


def moe_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``moe``: expert stacks in the variant's format; decode (T=1) and batches up to T=33;
    softmax routers with and without renormalisation (Mixtral, Qwen), top-1, DeepSeek-V2's
    group-limited greedy with a scaling factor, DeepSeek-V3's sigmoid ``noaux_tc`` with a
    correction bias; router logits with many exact ties (the lowest expert index must win);
    shared experts with and without Qwen2-MoE's sigmoid gate; an ``x`` sliced from a wider
    tensor. Experts no token picked are in most cases (the kernel must skip them)."""
    blk = _block(variant)
    hidden, width = (blk, blk) if blk >= 256 else ((2 * blk, blk) if blk > 1 else (72, 40))
    shapes = [
        _MoeShape(1, 8, RouterConfig(8, 2, norm_topk_prob=True)),
        _MoeShape(7, 4, RouterConfig(4, 2), shared="gated", x_layout="column slice"),
        _MoeShape(33, 8, RouterConfig(8, 2, norm_topk_prob=True), logits="ties"),
        _MoeShape(12, 8, RouterConfig(8, 2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                                     topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
                  shared="ungated"),
        _MoeShape(5, 8, RouterConfig(8, 3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    routed_scaling_factor=1.5), shared="ungated", logits="ties"),
        _MoeShape(16, 4, RouterConfig(4, 1)),
        _MoeShape(1, 6, RouterConfig(6, 4), shared="gated"),
    ]
    if quick:
        shapes = shapes[:4]
    cases = []
    for s in shapes:
        if s.x_layout == "column slice":
            x = _randn(g, s.t, hidden + 8)[:, 5 : 5 + hidden]  # [T, K], row stride K + 8
        else:
            x = _randn(g, s.t, hidden)
        if s.logits == "ties":
            logits = torch.randint(-2, 3, (s.t, s.e), generator=g).float()  # [T, E]
            logits[0] = 0.0  # one row where every expert ties
        else:
            logits = _randn(g, s.t, s.e, scale=2.0)  # [T, E]
        gate = make_expert_stack(g, variant, s.e, width, hidden)  # [E, N, K]
        up = make_expert_stack(g, variant, s.e, width, hidden)  # [E, N, K]
        down = make_expert_stack(g, variant, s.e, hidden, width)  # [E, K, N]
        bias = _randn(g, s.e, scale=0.1) if s.router.topk_method == "noaux_tc" else None
        shared = None
        if s.shared != "none":
            shared = SharedExperts(make_weight(g, variant, width, hidden), make_weight(g, variant, width, hidden),
                                   make_weight(g, variant, hidden, width),
                                   _randn(g, 1, hidden) if s.shared == "gated" else None)
        r = s.router
        label = (f"T={s.t} E={s.e} k={r.num_experts_per_tok} K={hidden} N={width} {r.scoring_func} "
                 f"{r.topk_method}" + (f" groups {r.topk_group}/{r.n_group}" if r.topk_method != "greedy" else "")
                 + (" renormalised" if r.norm_topk_prob else "")
                 + (f" scale={r.routed_scaling_factor:g}" if r.routed_scaling_factor != 1.0 else "")
                 + (" correction bias" if bias is not None else "")
                 + (f" shared experts {s.shared}" if shared is not None else "")
                 + (" tied router logits" if s.logits == "ties" else "")
                 + (f" x={s.x_layout}" if s.x_layout != "contiguous" else ""))
        cases.append(Case("moe", variant, label, (x, logits, s.router, gate, up, down, bias, shared),
                          placed=frozenset({3, 4, 5, 7})))
    return cases


def router_topk_softmax_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``router_topk_softmax``: decode and batch rows, k of 1, 2 and 4 over 4 to 32 experts,
    logits with many exact ties (the lowest expert index must win, ids in descending logit
    order), large logits (the softmax must subtract the max), a logits slice of a wider tensor."""
    _only(variant, "router_topk_softmax", ("f32",))
    shapes = [(1, 32, 4, "random"), (9, 8, 2, "ties"), (17, 4, 1, "random"), (6, 16, 4, "large"),
              (5, 8, 2, "column slice")]  # (T, E, k, logits)
    if quick:
        shapes = shapes[:3]
    cases = []
    for t, e, k, kind in shapes:
        if kind == "ties":
            logits = torch.randint(-2, 3, (t, e), generator=g).float()  # [T, E]
            logits[0] = 0.0  # one row where every expert ties
        elif kind == "column slice":
            logits = _randn(g, t, e + 3)[:, 2:2 + e]  # [T, E], row stride E + 3
        else:
            logits = _randn(g, t, e, scale=60.0 if kind == "large" else 2.0)
        cases.append(Case("router_topk_softmax", variant, f"T={t} E={e} k={k} logits {kind}", (logits, k)))
    return cases


def moe_clamped_swiglu_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``moe_clamped_swiglu``: expert stacks in the variant's format with f32 biases; decode
    (T=1) and batches; k = 1, 2, 4; pre-activations past the clamp limit on both sides (the
    limit must cut the gate from above and ``up`` on both sides); gpt-oss's constants and
    others; an ``x`` sliced from a wider tensor. Experts no token picked are in most cases."""
    blk = _block(variant)
    hidden, width = (blk, blk) if blk >= 256 else ((2 * blk, blk) if blk > 1 else (72, 40))
    shapes = [(1, 8, 2, 1.702, 7.0, 1.0, "contiguous"), (7, 4, 1, 1.702, 7.0, 8.0, "column slice"),
              (11, 8, 4, 1.0, 2.5, 4.0, "contiguous")]  # (T, E, k, alpha, limit, x scale, x layout)
    if quick:
        shapes = shapes[:2]
    cases = []
    for t, e, k, alpha, limit, scale, layout in shapes:
        x = (_randn(g, t, hidden + 8, scale=scale)[:, 5:5 + hidden] if layout == "column slice"
             else _randn(g, t, hidden, scale=scale))  # [T, K]
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k], distinct per row
        weights = torch.rand(t, k, generator=g).softmax(dim=-1)  # [T, k]
        gate = make_expert_stack(g, variant, e, width, hidden)  # [E, N, K]
        up = make_expert_stack(g, variant, e, width, hidden)  # [E, N, K]
        down = make_expert_stack(g, variant, e, hidden, width)  # [E, K, N]
        biases = (_randn(g, e, width), _randn(g, e, width), _randn(g, e, hidden, scale=0.1))
        label = (f"T={t} E={e} k={k} K={hidden} N={width} alpha={alpha:g} limit={limit:g} |x|~{scale:g}"
                 + (f" x={layout}" if layout != "contiguous" else ""))
        args = (x, ids, weights, gate, up, down, *biases, alpha, limit)
        cases.append(Case("moe_clamped_swiglu", variant, label, args, placed=frozenset({3, 4, 5})))
    return cases


# ---------------------------------------------------------------------------- norms, rope, activation


_NORM_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # norm weights arrive in the checkpoint's dtype


def _norm_shapes(quick: bool) -> list[tuple[int, int, float, str, torch.dtype]]:
    shapes = [  # (T, K, x scale, x layout, weight dtype)
        (1, 64, 1.0, "contiguous", torch.float32),
        (7, 97, 30.0, "column slice", torch.bfloat16),
        (3, 2048, 0.01, "contiguous", torch.float16),
        (33, 40, 1.0, "contiguous", torch.float32),
    ]
    return shapes[:2] if quick else shapes


def _activation(g: torch.Generator, t: int, k: int, scale: float, layout: str) -> torch.Tensor:
    if layout == "column slice":
        return _randn(g, t, k + 5, scale=scale)[:, 2 : 2 + k]
    return _randn(g, t, k, scale=scale)


def rms_norm_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``rms_norm``: odd K, tiny and large activations, f32/bf16/f16 weights, a strided ``x``."""
    _only(variant, "rms_norm", ("f32",))
    cases = []
    for t, k, scale, layout, wdtype in _norm_shapes(quick):
        x = _activation(g, t, k, scale, layout)
        w = (1.0 + _randn(g, k, scale=0.2)).to(wdtype)
        eps = 1e-6 if k % 2 else 1e-5
        label = f"T={t} K={k} |x|~{scale:g} x={layout} weight={DENSE_FORMATS[wdtype]} eps={eps:g}"
        cases.append(Case("rms_norm", variant, label, (x, w, eps), placed=frozenset({1})))
    return cases


def add_rms_norm_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``add_rms_norm``: as ``rms_norm``, with a residual of another magnitude (both outputs compared)."""
    _only(variant, "add_rms_norm", ("f32",))
    cases = []
    for t, k, scale, layout, wdtype in _norm_shapes(quick):
        x = _activation(g, t, k, scale, layout)
        residual = _activation(g, t, k, 3.0 * scale, "contiguous")
        w = (1.0 + _randn(g, k, scale=0.2)).to(wdtype)
        label = f"T={t} K={k} |x|~{scale:g} x={layout} weight={DENSE_FORMATS[wdtype]}"
        cases.append(Case("add_rms_norm", variant, label, (x, residual, w, 1e-6), placed=frozenset({2})))
    return cases


def rope_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``rope[neox|gptj]``: cos/sin of real positions (up to 8k) and frequencies, head dims
    8..128, ``x`` either contiguous or the q part of a fused ``[T, H + 2 Hkv, D]`` QKV tensor."""
    _only(variant, "rope", ("neox", "gptj"))
    shapes = [(1, 4, 8, False), (7, 3, 64, True), (5, 2, 128, False), (19, 1, 16, True)]  # (T, H, D, fused)
    if quick:
        shapes = shapes[:2]
    cases = []
    for t, h, d, fused in shapes:
        x = _fused_split(g, t, (h, 2, 2), d)[0] if fused else _randn(g, t, h, d)
        positions = torch.randint(0, 8192, (t,), generator=g)
        cos, sin = rope_cos_sin(positions, default_inv_freq(d, 10000.0))
        label = f"T={t} H={h} D={d} x={'q of fused qkv' if fused else 'contiguous'}"
        cases.append(Case("rope", variant, label, (x, cos, sin)))
    return cases


def silu_mul_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``silu_mul``: odd N, large negative/positive gates, gate/up as halves of a fused ``[T, 2N]``."""
    _only(variant, "silu_mul", ("f32",))
    shapes = [(1, 64, 1.0, False), (7, 97, 8.0, True), (33, 130, 1.0, True)]  # (T, N, gate scale, fused)
    if quick:
        shapes = shapes[:2]
    cases = []
    for t, n, scale, fused in shapes:
        if fused:
            gate, up = _fused_split(g, t, (n, n))
            gate.mul_(scale)
        else:
            gate, up = _randn(g, t, n, scale=scale), _randn(g, t, n)
        label = f"T={t} N={n} |gate|~{scale:g} {'gate/up = halves of fused [T, 2N]' if fused else 'contiguous'}"
        cases.append(Case("silu_mul", variant, label, (gate, up)))
    return cases


def swiglu_clamped_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``swiglu_clamped``: odd N, gates and ups well past the limit on both sides, gpt-oss's
    ``alpha``/``limit`` and others, gate/up as halves of a fused ``[T, 2N]``."""
    _only(variant, "swiglu_clamped", ("f32",))
    shapes = [(1, 64, 1.0, 1.702, 7.0, False), (7, 97, 12.0, 1.702, 7.0, True),
              (33, 130, 3.0, 1.0, 1.5, True)]  # (T, N, scale, alpha, limit, fused)
    if quick:
        shapes = shapes[:2]
    cases = []
    for t, n, scale, alpha, limit, fused in shapes:
        gate, up = _fused_split(g, t, (n, n)) if fused else (_randn(g, t, n), _randn(g, t, n))
        gate.mul_(scale)
        up.mul_(scale)
        label = (f"T={t} N={n} |gate|,|up|~{scale:g} alpha={alpha:g} limit={limit:g} "
                 f"{'gate/up = halves of fused [T, 2N]' if fused else 'contiguous'}")
        cases.append(Case("swiglu_clamped", variant, label, (gate, up, alpha, limit)))
    return cases


# ---------------------------------------------------------------------------- attention


@attrs.frozen
class _Seq:
    """One sequence of an attention batch: ``q`` new tokens at the end of ``ctx`` cached ones."""

    q: int
    ctx: int

    @property
    def kind(self) -> str:
        if self.q == 1 and self.ctx > 1:
            return "decode"
        return "new-prefill" if self.q == self.ctx else "append-prefill"


def _paged_layout(g: torch.Generator, seqs: list[_Seq], bs: int,
                  window: int | None = None) -> tuple[int, torch.Tensor, list[int], int]:
    """``(NB, block_tables int64 [S, MB], slots of the new tokens, freed blocks)``: each
    sequence's blocks handed out in random order from a pool with two spare blocks, every
    row padded with at least one -1, and with ``window`` the blocks wholly before the first
    query's window set to -1 (the KV cache freed them)."""
    n_blocks = [-(-s.ctx // bs) for s in seqs]
    num_blocks = sum(n_blocks) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(n_blocks) + 1  # at least one -1 of padding per row
    table = torch.full((len(seqs), width), -1, dtype=torch.int64)
    slots: list[int] = []
    freed = 0
    for i, s in enumerate(seqs):
        blocks = [order.pop() for _ in range(n_blocks[i])]
        table[i, : n_blocks[i]] = torch.tensor(blocks)
        if window is not None:
            first = first_window_block(s.q, s.ctx, window, bs)
            table[i, :first] = -1  # the KV cache freed them: the kernel must not read them
            freed += first
        slots += [blocks[p // bs] * bs + p % bs for p in range(s.ctx - s.q, s.ctx)]
    return num_blocks, table, slots, freed


def _paged_case(g: torch.Generator, op: str, variant: str, *, h: int, hkv: int, d: int, bs: int, seqs: list[_Seq],
                window: int | None = None, fused: bool = False, cache_dtype: torch.dtype = torch.float32,
                note: str = "") -> Case:
    """A paged-attention batch: blocks handed out in random order, unused cache slots (and
    freed blocks) holding random values, so a kernel reading past a context or before a
    window's first block gets a wrong answer instead of a lucky zero. With a 16-bit
    ``cache_dtype`` (``runtime.kv_cache.dtype``) the new keys/values are representable in it,
    so every correct conversion stores them exactly."""
    num_blocks, table, slots, freed = _paged_layout(g, seqs, bs, window)
    t = sum(s.q for s in seqs)
    if fused:
        q, k, v = _fused_split(g, t, (h, hkv, hkv), d)
    else:
        q, k, v = _randn(g, t, h, d), _randn(g, t, hkv, d), _randn(g, t, hkv, d)
    k_cache = _randn(g, num_blocks, bs, hkv, d).to(cache_dtype)
    v_cache = _randn(g, num_blocks, bs, hkv, d).to(cache_dtype)
    if cache_dtype != torch.float32:
        k.copy_(k.to(cache_dtype))
        v.copy_(v.to(cache_dtype))
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), table, tuple(s.q for s in seqs),
                             tuple(s.ctx for s in seqs), d ** -0.5)
    kinds = "+".join(s.kind for s in seqs)
    ratio = "MQA" if hkv == 1 else f"GQA {h // hkv}"
    label = (f"{kinds} (q,ctx)={[(s.q, s.ctx) for s in seqs]} H={h} Hkv={hkv} ({ratio}) D={d} BS={bs}"
             + (f" window={window} freed blocks={freed}" if window is not None else "")
             + (" q/k/v = views of fused qkv" if fused else "")
             + (f" cache {DENSE_FORMATS[cache_dtype]}" if cache_dtype != torch.float32 else "")
             + (f" {note}" if note else ""))
    args = (q, k, v, k_cache, v_cache, meta) + ((window,) if window is not None else ())
    return Case(op, variant, label, args, placed=frozenset({3, 4}), written=(3, 4))


def attention_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``attention[paged]``: New Prefill across block edges, Append Prefill, decode batches at
    and just past block boundaries, a mixed batch; block sizes 1, 5, 16; GQA 1, 2, 4, 8, MQA;
    f32, f16 and bf16 caches."""
    _only(variant, "attention", ("paged",))
    op = "attention"
    specs: list[dict[str, Any]] = [
        dict(h=4, hkv=4, d=16, bs=16, seqs=[_Seq(37, 37)]),
        dict(h=8, hkv=2, d=64, bs=16, seqs=[_Seq(5, 35)], fused=True),
        dict(h=8, hkv=1, d=32, bs=16, seqs=[_Seq(1, 16), _Seq(1, 17), _Seq(1, 1), _Seq(1, 40)]),
        dict(h=4, hkv=2, d=8, bs=1, seqs=[_Seq(6, 6), _Seq(3, 9), _Seq(1, 12)]),
        dict(h=8, hkv=1, d=16, bs=5, seqs=[_Seq(1, 23), _Seq(11, 11), _Seq(4, 14)], fused=True),
        dict(h=16, hkv=2, d=16, bs=16, seqs=[_Seq(2, 33), _Seq(1, 48), _Seq(17, 17)]),
        dict(h=3, hkv=1, d=128, bs=16, seqs=[_Seq(9, 70)]),
        dict(h=8, hkv=2, d=64, bs=16, seqs=[_Seq(1, 40), _Seq(6, 21), _Seq(1, 3)], cache_dtype=torch.float16),
        dict(h=4, hkv=1, d=32, bs=5, seqs=[_Seq(1, 23), _Seq(9, 9)], fused=True, cache_dtype=torch.bfloat16),
    ]
    if quick:
        specs = [specs[0], specs[2], specs[4], specs[7]]
    return [_paged_case(g, op, variant, **s) for s in specs]


def attention_sliding_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``attention_sliding[paged]``: windows shorter than, equal to and not a multiple of the
    block size; decode and Append Prefill rows whose early blocks are freed (-1); a New
    Prefill longer than the window (nothing freed, the mask alone limits it); f32, f16 and
    bf16 caches."""
    _only(variant, "attention_sliding", ("paged",))
    op = "attention_sliding"
    specs: list[dict[str, Any]] = [
        dict(h=4, hkv=2, d=16, bs=16, window=16, seqs=[_Seq(40, 40)]),
        dict(h=8, hkv=1, d=32, bs=16, window=7, seqs=[_Seq(1, 50), _Seq(1, 17)]),
        dict(h=4, hkv=4, d=8, bs=4, window=6, seqs=[_Seq(5, 29), _Seq(1, 30), _Seq(12, 12)], fused=True),
        dict(h=8, hkv=2, d=64, bs=1, window=3, seqs=[_Seq(2, 9), _Seq(1, 4)]),
        dict(h=8, hkv=1, d=16, bs=5, window=11, seqs=[_Seq(1, 36), _Seq(7, 40)]),
        dict(h=8, hkv=2, d=32, bs=4, window=9, seqs=[_Seq(1, 30), _Seq(3, 17)], cache_dtype=torch.float16),
        dict(h=4, hkv=4, d=16, bs=16, window=20, seqs=[_Seq(1, 45)], cache_dtype=torch.bfloat16),
    ]
    if quick:
        specs = specs[1:3]
    return [_paged_case(g, op, variant, **s) for s in specs]


def attention_sinks_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``attention_sinks[paged]``: full attention (window None) and sliding windows with
    freed blocks; New Prefill, Append Prefill, decode and mixed batches; GQA and MQA; sinks
    below, around and far above the scores (a sink that takes almost all the mass leaves a
    tiny output, and one of -inf-like size changes nothing); f16 and bf16 caches."""
    _only(variant, "attention_sinks", ("paged",))
    specs: list[dict[str, Any]] = [
        dict(h=4, hkv=2, d=16, bs=16, seqs=[_Seq(37, 37)]),
        dict(h=8, hkv=1, d=32, bs=16, seqs=[_Seq(1, 16), _Seq(1, 17), _Seq(1, 1), _Seq(1, 40)], sink_scale=8.0),
        dict(h=4, hkv=2, d=8, bs=5, seqs=[_Seq(6, 6), _Seq(3, 19), _Seq(1, 12)], fused=True),
        dict(h=4, hkv=2, d=16, bs=16, window=16, seqs=[_Seq(40, 40)]),
        dict(h=8, hkv=2, d=16, bs=4, window=7, seqs=[_Seq(1, 50), _Seq(5, 29)], sink_scale=8.0),
        dict(h=8, hkv=2, d=32, bs=16, seqs=[_Seq(1, 40), _Seq(6, 21)], cache_dtype=torch.float16),
        dict(h=4, hkv=4, d=16, bs=5, window=11, seqs=[_Seq(1, 36), _Seq(7, 30)], cache_dtype=torch.bfloat16),
    ]
    if quick:
        specs = [specs[1], specs[2], specs[4]]
    cases = []
    for spec in specs:
        sink_scale = spec.pop("sink_scale", 2.0)
        window = spec.get("window")
        case = _paged_case(g, "attention_sinks", variant, **spec)
        sinks = _randn(g, spec["h"], scale=sink_scale)  # [H]
        cases.append(attrs.evolve(case, args=case.args[:6] + (sinks, window),
                                  label=f"{case.label} |sinks|~{sink_scale:g}"))
    return cases


def mla_attention_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """``mla_attention[paged]``: New Prefill across block edges, Append Prefill over cached
    latent rows, decode batches at and past block boundaries, mixed batches; block sizes 1,
    5, 16; f32, f16 and bf16 latent caches; ``kv_b_proj`` in f32, bf16 and q8_0; ``q_nope`` and
    ``q_pe`` as views of one projected query (DeepSeek's ``q.split([Dn, Dr])``). Dimension
    names as in :mod:`zllm.domain.mla` (``R`` kv_lora_rank, ``Dn``/``Dr``/``Dv`` head dims)."""
    _only(variant, "mla_attention", ("paged",))
    specs = [  # (H, Dn, Dr, Dv, R, BS, seqs, cache dtype, kv_b_proj format)
        (4, 16, 8, 16, 32, 16, [_Seq(37, 37)], torch.float32, "f32"),
        (2, 8, 4, 12, 16, 5, [_Seq(1, 23), _Seq(1, 5), _Seq(1, 1), _Seq(1, 11)], torch.float32, "f32"),
        (3, 16, 8, 8, 32, 1, [_Seq(6, 6), _Seq(3, 9), _Seq(1, 12)], torch.float32, "q8_0"),
        (4, 8, 8, 8, 24, 16, [_Seq(5, 35), _Seq(1, 17), _Seq(1, 16)], torch.float16, "f32"),
        (8, 16, 4, 16, 32, 5, [_Seq(1, 23), _Seq(11, 11), _Seq(4, 14)], torch.bfloat16, "bf16"),
        (1, 32, 16, 32, 64, 16, [_Seq(9, 70), _Seq(1, 48)], torch.float32, "f32"),
    ]
    if quick:
        specs = [specs[0], specs[1], specs[3]]
    cases = []
    for h, dn, dr, dv, r, bs, seqs, cache_dtype, fmt in specs:
        num_blocks, table, slots, _ = _paged_layout(g, seqs, bs)
        t = sum(s.q for s in seqs)
        q_nope, q_pe = _randn(g, t, h * (dn + dr)).view(t, h, dn + dr).split([dn, dr], dim=-1)
        latent = _randn(g, t, r + dr)
        latent_cache = _randn(g, num_blocks, bs, r + dr).to(cache_dtype)
        if cache_dtype != torch.float32:
            latent.copy_(latent.to(cache_dtype))
        kv_b_proj = make_weight(g, fmt, h * (dn + dv), r)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), table, tuple(s.q for s in seqs),
                                 tuple(s.ctx for s in seqs), (dn + dr) ** -0.5)
        kinds = "+".join(s.kind for s in seqs)
        label = (f"{kinds} (q,ctx)={[(s.q, s.ctx) for s in seqs]} H={h} Dn={dn} Dr={dr} Dv={dv} R={r} BS={bs} "
                 f"kv_b_proj={fmt}" + (f" cache {DENSE_FORMATS[cache_dtype]}" if cache_dtype != torch.float32 else ""))
        cases.append(Case("mla_attention", variant, label, (q_nope, q_pe, latent, latent_cache, kv_b_proj, meta),
                          placed=frozenset({3, 4}), written=(3,)))
    return cases


# ---------------------------------------------------------------------------- registry


def _only(variant: str, op: str, variants: tuple[str, ...]) -> None:
    if variant not in variants:
        known = ", ".join(f"{op}[{v}]" for v in variants)
        raise NoCases(f"no case generator for {op}[{variant}] (the kit knows {known})")


CaseGenerator = Callable[[str, torch.Generator, bool], list[Case]]
"""``generator(variant, torch.Generator, quick) -> cases``; raises :class:`NoCases` for a
variant it cannot build inputs for. An op's declaration names its generator
(:attr:`~zllm.capabilities.ops.OpDeclaration.cases`)."""


def cases_for(op: str, variant: str, seed: int, quick: bool = False, ops: OpTable = CORE_OPS) -> list[Case]:
    """The cases for ``op[variant]``, generated from ``seed`` (the same seed gives the same
    cases) by the generator ``op``'s declaration in ``ops`` names; each case carries the
    declared argument names.

    Raises:
        NoCases: ``op`` is not declared in ``ops``, its generator cannot be imported, or it
            has no cases for this variant.
    """
    if op not in ops:
        raise NoCases(f"no case generator for op {op!r}: it is not declared (declared ops: {', '.join(ops.names)})")
    decl = ops[op]
    module, _, attr = decl.cases.partition(":")
    try:
        gen: CaseGenerator = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise NoCases(f"the case generator {decl.cases!r} of op {op!r} cannot be imported: "
                      f"{type(exc).__name__}: {exc}") from None
    g = torch.Generator().manual_seed(seed)
    return [attrs.evolve(case, arg_names=decl.args) for case in gen(variant, g, quick)]
