"""``moe`` and gpt-oss's ``moe_clamped_swiglu`` through the native MoE kernel (:mod:`.native`,
``csrc/moe.c``): after the core's f32 router, one C call per layer runs every selected expert's
gate/up GEMV (+ bias), the activation (SiLU-and-mul, or the clamped SwiGLU of
:mod:`.moe_biased`), the down GEMV (+ bias), the weighted sum and the shared expert, in the
weights' stored formats.

Dimension legend as in :mod:`.moe`.

A decode step routes each token to ``k`` experts; a per-expert loop in Python cost 6-8 torch
dispatches an expert (128-156 experts a step for the benchmark's models), more than the
expert GEMVs themselves. The native call buckets the (token, slot) pairs by expert, streams
each selected expert's rows once for all the tokens that chose it (the native GEMV's row
kernels: ``csrc/gemv.c`` for the GGUF and dense formats, ``csrc/quant_gemv.c``'s dispatch
through ``csrc/quant_gemv.h`` for the HF kernel layouts) and sums each token's rows in
ascending expert index, the order of the reference. Prefill takes the same kernel,
:data:`MOE_CHUNK_TOKENS` tokens a call (which bounds its scratch): its buckets hold a few to a
few dozen rows each, where the row kernels (weights widened once per pair of rows, in L1) beat
a torch GEMM per expert with its tile decode and dispatches (measured 4-20x on the benchmark's
Qwen3-MoE layer at 32-128 tokens, 2 threads, on a busy machine; 1.5x for gpt-oss's MXFP4 layer
at 128 tokens against :mod:`.quant_gemv`'s tile decode + ``torch.mm`` per expert, see
``docs/performance.md``). Every GGUF format runs natively, the k-quants included
(``csrc/kquant_gemv.c``), and every HF layout of :data:`QUANT_GEMV_FORMATS` (gpt-oss's MXFP4
experts, from the HF checkpoint or repacked from GGUF, among them). The per-expert loops stay
only where the kernel cannot take a weight: a format no native GEMV has, and an act-order INT
stack (``perm``: its columns would need permuting per expert) — :mod:`.moe`'s loop for ``moe``,
:mod:`.moe_biased`'s for ``moe_clamped_swiglu``. Registered only when the native library loads.

Numerics: those of ``csrc/gemv.c`` / ``csrc/quant_gemv.c`` for each product (dense formats and
the HF layouts: f32 activations, ~1e-6 from the reference; GGUF block formats, k-quants
included: ``x`` and the expert's hidden row ``h`` quantized to int16 per block of 32, ~1e-5
relative), a bias added to the row's sum, the activation in fixed 8-lane steps (common.h's
``exp``, 1 ulp; the reference's order of operations); every value is reduced in a fixed order
that depends only on the shapes and formats, and each token's activations are quantized (or
prepared) from its own rows, so an output row is bit-identical whatever else is in the call and
whatever the thread count: :func:`moe_gemv_invariant` and
:func:`moe_clamped_swiglu_gemv_invariant` run the native kernel for every ``T``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zllm.plugin_api import QuantizedTensor, RouterConfig, SharedExperts, format_of, select_experts
from zllm_backend_cpu.kernels import GEMV_FORMATS, QUANT_GEMV_FORMATS, elementwise, gemv, moe_biased, quant_gemv
from zllm_backend_cpu.kernels.moe import (
    Linear,
    Weight,
    check_args,
    in_tiles,
    moe_kernel,
    route_in_tiles,
    torch_linear,
    torch_linear_invariant,
)
from zllm_backend_cpu.kernels.native import F32, I64, INT, P, function

# tokens per native call: scratch ~ T * (2 k K + 2 k N) f32 values (~14 MiB for the benchmark's
# Qwen3-MoE layer), and a token's result does not depend on its chunk
MOE_CHUNK_TOKENS = 256

# csrc/moe.c's format numbers: gemv.h's enum, then the HF layouts (csrc/moe.c's HF_LAYOUTS)
_FORMAT_NUMBER = {fmt: i for i, fmt in enumerate((*GEMV_FORMATS, *QUANT_GEMV_FORMATS))}
# csrc/moe.c's activations
SILU_MUL, SWIGLU_CLAMPED = 0, 1
# zllm_moe(x, x_row_stride, T, K, ids, weights, k, E, N, desc, Ns, shared_scale | NULL, act, alpha, limit, out,
#          threads)
_ARGTYPES = (P, I64, I64, I64, P, P, I64, I64, I64, P, I64, P, INT, F32, F32, P, INT)
# a matrix's row of the descriptor (csrc/moe.c's D_* fields)
_DESC_FIELDS = 14


@functools.cache
def _native_moe() -> Callable[..., None]:
    """``zllm_moe``, bound on first use (importing this module needs no library)."""
    return function("zllm_moe", *_ARGTYPES)


def _gemv_or(native: Linear, fallback: Linear) -> Linear:
    """``native`` for the formats the native GEMV has, ``fallback`` for the others."""

    def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return (native if format_of(weight) in gemv.FORMATS else fallback)(x, weight, bias)

    return linear


_GEMV_OR_TORCH = _gemv_or(gemv.linear_gemv, torch_linear)


def _linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The HF checkpoints' formats through :mod:`.quant_gemv` (its GEMV, or its native tile
    decode + ``torch.mm``), the others as :func:`_gemv_or`."""
    if format_of(weight) in quant_gemv.LAYOUTS:
        return quant_gemv.linear_quant_gemv(x, weight, bias)  # type: ignore[arg-type]
    return _GEMV_OR_TORCH(x, weight, bias)


_loop = moe_kernel(
    "moe_gemv_loop", _linear, elementwise.silu_mul, batch_invariant=False,
    doc="The per-expert loop of :mod:`.moe` over the native GEMVs and :mod:`.quant_gemv`.",
)
_loop_invariant = moe_kernel(
    "moe_gemv_loop_invariant", _gemv_or(gemv.linear_gemv_invariant, torch_linear_invariant), elementwise.silu_mul,
    batch_invariant=True,
    doc="Batch-invariant per-expert loop (formats without a native GEMV: the invariant torch ``linear``).",
)


def _address(t: torch.Tensor | None) -> tuple[int, int]:
    """``(address, stride of the leading dimension in bytes)`` of a part (0s for None); the
    stride is that of an expert stack's experts, 0 for a part without one."""
    if t is None:
        return 0, 0
    return t.data_ptr(), t.stride(0) * t.element_size() if t.dim() >= 1 else 0


def _matrix(stack: Weight, bias: torch.Tensor | None) -> tuple[list[int], list[torch.Tensor]]:
    """csrc/moe.c's descriptor row of a ``[E, R, C]`` or ``[R, C]`` weight and its f32 bias
    (``[E, R]`` / ``[R]``, unit inner stride, or None) and the tensors its addresses point into
    (copies where a part was not laid out as the kernel reads it)."""
    fmt = format_of(stack)
    stacked = len(stack.shape) == 3
    if isinstance(stack, QuantizedTensor) and fmt in quant_gemv.LAYOUTS:
        parts = {name: t if t.is_contiguous() else t.contiguous() for name, t in stack.parts.items()}
        q = parts["qweight"]
        scales = parts["scale" if fmt == "fp8_e4m3" else "scales"]
        zeros, glob = parts.get("zeros"), parts.get("global_scale")
        bn, g = stack.block_shape
        row = [*(_address(q) if stacked else (q.data_ptr(), 0)), q.stride(-2), _FORMAT_NUMBER[fmt],
               *(_address(scales) if stacked else (scales.data_ptr(), 0)),
               *(_address(zeros) if stacked or zeros is None else (zeros.data_ptr(), 0)),
               *(_address(glob) if stacked or glob is None else (glob.data_ptr(), 0)), g, bn]
        held = list(parts.values())
    else:
        data = stack.data if isinstance(stack, QuantizedTensor) else stack
        if data.stride(-1) != 1:
            data = data.contiguous()
        expert_stride = data.stride(0) * data.element_size() if data.dim() == 3 else 0
        row = [data.data_ptr(), expert_stride, data.stride(-2), _FORMAT_NUMBER[fmt], 0, 0, 0, 0, 0, 0, 0, 0]
        held = [data]
    if bias is None:
        row += [0, 0]
    else:
        assert bias.dtype == torch.float32 and bias.stride(-1) == 1, (bias.dtype, bias.stride())
        row += [bias.data_ptr(), bias.stride(0) * 4 if bias.dim() == 2 else 0]
        held.append(bias)
    return row, held


def _own(stack: Weight, held: list[torch.Tensor]) -> bool:
    """Whether ``held`` (:func:`_matrix`'s tensors of ``stack``, bias excluded) are the stack's own."""
    own = stack.parts.values() if isinstance(stack, QuantizedTensor) and format_of(stack) in quant_gemv.LAYOUTS else (
        [stack.data if isinstance(stack, QuantizedTensor) else stack])
    return all(a is b for a, b in zip(held, own, strict=False))


# bias -> (its version, its f32 copy): a bf16 checkpoint's biases are widened once, again only
# after an in-place write (torch counts those in ``_version``).
_F32_BIASES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _f32_bias(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` as f32 with unit inner stride (itself when it is)."""
    if bias.dtype == torch.float32 and bias.stride(-1) == 1:
        return bias
    hit = _F32_BIASES.get(bias)
    if hit is not None and hit[0] == bias._version:
        return hit[1]
    copy = bias.float().contiguous()
    _F32_BIASES[bias] = (bias._version, copy)
    return copy


# gate stack -> (the other weights and biases it was described with, their versions, the
# descriptor, the f32 biases it points into): a layer's weights are described once, not every
# step; an entry goes with its gate stack.
_DESCRIPTORS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _descriptor(matrices: list[Weight], biases: list[torch.Tensor | None],
                shared: SharedExperts | None) -> tuple[ctypes.Array, list[torch.Tensor]]:
    """The kernel's ``desc`` (:func:`_matrix` of each of ``matrices`` with its bias, up to six
    rows) and the tensors it points into. Remembered per gate stack when no weight needed a
    copy: the addresses are then the weights' own, valid while they live (a weight's bytes may
    be written in place, its storage is never swapped); a bias widened to f32 is remembered with
    the bias's version, so a write to the bias makes a new descriptor."""
    others = (*matrices[1:3], shared, *biases)
    versions = tuple(-1 if b is None else b._version for b in biases)
    hit = _DESCRIPTORS.get(matrices[0])
    if (hit is not None and len(hit[0]) == len(others) and all(a is b for a, b in zip(hit[0], others, strict=True))
            and hit[1] == versions):
        return hit[2], hit[3]
    f32 = [None if b is None else _f32_bias(b) for b in biases]
    described = [_matrix(m, b) for m, b in zip(matrices, f32, strict=True)]
    desc = (ctypes.c_int64 * (6 * _DESC_FIELDS))(*(v for row, _ in described for v in row))
    held = [t for _, h in described for t in h]
    if all(_own(m, h) for m, (_, h) in zip(matrices, described, strict=True)):
        _DESCRIPTORS[matrices[0]] = (others, versions, desc, [b for b in f32 if b is not None])
    return desc, held


def native_formats(gate_exps: Weight, up_exps: Weight, down_exps: Weight, shared: SharedExperts | None) -> bool:
    """Whether the native kernel has every weight's format (each of the six may differ): those of
    the native GEMVs (:data:`GEMV_FORMATS`, :data:`QUANT_GEMV_FORMATS`), but not an act-order
    (``perm``) INT stack, whose columns the kernel does not permute."""
    weights = [gate_exps, up_exps, down_exps]
    if shared is not None:
        weights += [shared.gate_proj, shared.up_proj, shared.down_proj]
    return all(format_of(w) in _FORMAT_NUMBER and not (isinstance(w, QuantizedTensor) and "perm" in w.parts)
               for w in weights)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_exps: Weight,
    up_exps: Weight,
    down_exps: Weight,
    shared: SharedExperts | None = None,
    shared_scale: torch.Tensor | None = None,
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
    clamped: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum (+ the shared expert) by the native kernel, for a given
    routing: ``x`` f32 ``[T, K]``; ``topk_ids`` int64 ``[T, k]`` (an expert may repeat: each
    slot counts); ``topk_weights`` f32 ``[T, k]``; ``gate_exps``, ``up_exps`` ``[E, N, K]`` and
    ``down_exps`` ``[E, K, N]`` in a native GEMV format (:data:`GEMV_FORMATS`,
    :data:`QUANT_GEMV_FORMATS` without ``perm``; each its own); ``shared`` experts in such
    formats or None; ``shared_scale`` f32 ``[T]`` or ``[T, 1]`` multiplying the shared expert's
    output (Qwen2-MoE's gate), or None for 1; ``biases`` of gate, up, down (``[E, N]``,
    ``[E, N]``, ``[E, K]``, any float dtype, added in f32 to the row's product) or None each;
    ``clamped`` ``(alpha, limit)`` for gpt-oss's clamped SwiGLU, None for SiLU-and-mul -> f32
    ``[T, K]``: ``sum_slot w * (down(act(gate x + bg, up x + bu)) + bd)`` per token, ascending
    expert index.

    An id outside ``[0, E)`` makes the output NaN (the kernel reads no weight for it).

    Raises:
        RuntimeError: the native library is unavailable (see :mod:`.native`).
        KeyError: a weight format the native kernel does not have (see :func:`native_formats`).
    """
    t, hidden = x.shape
    n_experts, width, k_in = gate_exps.shape
    top_k = topk_ids.shape[1]
    assert k_in == hidden and tuple(up_exps.shape) == (n_experts, width, hidden), (gate_exps.shape, up_exps.shape)
    assert tuple(down_exps.shape) == (n_experts, hidden, width), (down_exps.shape, gate_exps.shape)
    assert tuple(topk_ids.shape) == tuple(topk_weights.shape) == (t, top_k), (topk_ids.shape, topk_weights.shape)
    assert x.dtype == topk_weights.dtype == torch.float32 and topk_ids.dtype == torch.int64
    matrices = [gate_exps, up_exps, down_exps]
    shared_width = 0
    if shared is not None:
        shared_width = shared.gate_proj.shape[0]
        assert tuple(shared.down_proj.shape) == (hidden, shared_width), (shared.down_proj.shape, shared_width)
        matrices += [shared.gate_proj, shared.up_proj, shared.down_proj]
    desc, held = _descriptor(matrices, [*biases, None, None, None][:len(matrices)], shared)  # alive through the calls
    if x.stride(1) != 1:
        x = x.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    scale = None if shared_scale is None else shared_scale.float().contiguous().view(t)
    out = torch.empty(t, hidden)  # [T, K]
    fn, threads = _native_moe(), torch.get_num_threads()
    act, (alpha, limit) = (SILU_MUL, (0.0, 0.0)) if clamped is None else (SWIGLU_CLAMPED, clamped)
    # chunk starts as addresses: a view per chunk would cost more than a decode step's call
    x_ptr, ids_ptr, w_ptr, out_ptr = x.data_ptr(), ids.data_ptr(), weights.data_ptr(), out.data_ptr()
    x_row, pair_row = 4 * x.stride(0), top_k * ids.element_size()
    for start in range(0, t, MOE_CHUNK_TOKENS):
        rows = min(MOE_CHUNK_TOKENS, t - start)
        fn(x_ptr + start * x_row, x.stride(0), rows, hidden, ids_ptr + start * pair_row, w_ptr + start * 4 * top_k,
           top_k, n_experts, width, desc, shared_width, None if scale is None else scale.data_ptr() + 4 * start,
           act, alpha, limit, out_ptr + start * 4 * hidden, threads)
    return out


def _shared_scale(x: torch.Tensor, shared: SharedExperts | None, invariant: bool) -> torch.Tensor | None:
    """``sigmoid(x gate^T)`` ``[T, 1]`` of a gated shared expert, else None."""
    if shared is None or shared.shared_expert_gate is None:
        return None
    logits = gemv.gemv(x, shared.shared_expert_gate.float(), None)  # [T, 1]
    return in_tiles(torch.sigmoid, logits) if invariant else torch.sigmoid(logits)


def _moe_native(x: torch.Tensor, router_logits: torch.Tensor, router: RouterConfig, gate_exps: Weight,
                up_exps: Weight, down_exps: Weight, correction_bias: torch.Tensor | None, shared: SharedExperts | None,
                *, invariant: bool) -> torch.Tensor:
    """:func:`moe_gemv` (``invariant`` False) or :func:`moe_gemv_invariant` (True)."""
    if not native_formats(gate_exps, up_exps, down_exps, shared):
        loop = _loop_invariant if invariant else _loop
        return loop(x, router_logits, router, gate_exps, up_exps, down_exps, correction_bias, shared)
    check_args(x, router_logits, router)
    routing = (route_in_tiles if invariant else select_experts)(router_logits, router, correction_bias)
    return moe_experts(x, routing.topk_ids, routing.topk_weights, gate_exps, up_exps, down_exps, shared,
                       _shared_scale(x, shared, invariant))


def moe_gemv(x: torch.Tensor, router_logits: torch.Tensor, router: RouterConfig, gate_exps: Weight,
             up_exps: Weight, down_exps: Weight, correction_bias: torch.Tensor | None = None,
             shared: SharedExperts | None = None) -> torch.Tensor:
    """The MoE FFN by the native kernel (module doc), weights of a format it lacks by the
    per-expert loop; arguments as :func:`~zllm_backend_cpu.kernels.moe.moe`. Raises RuntimeError
    when the native library is unavailable (the plugin registers this kernel only when it loads)."""
    return _moe_native(x, router_logits, router, gate_exps, up_exps, down_exps, correction_bias, shared,
                       invariant=False)


def moe_gemv_invariant(x: torch.Tensor, router_logits: torch.Tensor, router: RouterConfig, gate_exps: Weight,
                       up_exps: Weight, down_exps: Weight, correction_bias: torch.Tensor | None = None,
                       shared: SharedExperts | None = None) -> torch.Tensor:
    """Batch-invariant :func:`moe_gemv`: the native kernel (batch-invariant itself), the router
    and the shared-expert gate over fixed tiles; weights of a format the native kernel lacks take
    the batch-invariant per-expert loop; arguments as :func:`~zllm_backend_cpu.kernels.moe.moe`."""
    return _moe_native(x, router_logits, router, gate_exps, up_exps, down_exps, correction_bias, shared,
                       invariant=True)


def moe_clamped_swiglu_gemv(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_exps: Weight,
                            up_exps: Weight, down_exps: Weight, gate_bias: torch.Tensor, up_bias: torch.Tensor,
                            down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """:func:`~zllm_backend_cpu.kernels.moe_biased.moe_clamped_swiglu` by the native kernel
    (:func:`moe_experts` with the biases and the clamped SwiGLU: one call per layer) where it
    has the stacks' formats; else (a format no native GEMV has, an act-order INT stack) the
    per-expert loop of :mod:`.moe_biased` over the native GEMVs and :mod:`.quant_gemv`, the torch
    kernels for the rest; arguments as it. In the native kernel an expert id outside ``[0, E)``
    makes the output NaN (the reference raises; the loop raises IndexError)."""
    if not native_formats(gate_exps, up_exps, down_exps, None):
        return moe_biased.run_experts(x, topk_ids, topk_weights, (gate_exps, up_exps, down_exps),
                                      (gate_bias, up_bias, down_bias), alpha, limit, _linear,
                                      moe_biased.swiglu_clamped)
    n_experts, width, hidden = gate_exps.shape
    assert tuple(gate_bias.shape) == tuple(up_bias.shape) == (n_experts, width), (gate_bias.shape, up_bias.shape)
    assert tuple(down_bias.shape) == (n_experts, hidden), down_bias.shape
    return moe_experts(x, topk_ids, topk_weights, gate_exps, up_exps, down_exps,
                       biases=(gate_bias, up_bias, down_bias), clamped=(alpha, limit))


def moe_clamped_swiglu_gemv_invariant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                                      gate_exps: Weight, up_exps: Weight, down_exps: Weight, gate_bias: torch.Tensor,
                                      up_bias: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                                      limit: float) -> torch.Tensor:
    """Batch-invariant :func:`moe_clamped_swiglu_gemv`: the native kernel (batch-invariant itself);
    stacks it does not take go through
    :func:`~zllm_backend_cpu.kernels.moe_biased.moe_clamped_swiglu_invariant`; arguments as it."""
    if not native_formats(gate_exps, up_exps, down_exps, None):
        return moe_biased.moe_clamped_swiglu_invariant(x, topk_ids, topk_weights, gate_exps, up_exps, down_exps,
                                                       gate_bias, up_bias, down_bias, alpha, limit)
    return moe_clamped_swiglu_gemv(x, topk_ids, topk_weights, gate_exps, up_exps, down_exps, gate_bias, up_bias,
                                   down_bias, alpha, limit)
