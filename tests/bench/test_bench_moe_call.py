"""bench/moe_call.py: every library build and the reference GEMV are timed in each round, a
call's bytes are those of the experts its tokens touch plus the shared expert, and builds that
disagree are caught."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zllm_backend_cpu.kernels.native import LIBRARY_PATH, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}")


@pytest.fixture
def tiny(monkeypatch):
    import moe_call

    monkeypatch.setitem(moe_call.SHAPES, "tiny", (4, 64, 2, 32))  # 4 experts of 64, top-2, shared 32
    monkeypatch.setattr(moe_call, "LAYERS", 2)
    return moe_call


def test_each_build_and_the_gemv_are_timed_and_a_call_reads_the_touched_experts(tiny):
    case = tiny.Case("tiny", tokens=3, calls=3)
    libs = [tiny.load(str(LIBRARY_PATH))] * 2
    times = tiny.measure(case, libs, threads=1, rounds=2, calls=2, gap_s=0.0, cpu_time=False)
    assert sorted(times) == ["gemv", "moe:0", "moe:1"] and all(len(ts) == 2 and min(ts) > 0 for ts in times.values())
    row_k = 1024 // 32 * 34
    expert, shared = 2 * 64 * row_k + 1024 * (64 // 32 * 34), 2 * 32 * row_k + 1024 * (32 // 32 * 34)
    touched = [len(set(r.flatten().tolist())) for r in case.routings]
    assert case.bytes == pytest.approx(sum(touched) / len(touched) * expert + shared)
    assert case.out.abs().sum() > 0


def test_builds_whose_outputs_differ_are_caught(tiny, monkeypatch):
    case = tiny.Case("tiny", tokens=2, calls=2)
    lib = tiny.load(str(LIBRARY_PATH))
    calls = iter(range(10))

    def moe(lib, i, threads):  # the second build's call writes another value
        case.out.fill_(float(next(calls)))

    monkeypatch.setattr(case, "moe", moe)
    with pytest.raises(AssertionError, match="differ"):
        tiny.measure(case, [lib, lib], threads=1, rounds=1, calls=1, gap_s=0.0, cpu_time=False)
