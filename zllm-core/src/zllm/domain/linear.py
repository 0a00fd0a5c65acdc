"""f32 references for the weight-reading ops ``linear`` and ``embedding``.

Dimension legend: ``T`` tokens, ``K`` in-features (hidden size), ``N`` out-features,
``V`` vocabulary rows of an embedding table.

Weights are a dense f32/f16/bf16 tensor or a :class:`QuantizedTensor`; the reference upcasts
or dequantizes the whole weight to f32 and then does plain f32 math (``y = x W^T + b``, as
``torch.nn.functional.linear``). Device kernels must not do this (DESIGN principle 7); the
reference may, because it is the oracle.
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import OpDeclaration
from zllm.domain.quant import dequantize
from zllm.weights.formats import ALL_FORMATS, QuantizedTensor, format_of


def weight_to_f32(weight: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """The whole weight as f32 ``[rows, cols]``: upcast a dense one, dequantize a quantized one.

    Raises:
        ValueError: an unsupported dense dtype or block layout.
    """
    if isinstance(weight, QuantizedTensor):
        return dequantize(weight)
    format_of(weight)  # raises ValueError on an unsupported dtype
    return weight.float()


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b``: ``x`` f32 ``[T, K]``, ``weight`` ``[N, K]``, ``bias`` f32 ``[N]`` or None -> f32 ``[T, N]``."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    n, k = weight.shape
    assert x.shape[1] == k, (x.shape, weight.shape)
    assert bias is None or tuple(bias.shape) == (n,), (None if bias is None else bias.shape, n)
    w = weight_to_f32(weight)  # [N, K]
    y = x @ w.t()  # [T, N]
    if bias is not None:
        y = y + bias.float()
    return y


def embedding(weight: torch.Tensor | QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the table: ``weight`` ``[V, K]``, ``ids`` int64 ``[T]`` -> f32 ``[T, K]``."""
    assert ids.dim() == 1 and ids.dtype == torch.int64, (ids.shape, ids.dtype)
    v, _ = weight.shape
    assert ids.numel() == 0 or (0 <= int(ids.min()) and int(ids.max()) < v), ("token id out of range", v)
    w = weight_to_f32(weight)  # [V, K]
    return w[ids]  # [T, K]


OPS = (
    OpDeclaration(
        name="embedding", variants=ALL_FORMATS, args=("weight", "ids"), weight_arg="weight",
        signature="(weight [V, K], ids int64 [T]) -> f32 [T, K]",
        reference="zllm.domain.linear:embedding", cases="zllm.conformance.cases:embedding_cases",
    ),
    OpDeclaration(
        name="linear", variants=ALL_FORMATS, args=("x", "weight", "bias"), weight_arg="weight",
        optional_args=("bias",),
        signature="(x f32 [T, K], weight [N, K], bias f32 [N] or None) -> f32 [T, N]",
        reference="zllm.domain.linear:linear", cases="zllm.conformance.cases:linear_cases",
    ),
)
