"""Decode attention microbenchmark: one decode step's ``attention`` call (KV write included) by
the native kernel (``zllm_backend_cpu.kernels.paged_attention``) and by the torch kernel
(``zllm_backend_cpu.kernels.attention``: gather the blocks, SDPA per sequence).

    python zllm-backend-cpu/benchmarks/attention.py --threads 2 --repeats 7
    python zllm-backend-cpu/benchmarks/attention.py --dtype bf16 --contexts 256 1024

Shapes: one layer of a 110M Llama (H = Hkv = 12, D = 64) and of a 0.5B one (H = 20,
Hkv = 10, D = 64); every sequence of the batch has the same context length, its blocks
(BS 16) scattered over the cache in random order. The caches hold only this batch, so at
short contexts they stay in the CPU caches (a model's step reads every layer's cache: slower
per layer than shown).

Timing: every case runs ``--repeats`` rounds, interleaved; a round times enough calls for
``--round-s`` seconds. The table shows the median round in µs per call and the torch / native
ratio. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from zllm.plugin_api import AttentionMetadata
from zllm_backend_cpu.kernels import attention as torch_attention
from zllm_backend_cpu.kernels.native import unavailable_reason

MODELS = {"110M": (12, 12, 64), "0.5B": (20, 10, 64)}  # (H, Hkv, D)
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCK_SIZE = 16


def decode_step(h: int, hkv: int, d: int, batch: int, ctx: int, dtype: torch.dtype, g: torch.Generator):
    """``(q, k, v, k_cache, v_cache, meta)`` of one decode step of ``batch`` sequences at context ``ctx``."""
    per_seq = -(-ctx // BLOCK_SIZE)
    nb = batch * per_seq
    k_cache = torch.randn(nb, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g).view(batch, per_seq)  # [S, MB]
    pos = ctx - 1
    slots = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # [S]
    qkv = torch.randn(batch, (h + 2 * hkv) * d, generator=g)  # fused projection, as a model gives it
    q = qkv[:, : h * d].view(batch, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(batch, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(batch, hkv, d)
    meta = AttentionMetadata(slots, tables, (1,) * batch, (ctx,) * batch, d**-0.5)
    return q, k, v, k_cache, v_cache, meta


def time_round(fn: Callable[[], object], round_s: float) -> float:
    """Seconds per call over one round of at least ``round_s`` seconds."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= round_s:
            return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"native kernels unavailable: {reason}")
    from zllm_backend_cpu.kernels import paged_attention  # binds the entry points

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"decode attention, cache {args.dtype}, BS {BLOCK_SIZE}, {args.threads} threads; median µs per call")
    print(f"{'model':6} {'batch':>5} {'context':>7} {'native':>9} {'torch':>9} {'torch/native':>12}")
    for model, (h, hkv, d) in MODELS.items():
        for batch in args.batches:
            for ctx in args.contexts:
                step = decode_step(h, hkv, d, batch, ctx, DTYPES[args.dtype], g)
                cases = {"native": lambda: paged_attention.attention(*step),
                         "torch": lambda: torch_attention.attention(*step)}
                times: dict[str, list[float]] = {name: [] for name in cases}
                for fn in cases.values():
                    fn()  # warm up
                for _ in range(args.repeats):
                    for name, fn in cases.items():
                        times[name].append(time_round(fn, args.round_s))
                native, ref = (statistics.median(times[n]) * 1e6 for n in ("native", "torch"))
                print(f"{model:6} {batch:5d} {ctx:7d} {native:9.1f} {ref:9.1f} {ref / native:12.1f}", flush=True)


if __name__ == "__main__":
    main()
