"""bench/native_isa.py: each case runs at both ISA levels of the native row kernels, interleaved,
and the level in use before is in use again afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zllm_backend_cpu.kernels.native import isa, select_isa, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))


def _has_avx512() -> bool:
    if unavailable_reason() is not None:
        return False
    before = isa()
    has = select_isa("avx512") == "avx512"
    select_isa(before)
    return has


@pytest.mark.skipif(not _has_avx512(), reason="needs the native library on a CPU with AVX-512 F/BW/VL/DQ/VNNI")
def test_cases_are_timed_at_both_levels_and_counted_in_weight_bytes(monkeypatch):
    import native_isa

    monkeypatch.setattr(native_isa, "SAMPLE_S", 0.001)
    before = isa()
    rows = native_isa.measure(["q4_0", "nvfp4"], repeats=2)
    assert rows["q4_0"]["bytes"] == 1024 * 1024 // 32 * 18
    for row in rows.values():
        assert len(row["avx2"]["times_s"]) == len(row["avx512"]["times_s"]) == 2
        assert row["speedup"] > 0 and row["best_speedup"] > 0
    assert isa() == before
