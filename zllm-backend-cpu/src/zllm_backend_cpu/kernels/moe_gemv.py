"""``moe`` through the native MoE kernel (:mod:`.native`, ``csrc/moe.c``): after the core's f32
router, one C call per layer runs every selected expert's gate/up GEMV, SiLU-and-mul and down
GEMV, the weighted sum and the shared expert, in the weights' stored formats. gpt-oss's
``moe_clamped_swiglu`` runs :mod:`.moe_biased`'s algorithm with its experts' rows through the
native GEMVs.

Dimension legend as in :mod:`.moe`.

A decode step routes each token to ``k`` experts; a per-expert loop in Python cost 6-8 torch
dispatches an expert (128-156 experts a step for the benchmark's models), more than the
expert GEMVs themselves. The native call buckets the (token, slot) pairs by expert, streams
each selected expert's rows once for all the tokens that chose it (the native GEMV's row
kernels, ``csrc/gemv.c``) and sums each token's rows in ascending expert index, the order of
the reference. Prefill takes the same kernel, :data:`MOE_CHUNK_TOKENS` tokens a call (which
bounds its scratch): its buckets hold a few to a few dozen rows each, where the row kernels
(weights widened once per pair of rows, in L1) beat a torch GEMM per expert with its tile
decode and dispatches (measured 4-20x on the benchmark's Qwen3-MoE layer at 32-128 tokens, 2
threads, on a busy machine). Every GGUF format runs natively, the k-quants included
(``csrc/kquant_gemv.c``: decode of a Qwen3-MoE-shaped Q4_K layer at T=1 went from the
per-expert loop's torch tile decode to one native call, see ``docs/performance.md``); weights in
a format the native GEMV does not have (the HF checkpoints' formats of :mod:`.quant_gemv`) take
:mod:`.moe`'s per-expert loop over their ``linear`` kernels. Registered only when the native
library loads.

Numerics: those of ``csrc/gemv.c`` for each product (dense formats: f32 products, ~1e-6 from
the reference; block formats, k-quants included: ``x`` and the expert's hidden row ``h``
quantized to int16 per block of 32, ~1e-5 relative); every value is reduced in a fixed order
that depends only on the shapes and formats, and each token's activations are quantized from
its own rows, so an output row is bit-identical whatever else is in the call and whatever the
thread count:
:func:`moe_gemv_invariant` runs the native kernel for every ``T``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zllm.plugin_api import QuantizedTensor, RouterConfig, SharedExperts, format_of, select_experts
from zllm_backend_cpu.kernels import GEMV_FORMATS, elementwise, gemv, moe_biased, quant_gemv
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
from zllm_backend_cpu.kernels.native import I64, INT, P, function

# tokens per native call: scratch ~ T * (2 k K + 2 k N) f32 values (~14 MiB for the benchmark's
# Qwen3-MoE layer), and a token's result does not depend on its chunk
MOE_CHUNK_TOKENS = 256

_FORMAT_NUMBER = {fmt: i for i, fmt in enumerate(GEMV_FORMATS)}  # gemv.h's enum
# zllm_moe(x, x_row_stride, T, K, ids, weights, k, E, N, desc, Ns, shared_scale | NULL, out, threads)
_ARGTYPES = (P, I64, I64, I64, P, P, I64, I64, I64, P, I64, P, P, INT)


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


def _matrix(stack: Weight) -> tuple[list[int], torch.Tensor]:
    """``[address, expert stride in bytes, row stride, format number]`` of a ``[E, R, C]`` or
    ``[R, C]`` weight (row stride in elements, bytes for the block formats) and the tensor
    holding its bytes (kept alive for the call)."""
    data = stack.data if isinstance(stack, QuantizedTensor) else stack
    if data.stride(-1) != 1:
        data = data.contiguous()
    expert_stride = data.stride(0) * data.element_size() if data.dim() == 3 else 0
    return [data.data_ptr(), expert_stride, data.stride(-2), _FORMAT_NUMBER[format_of(stack)]], data


# gate stack -> (the other weights it was described with, the descriptor): a layer's weights
# are described once, not every step; an entry goes with its gate stack.
_DESCRIPTORS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _descriptor(matrices: list[Weight], shared: SharedExperts | None) -> tuple[ctypes.Array, list[torch.Tensor]]:
    """The kernel's ``desc`` (:func:`_matrix` of each of ``matrices``, up to six rows of four)
    and the copies it points into (weights without unit inner stride). Remembered per gate
    stack when no weight needed a copy: the addresses are then the weights' own, valid while
    they live (a weight's bytes may be written in place, its storage is never swapped)."""
    hit = _DESCRIPTORS.get(matrices[0])
    if hit is not None and hit[0] is matrices[1] and hit[1] is matrices[2] and hit[2] is shared:
        return hit[3], []
    described = [_matrix(m) for m in matrices]
    desc = (ctypes.c_int64 * 24)(*(v for d, _ in described for v in d))
    held = [data for _, data in described]
    if all(data is (m.data if isinstance(m, QuantizedTensor) else m)
           for (_, data), m in zip(described, matrices, strict=True)):
        _DESCRIPTORS[matrices[0]] = (matrices[1], matrices[2], shared, desc)
    return desc, held


def native_formats(gate_exps: Weight, up_exps: Weight, down_exps: Weight, shared: SharedExperts | None) -> bool:
    """Whether the native kernel has every weight's format (each of the six may differ)."""
    weights = [gate_exps, up_exps, down_exps]
    if shared is not None:
        weights += [shared.gate_proj, shared.up_proj, shared.down_proj]
    return all(format_of(w) in _FORMAT_NUMBER for w in weights)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_exps: Weight,
    up_exps: Weight,
    down_exps: Weight,
    shared: SharedExperts | None = None,
    shared_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum (+ the shared expert) by the native kernel, for a given
    routing: ``x`` f32 ``[T, K]``; ``topk_ids`` int64 ``[T, k]`` (an expert may repeat: each
    slot counts); ``topk_weights`` f32 ``[T, k]``; ``gate_exps``, ``up_exps`` ``[E, N, K]`` and
    ``down_exps`` ``[E, K, N]`` in a native GEMV format (:data:`GEMV_FORMATS`, each its own);
    ``shared`` experts in such formats or None; ``shared_scale`` f32 ``[T]`` or ``[T, 1]``
    multiplying the shared expert's output (Qwen2-MoE's gate), or None for 1 -> f32 ``[T, K]``:
    ``sum_slot w * down(silu(gate x) * up x)`` per token, ascending expert index.

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
    desc, held = _descriptor(matrices, shared)  # held: copies the descriptor points into, alive through the calls
    if x.stride(1) != 1:
        x = x.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    scale = None if shared_scale is None else shared_scale.float().contiguous().view(t)
    out = torch.empty(t, hidden)  # [T, K]
    fn, threads = _native_moe(), torch.get_num_threads()
    # chunk starts as addresses: a view per chunk would cost more than a decode step's call
    x_ptr, ids_ptr, w_ptr, out_ptr = x.data_ptr(), ids.data_ptr(), weights.data_ptr(), out.data_ptr()
    x_row, pair_row = 4 * x.stride(0), top_k * ids.element_size()
    for start in range(0, t, MOE_CHUNK_TOKENS):
        rows = min(MOE_CHUNK_TOKENS, t - start)
        fn(x_ptr + start * x_row, x.stride(0), rows, hidden, ids_ptr + start * pair_row, w_ptr + start * 4 * top_k,
           top_k, n_experts, width, desc, shared_width, None if scale is None else scale.data_ptr() + 4 * start,
           out_ptr + start * 4 * hidden, threads)
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
    """:func:`~zllm_backend_cpu.kernels.moe_biased.moe_clamped_swiglu` with each bucket of up to 16
    rows through the native GEMVs (one read of the expert's weights; the HF checkpoints' formats,
    MXFP4 experts among them, through :mod:`.quant_gemv`), larger ones and the formats no GEMV has
    through the torch kernels; arguments as it."""
    return moe_biased.run_experts(x, topk_ids, topk_weights, (gate_exps, up_exps, down_exps),
                                  (gate_bias, up_bias, down_bias), alpha, limit, _linear, moe_biased.swiglu_clamped)
