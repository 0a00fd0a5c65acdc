"""Batch-1 decode GEMV throughput of the HF quantized kernel layouts on the CPU backend's native
kernels, at the ``llama-0.5b`` bench model's linear shapes, vs the memory-bandwidth limit
from each layout's bytes per weight and vs the GGUF Q8_0 / Q4_0 kernels at the same bits
(issue #14, section 6).

    .venv/bin/python bench/quant_gemv.py [--layers 24] [--repeats 15] [--threads 2] [--prefill 128]

One "token" is every linear of ``--layers`` decoder layers of ``llama-0.5b`` (hidden 1280, 20 /
10 heads of 64, FFN 3328: q 1280x1280, k and v 640x1280, o 1280x1280, gate and up 3328x1280,
down 1280x3328), one GEMV each with a fresh f32 activation row, weights random in their layout
(speed does not depend on the values). Every layout's weights are built first; then each of
``--repeats`` rounds times one token of every layout in turn (after one warm-up round), so a
busy spell of the shared machine hits all layouts alike. Reported: the median tokens/s with
min-max, the weight bytes read per token, GB/s, the percentage of the bandwidth limit
(``torch.sum`` over an f32 tensor of the same byte size, best of 5 before and 5 after the
rounds: the machine is shared and noisy, so medians and best-of are what is comparable), and
the median over rounds of the per-round ratio to the GGUF format at the same bits. ``--prefill
T`` also times ``T`` tokens at once through one layer (the tiled decode + ``torch.mm`` path),
median of 3 interleaved rounds, scaled to the layer count. ``--isa avx2,avx512`` times every
layout at each ISA level of the native row kernels within the same rounds (rows
``layout@level``; the GGUF ratio compares layouts at the same level); the level ``avx512-f32``
is AVX-512 with the FP8 rows' BF16 dot products turned off (``csrc/quant_gemv_bf16.c``: the f32
rows, for an A/B of the two within the same rounds). Writes the table to stdout and
``bench/out/quant_gemv.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from zllm.plugin_api import QuantizedTensor
from zllm_backend_cpu.kernels import gemv
from zllm_backend_cpu.kernels import quant_gemv as quant
from zllm_backend_cpu.kernels.native import select_fp8_bf16, select_isa

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 1280, 20, 10, 64, 3328
SHAPES = [(HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN),
          (HIDDEN, HEADS * HEAD_DIM), (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]  # (N, K) of one layer
GROUP = 128  # int4_g / int8_g group size and fp8 block (128 x 128): the common checkpoint settings
# layout -> (the GGUF format at the same bits it is compared with)
LAYOUTS = {"fp8_e4m3": "q8_0", "int8_g": "q8_0", "int4_g": "q4_0", "mxfp4": "q4_0", "nvfp4": "q4_0",
           "q8_0": None, "q4_0": None}
GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


def random_weight(fmt: str, n: int, k: int) -> QuantizedTensor:
    """A random ``fmt`` weight ``[N, K]`` (int groups and FP8 blocks of :data:`GROUP`)."""
    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8)

    if fmt in GGUF_BLOCK_BYTES:
        raw = u8(n, k // 32, GGUF_BLOCK_BYTES[fmt])
        raw[..., :2] = (torch.rand(n, k // 32, 1) / 100).half().view(torch.uint8)
        return QuantizedTensor(raw.view(n, -1), fmt, (n, k))
    if fmt == "fp8_e4m3":
        q = u8(n, k) & 0x77  # finite, moderate values
        return QuantizedTensor({"qweight": q, "scale": torch.rand(-(-n // GROUP), -(-k // GROUP))}, fmt, (n, k),
                               block=(GROUP, GROUP))
    if fmt in ("int4_g", "int8_g"):
        parts = {"qweight": u8(n, k // 2 if fmt == "int4_g" else k), "scales": torch.rand(n, k // GROUP),
                 "zeros": u8(n, k // GROUP) & (15 if fmt == "int4_g" else 255)}
        return QuantizedTensor(parts, fmt, (n, k), block=(1, GROUP))
    if fmt == "mxfp4":
        scales = torch.randint(115, 125, (n, k // 32), dtype=torch.uint8)
        return QuantizedTensor({"qweight": u8(n, k // 2), "scales": scales}, fmt, (n, k))
    return QuantizedTensor({"qweight": u8(n, k // 2), "scales": torch.full((n, k // 16), 0x38, dtype=torch.uint8),
                            "global_scale": torch.tensor(0.01)}, fmt, (n, k))


def run_linear(w: QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
    """The CPU backend's priority-1 ``linear`` for the weight's format."""
    if w.fmt in GGUF_BLOCK_BYTES:
        return gemv.linear_gemv(x, w, None)
    return quant.linear_quant_gemv(x, w, None)


def read_gb_s(nbytes: int, repeats: int = 5) -> float:
    """Best ``torch.sum`` read bandwidth over ``nbytes`` of f32, GB/s."""
    x = torch.ones(max(1, nbytes // 4))
    x.sum()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best / 1e9


def build(fmt: str, layers: int, shapes: list[tuple[int, int]]) -> tuple[list[tuple[QuantizedTensor, int]], int]:
    """``layers`` layers of ``fmt`` weights of ``shapes`` as ``(weight, K)`` in call order, and their bytes."""
    weights = [(random_weight(fmt, n, k), k) for _ in range(layers) for n, k in shapes]
    return weights, sum(w.nbytes for w, _ in weights)


def measure(layouts: list[str], layers: int, repeats: int, prefill: int,
            shapes: list[tuple[int, int]] = SHAPES, levels: tuple[str | None, ...] = (None,)) -> dict[str, dict]:
    """Interleaved timing of ``layouts`` on ``layers`` layers of ``shapes`` (``(N, K)`` of each
    linear; module doc) at each of ``levels`` (an ISA level of the native row kernels, or None
    for the level in use) -> ``{layout: row}``, ``{layout@level: row}`` for named levels."""
    built = {fmt: build(fmt, layers, shapes) for fmt in layouts}
    sizes = {nbytes for _, nbytes in built.values()}
    limit = {size: read_gb_s(size) for size in sizes}
    xs = {k: torch.randn(1, k) for _, k in shapes}
    xp = {k: torch.randn(prefill, k) for _, k in shapes}
    keys = [(level, fmt) for level in levels for fmt in layouts]

    def timed(weights: list[tuple[QuantizedTensor, int]], x: dict[int, torch.Tensor], level: str | None) -> float:
        if level is not None:
            isa, _, variant = level.partition("-")
            if select_isa(isa) != isa:
                raise RuntimeError(f"this CPU cannot run the native row kernels' {isa} level")
            select_fp8_bf16(variant != "f32")
        t0 = time.perf_counter()
        for w, k in weights:
            run_linear(w, x[k])
        return time.perf_counter() - t0

    times: dict[tuple[str | None, str], list[float]] = {key: [] for key in keys}
    ptimes: dict[tuple[str | None, str], list[float]] = {key: [] for key in keys}
    try:
        for level, fmt in keys:  # warm-up
            timed(built[fmt][0], xs, level)
        for _ in range(repeats):
            for level, fmt in keys:
                times[level, fmt].append(timed(built[fmt][0], xs, level))
        for _ in range(3 if prefill else 0):
            for level, fmt in keys:
                ptimes[level, fmt].append(timed(built[fmt][0][: len(shapes)], xp, level) * layers)
    finally:
        select_fp8_bf16(True)  # allowed, as when the library loads
    limit = {size: max(gb_s, read_gb_s(size)) for size, gb_s in limit.items()}
    rows = {}
    weights_per_token = layers * sum(n * k for n, k in shapes)
    for level, fmt in keys:
        nbytes, ts = built[fmt][1], times[level, fmt]
        med = statistics.median(ts)
        row = {"layout": fmt, "isa": level, "bytes_per_token": nbytes,
               "bits_per_weight": 8 * nbytes / weights_per_token, "tok_s": 1 / med, "tok_s_min": 1 / max(ts),
               "tok_s_max": 1 / min(ts), "gb_s": nbytes / med / 1e9, "limit_gb_s": limit[nbytes],
               "pct_of_limit": 100 * nbytes / med / 1e9 / limit[nbytes], "times_s": ts}
        if prefill:
            row["prefill_tok_s"] = prefill / statistics.median(ptimes[level, fmt])
        peer = (level, LAYOUTS.get(fmt))
        if peer in times:  # per-round ratios: a busy spell slows both sides of a round
            row["vs_peer"] = statistics.median(p / t for t, p in zip(ts, times[peer], strict=True))
            if prefill:
                pairs = zip(ptimes[level, fmt], ptimes[peer], strict=True)
                row["prefill_vs_peer"] = statistics.median(p / t for t, p in pairs)
        rows[fmt if level is None else f"{fmt}@{level}"] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=int, default=128, help="tokens of the prefill timing (0: none)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--isa", default="", help="ISA levels to compare, e.g. avx2,avx512,avx512-f32 (default: the one "
                   "in use)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "quant_gemv.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    levels = tuple(args.isa.split(",")) if args.isa else (None,)
    rows = measure(args.layouts.split(","), args.layers, args.repeats, args.prefill, levels=levels)
    print(f"\n{args.layers} layers of llama-0.5b, batch-1 GEMV, {args.threads} threads, median of {args.repeats} "
          f"interleaved rounds\n")
    print("| layout | bits/weight | tok/s (min-max) | GB/s | % of BW limit | vs GGUF same bits "
          "| prefill tok/s | vs GGUF prefill |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for fmt, r in rows.items():
        vs = f"{r['vs_peer']:.2f}x {LAYOUTS[r['layout']]}" if "vs_peer" in r else "—"
        pre = f"{r['prefill_tok_s']:.0f}" if "prefill_tok_s" in r else "—"
        vs_pre = f"{r['prefill_vs_peer']:.2f}x" if "prefill_vs_peer" in r else "—"
        print(f"| {fmt} | {r['bits_per_weight']:.2f} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}) "
              f"| {r['gb_s']:.1f} | {r['pct_of_limit']:.0f}% | {vs} | {pre} | {vs_pre} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"layers": args.layers, "threads": args.threads, "repeats": args.repeats,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
