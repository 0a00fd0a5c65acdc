"""The native MoE call (``csrc/moe.c``) of the MoE bench models' layer shapes, read from DRAM,
against a plain Q8_0 GEMV of the same weight bytes, and A/B between builds of the native library.

    .venv/bin/python bench/moe_call.py --tokens 1,16 --threads 1 --cpu-time
    .venv/bin/python bench/moe_call.py --libs /tmp/before.so,/tmp/after.so --shapes qwen3-moe --tokens 16

Shapes (Q8_0 gate / up / down, hidden 1024): ``qwen3-moe`` 64 experts of width 384, top-8
(``qwen3-moe-1b``); ``deepseek-v2`` 32 experts of width 256, top-6, a shared expert of width 512
(``deepseek-v2-lite``). Random weights (speed does not depend on values) in ``LAYERS`` copies
(320 / 115 MB, past the 32 MB L3) cycled call by call, each call with fresh uniform routing
(each token ``k`` distinct experts): the selected experts come from DRAM as in a decode step.
The bytes of a call are those of the experts its tokens touch (and the shared expert). The
GEMV reference: one ``[N, 1024]`` Q8_0 weight of those bytes (8 copies cycled) times one
token, what streaming those bytes costs: the bound of a call that reads each touched expert
once. ``--libs``: library builds (copies of ``_native.so``; default the installed one) loaded
side by side; their outputs are checked equal bit for bit.

Each of ``--rounds`` rounds times every case back to back (order alternating), each sample the
mean of ``--calls`` calls. ``--cpu-time`` times the calling thread's CPU time instead of the
wall clock: with ``--threads 1`` the call runs on that thread, and its CPU time does not count
the time other processes of a busy machine hold the core. ``--gap-ms``: a sleep before each call
(untimed), as the Python between two layers' calls, so the team's threads may go idle.
``--isa avx2`` runs every build's AVX2 row kernels (default: the best level the CPU has). Prints
median and best per case, GB/s of its bytes and the median of the per-round ratios to the
first build.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from zllm_backend_cpu.kernels.native import LIBRARY_PATH

P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
HIDDEN = 1024
SHAPES = {"qwen3-moe": (64, 384, 8, 0), "deepseek-v2": (32, 256, 6, 512)}  # experts, width, top-k, shared width
LAYERS = 4
Q8_0 = 3  # gemv.h's format number
DESC_FIELDS = 14  # csrc/moe.c's descriptor row of a matrix (Q8_0: the first four, the rest 0)


def q8_0(rows: int, k: int) -> torch.Tensor:
    """Random Q8_0 blocks ``[rows, k / 32 * 34]`` bytes, each block's scale 0.01."""
    blocks = torch.randint(-127, 128, (rows, k // 32, 34), dtype=torch.int8).view(torch.uint8)
    blocks[:, :, :2] = torch.full((rows, k // 32), 0.01, dtype=torch.float16).view(torch.uint8).view(rows, k // 32, 2)
    return blocks.reshape(rows, -1)


def load(path: str) -> ctypes.CDLL:
    """A build of the native library, bound privately (each copy its own symbols)."""
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    lib.zllm_moe.argtypes = (P, I64, I64, I64, P, P, I64, I64, I64, P, I64, P, INT, F32, F32, P, INT)
    lib.zllm_gemv_q8_0.argtypes = (P, I64, P, I64, P, P, I64, I64, I64, INT)
    return lib


class Case:
    """One shape at ``tokens`` tokens: ``LAYERS`` copies of its experts, ``calls`` routings."""

    def __init__(self, shape: str, tokens: int, calls: int) -> None:
        self.experts, self.width, self.top_k, self.shared_width = SHAPES[shape]
        self.tokens = tokens
        e, n, sw = self.experts, self.width, self.shared_width
        row_k, row_n = HIDDEN // 32 * 34, n // 32 * 34
        self.layers = []
        for _ in range(LAYERS):
            mats = [(q8_0(e * n, HIDDEN), n * row_k, row_k), (q8_0(e * n, HIDDEN), n * row_k, row_k),
                    (q8_0(e * HIDDEN, n), HIDDEN * row_n, row_n)]
            shared = [(q8_0(sw, HIDDEN), 0, row_k), (q8_0(sw, HIDDEN), 0, row_k),
                      (q8_0(HIDDEN, sw), 0, sw // 32 * 34)] if sw else []
            desc = [v for m, es, rs in mats + shared for v in (m.data_ptr(), es, rs, Q8_0, *[0] * (DESC_FIELDS - 4))]
            desc += [0] * (6 * DESC_FIELDS - len(desc))
            self.layers.append((mats + shared, (ctypes.c_int64 * len(desc))(*desc)))
        self.routings = [torch.stack([torch.randperm(e)[:self.top_k] for _ in range(tokens)]) for _ in range(calls)]
        expert_bytes = n * row_k * 2 + HIDDEN * row_n
        shared_bytes = sw * row_k * 2 + HIDDEN * (sw // 32 * 34)
        touched = statistics.mean(len(set(r.flatten().tolist())) for r in self.routings)
        self.bytes = touched * expert_bytes + shared_bytes  # a call's weight bytes, mean over the routings
        self.gemv_rows = int(self.bytes) // row_k
        self.gemv_weights = [q8_0(self.gemv_rows, HIDDEN) for _ in range(8)]
        self.x = torch.randn(tokens, HIDDEN)
        self.weights = torch.full((tokens, self.top_k), 1 / self.top_k)
        self.out = torch.empty(tokens, HIDDEN)
        self.y = torch.empty(1, self.gemv_rows)

    def moe(self, lib: ctypes.CDLL, i: int, threads: int) -> None:
        ids = self.routings[i % len(self.routings)]
        desc = self.layers[i % LAYERS][1]
        lib.zllm_moe(self.x.data_ptr(), HIDDEN, self.tokens, HIDDEN, ids.data_ptr(), self.weights.data_ptr(),
                     self.top_k, self.experts, self.width, desc, self.shared_width, None, 0, 0.0, 0.0,  # SiLU-and-mul
                     self.out.data_ptr(), threads)

    def gemv(self, lib: ctypes.CDLL, i: int, threads: int) -> None:
        w = self.gemv_weights[i % len(self.gemv_weights)]
        lib.zllm_gemv_q8_0(w.data_ptr(), w.stride(0), self.x.data_ptr(), HIDDEN, None, self.y.data_ptr(),
                           1, self.gemv_rows, HIDDEN, threads)


def measure(case: Case, libs: list[ctypes.CDLL], threads: int, rounds: int, calls: int, gap_s: float,
            cpu_time: bool) -> dict[str, list[float]]:
    """Seconds per call of each build's MoE call and of the GEMV, ``rounds`` samples each.

    Raises:
        AssertionError: two builds' outputs differ.
    """
    first = None
    for lib in libs:
        case.moe(lib, 0, threads)
        first = case.out.clone() if first is None else first
        assert torch.equal(case.out, first), "the builds' MoE outputs differ"
    runs: list[tuple[str, Callable[[int], None]]] = [
        (f"moe:{n}", lambda i, lib=lib: case.moe(lib, i, threads)) for n, lib in enumerate(libs)]
    runs.append(("gemv", lambda i: case.gemv(libs[0], i, threads)))
    clock = time.thread_time if cpu_time else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for r in range(rounds):
        for name, run in runs if r % 2 == 0 else runs[::-1]:
            run(0)  # warm the code, not the weights: the timed calls start at another layer
            total = 0.0
            for i in range(1, calls + 1):
                if gap_s:
                    time.sleep(gap_s)
                t0 = clock()
                run(i)
                total += clock() - t0
            times[name].append(total / calls)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default=str(LIBRARY_PATH), help="comma-separated builds of the native library")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--gap-ms", type=float, default=0.0)
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--isa", choices=("avx2", "avx512"), help="row kernel level, every build (default: the best)")
    args = p.parse_args()
    torch.manual_seed(0)
    libs = [load(path) for path in args.libs.split(",")]
    for lib in libs if args.isa else []:
        lib.zllm_native_select_isa(1 if args.isa == "avx512" else 0)
    print(f"{'shape':<12} {'T':>3} {'case':<6} {'median us':>10} {'best us':>9} {'GB/s':>6} {'vs moe:0':>8}")
    for shape in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            case = Case(shape, tokens, args.calls + 1)
            times = measure(case, libs, args.threads, args.rounds, args.calls, args.gap_ms / 1e3, args.cpu_time)
            base = times["moe:0"]
            for name, ts in times.items():
                med = statistics.median(ts)
                ratio = statistics.median(b / t for b, t in zip(base, ts, strict=True))
                print(f"{shape:<12} {tokens:>3} {name:<6} {med * 1e6:>10.1f} {min(ts) * 1e6:>9.1f} "
                      f"{case.bytes / med / 1e9:>6.1f} {ratio:>7.2f}x")
            print(f"{'':<12} {'':>3} ({case.bytes / 1e6:.2f} MB a call)")


if __name__ == "__main__":
    main()
