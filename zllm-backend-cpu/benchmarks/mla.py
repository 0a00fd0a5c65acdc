"""MLA decode microbenchmark: one decode step's ``mla_attention`` call (latent write included) by
the native kernel (``zllm_backend_cpu.kernels.paged_mla``: absorbed form, blocks read in place)
and by the torch kernel (``zllm_backend_cpu.kernels.mla``: gather the blocks, SDPA per row).

    python zllm-backend-cpu/benchmarks/mla.py --threads 2 --repeats 7
    python zllm-backend-cpu/benchmarks/mla.py --dtype f32 --contexts 512 --batches 1 4

Shapes: one layer of DeepSeek-V2-Lite (H = 16, R = kv_lora_rank 512, Dr = 64, Dn = 128,
Dv = 128), ``kv_b_proj`` bf16 as the checkpoint stores it; every sequence of the batch has the
same context length, its blocks (BS 16) scattered over the cache in random order. The caches
hold only this batch, so short contexts stay in the CPU caches (a model's step reads every
layer's cache: slower per layer than shown).

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
from zllm_backend_cpu.kernels import mla as torch_mla
from zllm_backend_cpu.kernels.native import unavailable_reason

H, R, DR, DN, DV = 16, 512, 64, 128, 128  # DeepSeek-V2-Lite
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCK_SIZE = 16


def decode_step(batch: int, ctx: int, dtype: torch.dtype, kv_b: torch.Tensor, g: torch.Generator):
    """``(q_nope, q_pe, latent, latent_cache, kv_b_proj, meta)`` of one decode step of ``batch``
    sequences at context ``ctx``."""
    per_seq = -(-ctx // BLOCK_SIZE)
    nb = batch * per_seq
    cache = torch.randn(nb, BLOCK_SIZE, R + DR, generator=g).to(dtype)  # [NB, BS, W]
    tables = torch.randperm(nb, generator=g).view(batch, per_seq)  # [S, MB]
    pos = ctx - 1
    slots = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # [S]
    q = torch.randn(batch, H, DN + DR, generator=g)  # one projected query, as the model splits it
    latent = torch.randn(batch, R + DR, generator=g)
    meta = AttentionMetadata(slots, tables, (1,) * batch, (ctx,) * batch, (DN + DR) ** -0.5)
    return q[..., :DN], q[..., DN:], latent, cache, kv_b, meta


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
    parser.add_argument("--round-s", type=float, default=0.3)
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bf16", help="latent cache dtype"
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"native kernels unavailable: {reason}")
    from zllm_backend_cpu.kernels import paged_mla  # binds the entry points

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    kv_b = (torch.randn(H * (DN + DV), R, generator=g) / R**0.5).to(torch.bfloat16)
    print(
        f"MLA decode H={H} R={R} Dr={DR} Dn={DN} Dv={DV}, kv_b_proj bf16, cache {args.dtype}, "
        f"BS {BLOCK_SIZE}, {args.threads} threads; median µs per call"
    )
    print(f"{'batch':>5} {'context':>7} {'native':>9} {'torch':>9} {'torch/native':>12}")
    for batch in args.batches:
        for ctx in args.contexts:
            step = decode_step(batch, ctx, DTYPES[args.dtype], kv_b, g)
            cases = {
                "native": lambda: paged_mla.mla_attention(*step),
                "torch": lambda: torch_mla.mla_attention(*step),
            }
            times: dict[str, list[float]] = {name: [] for name in cases}
            for fn in cases.values():
                fn()  # warm up (the native kernel splits kv_b_proj here, once)
            for _ in range(args.repeats):
                for name, fn in cases.items():
                    times[name].append(time_round(fn, args.round_s))
            native, ref = (statistics.median(times[n]) * 1e6 for n in ("native", "torch"))
            print(f"{batch:5d} {ctx:7d} {native:9.1f} {ref:9.1f} {ref / native:12.2f}", flush=True)


if __name__ == "__main__":
    main()
