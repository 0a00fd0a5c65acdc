"""bench/quant_gemv.py: small layers of each kind of layout run through the backend's kernels, and
the bytes it counts per token are the registry's bytes for those shapes (what the bandwidth
limit is computed from)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from zllm.weights.formats import FORMATS
from zllm_backend_cpu.kernels.native import unavailable_reason

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from quant_gemv import GROUP, measure, random_weight, run_linear  # noqa: E402

SHAPES = [(256, 256), (64, 256), (256, 128)]  # (N, K): a small layer, K a multiple of GROUP


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}")
def test_layers_run_and_count_the_registry_bytes():
    rows = measure(["int4_g", "mxfp4", "q4_0"], layers=2, repeats=1, prefill=17, shapes=SHAPES)
    for fmt, row in rows.items():
        block = (1, GROUP) if fmt == "int4_g" else None
        assert row["bytes_per_token"] == 2 * sum(FORMATS[fmt].nbytes((n, k), block) for n, k in SHAPES)
        assert row["tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["limit_gb_s"] > 0
    assert rows["mxfp4"]["vs_peer"] > 0 and "vs_peer" not in rows["q4_0"]


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}")
def test_levels_are_timed_in_the_same_rounds_and_compared_at_the_same_level():
    from zllm_backend_cpu.kernels.native import isa, select_isa

    before = isa()
    if select_isa("avx512") != "avx512":
        pytest.skip("this CPU lacks AVX-512 F/BW/VL/DQ/VNNI")
    try:
        rows = measure(["mxfp4", "q4_0"], layers=1, repeats=2, prefill=0, shapes=SHAPES, levels=("avx2", "avx512"))
    finally:
        select_isa(before)
    assert set(rows) == {"mxfp4@avx2", "q4_0@avx2", "mxfp4@avx512", "q4_0@avx512"}
    assert rows["mxfp4@avx512"]["isa"] == "avx512" and rows["mxfp4@avx512"]["vs_peer"] > 0
    assert len(rows["q4_0@avx2"]["times_s"]) == 2 and "vs_peer" not in rows["q4_0@avx2"]


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}")
def test_the_avx512_f32_level_times_the_fp8_f32_rows_and_allows_the_bf16_rows_again():
    from zllm_backend_cpu.kernels.native import isa, select_fp8_bf16, select_isa

    before = isa()
    if select_isa("avx512") != "avx512" or not select_fp8_bf16(True):
        pytest.skip("this CPU lacks AVX-512 BF16 / VBMI")
    torch.manual_seed(0)
    w, x = random_weight("fp8_e4m3", 64, 256), torch.randn(1, 256)
    try:
        select_fp8_bf16(False)
        f32_rows = run_linear(w, x)
        select_fp8_bf16(True)
        bf16_rows = run_linear(w, x)
        rows = measure(["fp8_e4m3", "q8_0"], layers=1, repeats=2, prefill=0, shapes=SHAPES,
                       levels=("avx512", "avx512-f32"))
        after = run_linear(w, x)
    finally:
        select_fp8_bf16(True)
        select_isa(before)
    assert not torch.equal(f32_rows, bf16_rows) and torch.equal(after, bf16_rows)  # the BF16 rows again
    assert set(rows) == {"fp8_e4m3@avx512", "q8_0@avx512", "fp8_e4m3@avx512-f32", "q8_0@avx512-f32"}
    assert rows["fp8_e4m3@avx512-f32"]["vs_peer"] > 0 and rows["fp8_e4m3@avx512"]["vs_peer"] > 0
