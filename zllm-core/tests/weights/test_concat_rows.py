"""``concat_rows``: weights that multiply the same input joined into one, in their format —
rows in order, every value kept — or None where joining would change a value."""

from __future__ import annotations

import pytest
import torch

from zllm.conformance.cases import make_weight
from zllm.conformance.quantizers import quantize_fp8_e4m3
from zllm.domain.quant import dequantize
from zllm.weights.formats import DTYPE_OF_FORMAT, FORMATS, QuantizedTensor, concat_projections, concat_rows

K = 256  # a k-quant super-block, and a multiple of every format's column block


def _decoded(w: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return dequantize(w) if isinstance(w, QuantizedTensor) else w.float()


@pytest.mark.parametrize("fmt", [*DTYPE_OF_FORMAT, *FORMATS])
def test_joined_rows_decode_to_the_pieces_rows_in_order(fmt):
    g = torch.Generator().manual_seed(0)
    pieces = [make_weight(g, fmt, n, K) for n in (64, 16, 16)]  # q, k, v of a GQA layer
    if fmt == "nvfp4":  # one global scale per tensor: only equal ones join
        pieces = [QuantizedTensor({**p.parts, "global_scale": pieces[0].parts["global_scale"]}, fmt, p.shape)
                  for p in pieces]

    joined = concat_rows(pieces)

    assert joined is not None and tuple(joined.shape) == (96, K)
    assert isinstance(joined, QuantizedTensor) == isinstance(pieces[0], QuantizedTensor)
    assert torch.equal(_decoded(joined), torch.cat([_decoded(p) for p in pieces]))


def test_weights_in_different_formats_or_widths_are_not_joined():
    g = torch.Generator().manual_seed(1)
    q8, q4 = make_weight(g, "q8_0", 8, K), make_weight(g, "q4_0", 8, K)
    assert concat_rows([q8, q4]) is None
    assert concat_rows([q8, make_weight(g, "q8_0", 8, 2 * K)]) is None
    assert concat_rows([q8, make_weight(g, "f32", 8, K)]) is None
    assert concat_rows([make_weight(g, "f32", 8, K), make_weight(g, "bf16", 8, K)]) is None
    assert concat_rows([make_weight(g, "f32", 8, K), make_weight(g, "f32", 8, 2 * K)]) is None


def test_a_scale_block_that_would_straddle_two_weights_is_not_joined():
    g = torch.Generator().manual_seed(2)
    whole = [quantize_fp8_e4m3(torch.randn(n, K, generator=g), block=(16, 32)) for n in (32, 16)]
    assert concat_rows(whole) is not None  # every weight a whole number of 16-row blocks
    split = [quantize_fp8_e4m3(torch.randn(n, K, generator=g), block=(16, 32)) for n in (24, 16)]
    assert concat_rows(split) is None


def test_unrowed_parts_must_agree():
    g = torch.Generator().manual_seed(3)
    a, b = make_weight(g, "nvfp4", 16, K), make_weight(g, "nvfp4", 16, K)
    assert not torch.equal(a.parts["global_scale"], b.parts["global_scale"])
    assert concat_rows([a, b]) is None


def test_projections_join_with_their_biases_in_order_or_all_without():
    g = torch.Generator().manual_seed(4)
    ws = [make_weight(g, "q8_0", n, K) for n in (64, 16, 16)]
    bs = [torch.randn(n, generator=g) for n in (64, 16, 16)]
    joined = concat_projections(ws, bs)
    assert joined is not None and torch.equal(joined[1], torch.cat(bs))
    assert torch.equal(_decoded(joined[0]), torch.cat([_decoded(w) for w in ws]))
    no_bias = concat_projections(ws, [None, None, None])
    assert no_bias is not None and no_bias[1] is None


def test_projections_where_only_some_have_a_bias_are_not_joined():
    g = torch.Generator().manual_seed(5)
    ws = [make_weight(g, "f32", n, K) for n in (8, 8)]
    assert concat_projections(ws, [torch.zeros(8), None]) is None
    assert concat_projections([ws[0], make_weight(g, "bf16", 8, K)], [None, None]) is None
