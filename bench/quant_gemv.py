"""Batch-1 decode GEMV throughput of the HF quantized kernel layouts on the CPU backend's native
kernels, at the ``llama-0.5b`` bench model's linear shapes, vs the memory-bandwidth limit
from each layout's bytes per weight and vs the GGUF Q8_0 / Q4_0 kernels at the same bits
(issue #14, section 6).

    .venv/bin/python bench/quant_gemv.py [--layers 24] [--repeats 15] [--threads 2] [--prefill 128]

One "token" is every linear of ``--layers`` decoder layers of ``llama-0.5b`` (hidden 1280, 20 /
10 heads of 64, FFN 3328: q 1280x1280, k and v 640x1280, o 1280x1280, gate and up 3328x1280,
down 1280x3328), one GEMV each with a fresh f32 activation row, weights random in their layout
(speed does not depend on the values). Each layout's weights are built, timed ``--repeats``
times after one warm-up pass, and freed before the next. Reported: the median tokens/s with
min-max, the weight bytes read per token, GB/s, and the percentage of the bandwidth limit:
``torch.sum`` over an f32 tensor of the same byte size (the best of 5, measured before each
layout: the machine is shared and noisy, so medians and best-of are what is comparable).
``--prefill T`` also times ``T`` tokens at once (the tiled decode + ``torch.mm`` path) per
layout. Writes the table to stdout and ``bench/out/quant_gemv.json``.
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


def measure(fmt: str, layers: int, repeats: int, prefill: int) -> dict:
    weights, nbytes = [], 0
    for _ in range(layers):
        for n, k in SHAPES:
            w = random_weight(fmt, n, k)
            weights.append((w, k))
            nbytes += w.nbytes
    xs = {k: torch.randn(1, k) for k in (HIDDEN, FFN)}
    limit_gb_s = read_gb_s(nbytes)

    def token() -> float:
        t0 = time.perf_counter()
        for w, k in weights:
            run_linear(w, xs[k])
        return time.perf_counter() - t0

    token()  # warm-up
    times = [token() for _ in range(repeats)]
    med = statistics.median(times)
    weights_per_token = layers * sum(n * k for n, k in SHAPES)
    row = {"layout": fmt, "bytes_per_token": nbytes, "bits_per_weight": 8 * nbytes / weights_per_token,
           "tok_s": 1 / med, "tok_s_min": 1 / max(times), "tok_s_max": 1 / min(times), "gb_s": nbytes / med / 1e9,
           "limit_gb_s": limit_gb_s, "pct_of_limit": 100 * nbytes / med / 1e9 / limit_gb_s}
    if prefill:
        xp = {k: torch.randn(prefill, k) for k in (HIDDEN, FFN)}
        one_layer = weights[: len(SHAPES)]
        ptimes = []
        for _ in range(3):
            t0 = time.perf_counter()
            for w, k in one_layer:
                run_linear(w, xp[k])
            ptimes.append(time.perf_counter() - t0)
        row["prefill_tok_s"] = prefill / statistics.median(ptimes) / layers
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=int, default=128, help="tokens of the prefill timing (0: none)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "quant_gemv.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    for fmt in args.layouts.split(","):
        rows[fmt] = measure(fmt, args.layers, args.repeats, args.prefill)
        print(f"[quant_gemv] {fmt}: {rows[fmt]['tok_s']:.1f} tok/s", flush=True)
    print(f"\n{args.layers} layers of llama-0.5b, batch-1 GEMV, {args.threads} threads, median of {args.repeats}\n")
    print("| layout | bits/weight | tok/s (min-max) | GB/s | % of BW limit | vs GGUF same bits "
          "| prefill tok/s | vs GGUF prefill |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for fmt, r in rows.items():
        peer = rows.get(LAYOUTS.get(fmt) or "")
        vs = f"{r['tok_s'] / peer['tok_s']:.2f}x {LAYOUTS[fmt]}" if peer else "—"
        pre = f"{r['prefill_tok_s']:.0f}" if "prefill_tok_s" in r else "—"
        vs_pre = f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x" if peer and "prefill_tok_s" in r else "—"
        print(f"| {fmt} | {r['bits_per_weight']:.2f} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}) "
              f"| {r['gb_s']:.1f} | {r['pct_of_limit']:.0f}% | {vs} | {pre} | {vs_pre} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"layers": args.layers, "threads": args.threads, "repeats": args.repeats,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
