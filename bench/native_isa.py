"""AVX2 vs AVX-512 row kernels of the CPU backend's native library, interleaved in one process:
the GGUF Q8_0 / Q4_0 GEMV, a Qwen3-MoE-shaped lm_head, one Qwen3-MoE layer's native MoE call
at T = 1 and each HF quantized layout, on random weights (speed does not depend on values).

    .venv/bin/python bench/native_isa.py [--threads 1,2] [--repeats 21] [--cases q8_0,moe,...]

Cases (N x K, weights of ``bench/quant_gemv.py``'s random layouts; HF groups / FP8 blocks of 128):
``q8_0`` and ``q4_0`` 1024 x 1024; ``lm_head`` Q8_0 50257 x 1024 (54 MB, the ``qwen3-moe-1b``
bench model's); ``moe``: 64 experts of width 384 over hidden 1024, top-8, Q8_0 gate / up /
down (8 x 3 matrices 384 x 1024 read per token); ``fp8_e4m3``, ``int8_g``, ``int4_g``,
``mxfp4``, ``nvfp4`` 3328 x 1280 (the ``llama-0.5b`` FFN gate). Each of ``--repeats`` rounds
times every case at both levels back to back (the order alternating between rounds), each
sample the mean of enough calls to take about 20 ms, so a busy spell of the shared machine
hits both levels alike. Reported per case and thread count: the median and the best
microseconds per call and the median's GB/s of weights read at each level, the median of the
per-round ratios (AVX2 time / AVX-512 time) and the ratio of the bests (on a busy machine the
best samples are the ones no other process slowed). Writes ``bench/out/native_isa.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gemv import random_weight, run_linear  # noqa: E402

from zllm.plugin_api import QuantizedTensor  # noqa: E402
from zllm_backend_cpu.kernels.native import isa, select_isa, unavailable_reason  # noqa: E402

SAMPLE_S = 0.02
HF = ("fp8_e4m3", "int8_g", "int4_g", "mxfp4", "nvfp4")
CASES = ("q8_0", "q4_0", "lm_head", "moe", *HF)


def gemv_case(fmt: str, n: int, k: int) -> tuple[Callable[[], object], int]:
    """One GEMV of a random ``fmt`` weight [N, K] and one token -> (the call, weight bytes)."""
    w, x = random_weight(fmt, n, k), torch.randn(1, k)
    return (lambda: run_linear(w, x)), w.nbytes


def moe_case() -> tuple[Callable[[], object], int]:
    """One token through 64 Q8_0 experts (width 384, hidden 1024), top-8 -> (the call, bytes read)."""
    from zllm_backend_cpu.kernels.moe_gemv import moe_experts

    experts, width, hidden, top_k = 64, 384, 1024, 8
    gate, up = (random_weight("q8_0", experts * width, hidden) for _ in range(2))
    down = random_weight("q8_0", experts * hidden, width)
    stacks = [QuantizedTensor(w.parts["data"].view(experts, shape[0], -1), "q8_0", (experts, *shape))
              for w, shape in ((gate, (width, hidden)), (up, (width, hidden)), (down, (hidden, width)))]
    x, ids = torch.randn(1, hidden), torch.randperm(experts)[:top_k].view(1, top_k)
    weights = torch.full((1, top_k), 1 / top_k)
    read = 3 * top_k * width * hidden // 32 * 34
    return (lambda: moe_experts(x, ids, weights, *stacks)), read


def build(case: str) -> tuple[Callable[[], object], int]:
    if case in ("q8_0", "q4_0"):
        return gemv_case(case, 1024, 1024)
    if case == "lm_head":
        return gemv_case("q8_0", 50257, 1024)
    if case == "moe":
        return moe_case()
    return gemv_case(case, 3328, 1280)


def sample_s(call: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls


def measure(cases: list[str], repeats: int) -> dict[str, dict]:
    """Interleaved AVX2 / AVX-512 timing of ``cases`` at torch's thread count -> ``{case: row}``;
    the level in use before is selected again after each case."""
    rows, before = {}, isa()
    for case in cases:
        call, nbytes = build(case)
        call()
        calls = max(1, int(SAMPLE_S / sample_s(call, 3)))
        times: dict[str, list[float]] = {"avx2": [], "avx512": []}
        for r in range(repeats):
            for level in (("avx2", "avx512") if r % 2 == 0 else ("avx512", "avx2")):
                select_isa(level)
                call()
                times[level].append(sample_s(call, calls))
        select_isa(before)
        row: dict = {"case": case, "bytes": nbytes, "calls_per_sample": calls}
        for level, ts in times.items():
            med = statistics.median(ts)
            row[level] = {"us": med * 1e6, "best_us": min(ts) * 1e6, "gb_s": nbytes / med / 1e9, "times_s": ts}
        row["speedup"] = statistics.median(a / b for a, b in zip(times["avx2"], times["avx512"], strict=True))
        row["best_speedup"] = min(times["avx2"]) / min(times["avx512"])
        rows[case] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "native_isa.json")
    args = p.parse_args()
    if unavailable_reason() is not None:
        sys.exit(f"native library: {unavailable_reason()}")
    if select_isa("avx512") != "avx512":
        sys.exit("this CPU lacks the AVX-512 row kernels' features: nothing to compare")
    torch.manual_seed(0)
    results = {}
    print(f"{'case':<10} {'thr':>3} {'AVX2 us':>9} {'best':>8} {'GB/s':>6} {'AVX-512 us':>11} {'best':>8} {'GB/s':>6} "
          f"{'speedup':>8} {'best':>6}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        rows = measure(args.cases.split(","), args.repeats)
        results[threads] = rows
        for case, row in rows.items():
            a, b = row["avx2"], row["avx512"]
            print(f"{case:<10} {threads:>3} {a['us']:>9.1f} {a['best_us']:>8.1f} {a['gb_s']:>6.1f} {b['us']:>11.1f} "
                  f"{b['best_us']:>8.1f} {b['gb_s']:>6.1f} {row['speedup']:>7.2f}x {row['best_speedup']:>5.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
