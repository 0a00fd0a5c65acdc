"""The CPU MLA kernels: equal to the f32 reference on the conformance cases, and the
batch-invariant one bit-identical however a sequence is chunked or batched."""

from __future__ import annotations

import pytest
import torch

from zllm.capabilities.ops import AttentionMetadata
from zllm.conformance.cases import cases_for
from zllm.conformance.kernels import reference_args
from zllm.domain.mla import mla_paged_attention
from zllm_backend_cpu.kernels.mla import mla_attention, mla_attention_invariant


@pytest.mark.parametrize("kernel", [mla_attention, mla_attention_invariant])
def test_kernel_equals_both_reference_forms_and_writes_the_latent_rows(kernel):
    for case in cases_for("mla_attention", "paged", seed=3):
        args, ref_args = reference_args(case), reference_args(case)
        out = kernel(*args)
        for form in ("absorbed", "expanded"):
            ref_args = reference_args(case)
            ref = mla_paged_attention(*ref_args, form=form)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, msg=case.label)
        assert torch.equal(args[3], ref_args[3]), case.label  # the same cache contents


def _meta(
    starts_lens: list[tuple[int, int]], table: torch.Tensor, bs: int, scale: float
) -> AttentionMetadata:
    """One entry per sequence: (first new position, new tokens); sequence s uses table[s]."""
    slots = []
    for s, (start, n) in enumerate(starts_lens):
        pos = torch.arange(start, start + n)
        slots.append(table[s][pos // bs] * bs + pos % bs)
    return AttentionMetadata(
        torch.cat(slots),
        table,
        tuple(n for _, n in starts_lens),
        tuple(start + n for start, n in starts_lens),
        scale,
    )


def test_invariant_kernel_gives_the_same_bits_chunked_batched_or_whole():
    g = torch.Generator().manual_seed(0)
    h, dn, dr, dv, r, bs, n = 4, 16, 8, 16, 32, 5, 19
    q = torch.randn(n, h, dn + dr, generator=g)
    latent = torch.randn(n, r + dr, generator=g)
    kv_b = torch.randn(h * (dn + dv), r, generator=g) / r**0.5
    scale = (dn + dr) ** -0.5
    table = torch.tensor([[3, 0, 5, 1, 7, -1]])

    def run(chunks: list[tuple[int, int]], other: bool) -> torch.Tensor:
        cache = torch.zeros(10, bs, r + dr)
        outs = []
        for start, stop in chunks:
            rows = slice(start, stop)
            qn, qp, lat = q[rows, :, :dn], q[rows, :, dn:], latent[rows]
            tab, spans = table, [(start, stop - start)]
            if other:  # a second sequence decoding beside it, in blocks 8 and 9
                qn, qp = torch.cat([qn, q[:1, :, :dn]]), torch.cat([qp, q[:1, :, dn:]])
                lat = torch.cat([lat, latent[:1]])
                tab = torch.tensor([[3, 0, 5, 1, 7, -1], [8, 9, -1, -1, -1, -1]])
                spans = spans + [(6, 1)]
            out = mla_attention_invariant(qn, qp, lat, cache, kv_b, _meta(spans, tab, bs, scale))
            outs.append(out[: stop - start])
        return torch.cat(outs)

    whole = run([(0, n)], other=False)
    assert torch.equal(whole, run([(0, 7), (7, 8), (8, 15), (15, 19)], other=False))
    assert torch.equal(whole, run([(0, 4), (4, 19)], other=True))
