"""Decode GEMV microbenchmark: weight bytes streamed per second by the native kernels
(``zllm_backend_cpu.kernels.gemv``) and by torch on the same shapes.

    python zllm-backend-cpu/benchmarks/gemv.py --threads 2 --repeats 15
    python zllm-backend-cpu/benchmarks/gemv.py --fusion      # separate vs fused q/k/v, gate/up
    python zllm-backend-cpu/benchmarks/gemv.py --model 0.5b  # every linear of a decode step
    python zllm-backend-cpu/benchmarks/gemv.py --model 0.5b --fusion  # ... also with q/k/v, gate/up fused
    python zllm-backend-cpu/benchmarks/gemv.py --shapes 1024x1024,4096x1024 --formats q4_k,q6_k
    python zllm-backend-cpu/benchmarks/gemv.py --moe 64,384,1024,8 --formats q4_k  # one MoE layer

GB/s = weight bytes / seconds per call (decimal GB). Each call is one ``linear`` at ``T``
tokens (default 1, a batch-1 decode step). A decode step is bound by memory bandwidth, so
tokens/s <= bandwidth / weight bytes per token. A single shape re-reads one weight, which
stays in the caches when small; ``--model`` instead runs every linear of one decode step of a
Llama (each weight once, in layer order, as a real step does, so the working set is the
whole model) and reports the GB/s and the tokens/s the linears alone would allow.

"torch" is what the backend ran before the native kernels: ``torch.nn.functional.linear``
for f32, a matmul in the weight's dtype for f16/bf16 at ``T == 1`` (oneDNN), and the tiled
decode-then-matmul kernel (``kernels.linear.linear_quant``) for the block formats (the k-quants'
row decoders in ``kernels.kquants``).

``--moe E,N,K,k`` times one MoE layer instead (``E`` experts of width ``N`` over hidden ``K``,
top-``k`` softmax routing, random router logits each round): the native kernel
(``kernels.moe_gemv.moe_gemv``, one C call) against the per-expert loop over the torch
``linear`` kernels (``kernels.moe.moe``, what ``moe_gemv`` ran for k-quant experts before they
had native row kernels). GB/s there counts the bytes of the experts the tokens selected. A
matrix whose rows are not whole 256-weight super-blocks (the down projection of 384-wide
experts) is stored as llama.cpp's quantizer stores it then (``llama-quant.cpp``): Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0; Q2_K / Q3_K -> IQ4_NL there, which zllm lacks: Q4_0 here.

Timing: for each shape, every case runs ``--repeats`` rounds, interleaved (so machine
load drifts hit all cases alike); a round times enough calls for ``--round-s`` seconds. The
table shows the median round and, in brackets, the best one. ``--clock cpu`` times with the
process's CPU time (``time.process_time``: other processes' load does not count; with one
thread it is the kernel's own time). Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from zllm.conformance.cases import make_expert_stack
from zllm.conformance.cases import make_weight as make_conformance_weight
from zllm.plugin_api import QuantizedTensor, RouterConfig
from zllm_backend_cpu.kernels import linear as torch_linear
from zllm_backend_cpu.kernels import moe as torch_moe
from zllm_backend_cpu.kernels.gemv import gemv
from zllm_backend_cpu.kernels.native import unavailable_reason

# (N, K): the linears of a 110M Llama (hidden 768, FFN 2048, vocab 32000) and of a 0.5B one
# (hidden 1280, FFN 3328, vocab 32000)
SHAPES = [(768, 768), (2048, 768), (32000, 768), (1280, 1280), (3328, 1280), (32000, 1280)]
FORMATS = ("f32", "bf16", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
KQUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
# the format of a k-quant matrix whose rows are not whole super-blocks (module doc)
KQUANT_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q2_k": "q4_0", "q3_k": "q4_0"}
# separate linears -> one fused weight: (name, [(N, K) ...])
FUSIONS = [
    ("110M q/k/v", [(768, 768)] * 3),
    ("110M gate/up", [(2048, 768)] * 2),
    ("0.5B q/k/v", [(1280, 1280), (640, 1280), (640, 1280)]),
    ("0.5B gate/up", [(3328, 1280)] * 2),
]


# model -> (hidden, layers, heads, KV heads, FFN, vocab): the 110M and 0.5B Llamas above
MODELS = {"110m": (768, 12, 12, 12, 2048, 32000), "0.5b": (1280, 24, 20, 10, 3328, 32000)}


def model_shapes(name: str, fused: bool = False) -> list[tuple[int, int]]:
    """(N, K) of every linear of one decode step, in order: per layer q, k, v, o, gate, up,
    down, then the LM head; ``fused``: q/k/v as one weight and gate/up as one."""
    hidden, layers, heads, kv_heads, ffn, vocab = MODELS[name]
    kv = hidden // heads * kv_heads
    if fused:
        layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn)]
    else:
        layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                 (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    return layer * layers + [(vocab, hidden)]


def make_weight(fmt: str, n: int, k: int, g: torch.Generator) -> torch.Tensor | QuantizedTensor:
    """A random ``[N, K]`` weight stored as ``fmt`` (quantized: random blocks, scale 0.01;
    k-quants: the conformance kit's random super-blocks)."""
    if fmt in KQUANTS:
        return make_conformance_weight(g, fmt, n, k)
    if fmt in BLOCK_BYTES:
        raw = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[fmt]), dtype=torch.uint8, generator=g)
        raw[..., :2] = torch.full((n, k // 32, 1), 0.01).half().view(torch.uint8)
        if fmt in ("q4_1", "q5_1"):  # and a finite min m
            raw[..., 2:4] = torch.full((n, k // 32, 1), -0.08).half().view(torch.uint8)
        return QuantizedTensor(raw.view(n, -1), fmt, (n, k))
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[fmt]
    return (torch.randn(n, k, generator=g) / k**0.5).to(dtype)


def weight_bytes(w: torch.Tensor | QuantizedTensor) -> int:
    return w.data.numel() if isinstance(w, QuantizedTensor) else w.numel() * w.element_size()


def torch_kernel(x: torch.Tensor, w: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """What the backend ran before the native kernels (module doc)."""
    if isinstance(w, QuantizedTensor):
        return torch_linear.linear_quant(x, w, None)
    return torch_linear.linear_dense(x, w, None)


CLOCK = time.perf_counter  # --clock cpu: time.process_time


def measure(cases: dict[str, Callable[[], object]], repeats: int, round_s: float) -> dict[str, tuple[float, float]]:
    """case -> (median, best) seconds per call over ``repeats`` interleaved rounds."""
    calls = {}
    for name, fn in cases.items():
        fn()  # warm-up: page in the weight, start the threads
        start = time.perf_counter()
        fn()
        calls[name] = max(1, int(round_s / max(time.perf_counter() - start, 1e-7)))
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = CLOCK()
            for _ in range(calls[name]):
                fn()
            rounds[name].append((CLOCK() - start) / calls[name])
    return {name: (statistics.median(r), min(r)) for name, r in rounds.items()}


def run_shapes(args, g: torch.Generator) -> None:
    print(f"{'N x K':>12} {'fmt':>5} {'MB':>7} {'native GB/s':>18} {'torch GB/s':>18} {'speed-up':>8}")
    for n, k in args.shapes:
        x = torch.randn(args.tokens, k, generator=g)
        for fmt in args.formats:
            w = make_weight(fmt, n, k, g)
            mb = weight_bytes(w)
            got = measure({"native": lambda: gemv(x, w, None), "torch": lambda: torch_kernel(x, w)},
                          args.repeats, args.round_s)
            (nat, nat_best), (ref, ref_best) = got["native"], got["torch"]
            print(f"{n:>6} x {k:<5}{fmt:>5} {mb / 1e6:>7.1f} {mb / nat / 1e9:>8.1f} [{mb / nat_best / 1e9:>6.1f}]"
                  f" {mb / ref / 1e9:>8.1f} [{mb / ref_best / 1e9:>6.1f}] {ref / nat:>7.2f}x", flush=True)


def run_fusions(args, g: torch.Generator) -> None:
    print(f"{'linears':>14} {'fmt':>5} {'kernel':>7} {'separate us':>12} {'fused us':>9} {'saved':>6}")
    for name, shapes in FUSIONS:
        k = shapes[0][1]
        x = torch.randn(args.tokens, k, generator=g)
        for fmt in args.formats:
            parts = [make_weight(fmt, n, k, g) for n, _ in shapes]
            fused = make_weight(fmt, sum(n for n, _ in shapes), k, g)
            for kernel_name, kernel in (("native", lambda x, w: gemv(x, w, None)), ("torch", torch_kernel)):
                got = measure({"separate": lambda: [kernel(x, w) for w in parts], "fused": lambda: kernel(x, fused)},
                              args.repeats, args.round_s)
                sep, fus = got["separate"][0], got["fused"][0]
                print(f"{name:>14} {fmt:>5} {kernel_name:>7} "
                      f"{sep * 1e6:>12.1f} {fus * 1e6:>9.1f} {1 - fus / sep:>6.0%}", flush=True)


def run_moe(args, g: torch.Generator) -> None:
    """One MoE layer (module doc): native kernel vs the per-expert torch loop, per format."""
    from zllm_backend_cpu.kernels.moe_gemv import moe_gemv  # binds the library's entry points

    e, n, k, top_k = args.moe
    router = RouterConfig(e, top_k, norm_topk_prob=True)
    print(f"MoE layer: {e} experts of {n} x {k}, top-{top_k}, T = {args.tokens}")
    print(f"{'fmt (down)':>10} {'MB/expert':>9} {'native us':>18} {'GB/s':>6} {'torch loop us':>18} {'GB/s':>6} "
          f"{'speed-up':>8}")
    for fmt in args.formats:
        down_fmt = KQUANT_FALLBACK[fmt] if fmt in KQUANTS and n % 256 else fmt
        stacks = (make_expert_stack(g, fmt, e, n, k), make_expert_stack(g, fmt, e, n, k),
                  make_expert_stack(g, down_fmt, e, k, n))
        expert_bytes = sum(weight_bytes(s) for s in stacks) / e
        x = torch.randn(args.tokens, k, generator=g)
        # each call a fresh routing: the same experts every call would stay in the caches
        logits = [torch.randn(args.tokens, e, generator=g) for _ in range(64)]
        step = {"native": 0, "torch": 0}

        def call(name: str, kernel) -> None:
            step[name] += 1
            kernel(x, logits[step[name] % len(logits)], router, *stacks)

        got = measure({"native": lambda: call("native", moe_gemv), "torch": lambda: call("torch", torch_moe.moe)},
                      args.repeats, args.round_s)
        (nat, nat_best), (ref, ref_best) = got["native"], got["torch"]
        active = expert_bytes * experts_selected(e, top_k, args.tokens)
        label = fmt if down_fmt == fmt else f"{fmt}/{down_fmt}"
        print(f"{label:>10} {expert_bytes / 1e6:>9.2f} {nat * 1e6:>8.0f} [{nat_best * 1e6:>7.0f}]"
              f" {active / nat / 1e9:>6.1f} {ref * 1e6:>8.0f} [{ref_best * 1e6:>7.0f}] {active / ref / 1e9:>6.1f}"
              f" {ref / nat:>7.2f}x", flush=True)


def experts_selected(e: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` uniformly routed tokens select: ``E (1 - (1 - k/E)^T)``."""
    return e * (1 - (1 - top_k / e) ** tokens)


def run_model(args, g: torch.Generator) -> None:
    print(f"{'model':>12} {'fmt':>5} {'MB/token':>9} {'native GB/s':>18} {'tok/s':>6} {'torch GB/s':>18} {'tok/s':>6}")
    for fmt in args.formats:
        for fused in (False, True) if args.fusion else (False,):
            run_model_format(args, g, fmt, fused)


def run_model_format(args, g: torch.Generator, fmt: str, fused: bool) -> None:
    """One row of :func:`run_model`: every linear of a decode step stored as ``fmt``."""
    weights = [make_weight(fmt, n, k, g) for n, k in model_shapes(args.model, fused)]
    mb = sum(weight_bytes(w) for w in weights)
    xs = {w.shape[1]: torch.randn(args.tokens, w.shape[1], generator=g) for w in weights}
    got = measure({"native": lambda: [gemv(xs[w.shape[1]], w, None) for w in weights],
                   "torch": lambda: [torch_kernel(xs[w.shape[1]], w) for w in weights]},
                  args.repeats, args.round_s)
    (nat, nat_best), (ref, ref_best) = got["native"], got["torch"]
    name = args.model + (" fused" if fused else "")
    print(f"{name:>12} {fmt:>5} {mb / 1e6:>9.1f} {mb / nat / 1e9:>8.1f} [{mb / nat_best / 1e9:>6.1f}] {1 / nat:>6.1f}"
          f" {mb / ref / 1e9:>8.1f} [{mb / ref_best / 1e9:>6.1f}] {1 / ref:>6.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch (and native) threads (default 2)")
    p.add_argument("--tokens", type=int, default=1, help="T, tokens per call (default 1: a decode step)")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds per case (default 15)")
    p.add_argument("--round-s", type=float, default=0.02, help="seconds per round (default 0.02)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, default {','.join(FORMATS)}")
    p.add_argument("--fusion", action="store_true",
                   help="time separate vs fused q/k/v and gate/up instead (with --model: whole decode steps)")
    p.add_argument("--model", choices=sorted(MODELS), help="time every linear of one decode step of this model instead")
    p.add_argument("--shapes", help="comma-separated NxK weights instead of the built-in shapes, e.g. 4096x1024")
    p.add_argument("--moe", help="time one MoE layer instead: E,N,K,k (experts, width, hidden, top-k)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the process's CPU time (load-independent with one thread)")
    args = p.parse_args()
    try:
        args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
        args.moe = tuple(int(v) for v in args.moe.split(",")) if args.moe else None
    except ValueError:
        p.error("--shapes takes NxK[,NxK...] and --moe E,N,K,k, all integers")
    if args.moe is not None and len(args.moe) != 4:
        p.error("--moe takes E,N,K,k")
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        p.error(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    reason = unavailable_reason()
    if reason is not None:
        p.exit(2, f"error: native kernels unavailable: {reason}\n")
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"threads {torch.get_num_threads()}, T = {args.tokens}, {args.repeats} rounds of {args.round_s} s per case, "
          f"{args.clock} clock")
    g = torch.Generator().manual_seed(0)
    if args.moe:
        run_moe(args, g)
    elif args.model:
        run_model(args, g)
    elif args.fusion:
        run_fusions(args, g)
    else:
        run_shapes(args, g)


if __name__ == "__main__":
    main()
