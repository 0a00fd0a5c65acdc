"""The MoE/MLA rows that ``bench/run.py``'s batch-1 table does not have: concurrent sequences
on a MoE model against llama.cpp's ``llama-batched-bench``, and decode at a long context
against ``llama-bench -d``.

```
.venv/bin/python bench/moe_rows.py                       # both rows, both MoE models, Q8_0 + F16
.venv/bin/python bench/moe_rows.py --rows context --models deepseek-v2-lite --dtypes q8_0
```

- ``batch``: ``--sequences`` (16) prompts of ``--prompt-tokens`` random ids submitted at once to
  one zllm ``Engine`` (``bench/worker.py``'s batch mode: continuous batching, greedy,
  ``--new-tokens`` each); decode tok/s = tokens delivered after every sequence had its first
  one, over that time. llama.cpp: ``llama-batched-bench -npp P -ntg N -npl S`` (the S prompts
  prefilled as one batch, then S tokens a step); decode tok/s = its ``speed_tg``. The
  bandwidth bound of a decode step: the weights every step reads (all but the routed experts
  and the embedding table) plus the routed experts that S tokens of uniform, independent
  routing touch, ``1 - (1 - k/E)^S`` of them; ``% bound`` = decode tok/s / (S x bandwidth /
  those bytes).
- ``context``: batch-1 decode of ``--new-tokens`` after a ``--context``-token prompt (4096):
  zllm through the worker's measure mode (the prompt in one prefill chunk), llama.cpp
  ``llama-bench -p 0 -n N -d C``.

Engines alternate within each repeat (``--repeats``, medians with min-max); the same GGUF file,
threads and lengths for both. Writes ``OUT.json`` and ``OUT.md`` (``--out``, default
``bench/out/moe_rows``). ``llama-batched-bench`` is built from the cached llama.cpp sources
(``bench/llama_cpp_peer.py``) the first time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import llama_cpp_peer  # noqa: E402
from gguf_export import bytes_per_token  # noqa: E402
from models import OUT, ensure, ensure_gguf, model_info  # noqa: E402
from run import (  # noqa: E402
    default_threads,
    experts_touched,
    limit_bandwidth,
    measure_bandwidth,
    random_prompt,
    run_worker,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="batch,context", help="comma-separated: batch, context")
    p.add_argument("--models", default="qwen3-moe-1b,deepseek-v2-lite", help="batch row models")
    p.add_argument("--context-models", default="deepseek-v2-lite", help="context row models")
    p.add_argument("--dtypes", default="q8_0,f16", help="GGUF weight types")
    p.add_argument("--sequences", type=int, default=16, help="concurrent sequences of the batch row")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt of each sequence (batch row)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each sequence generates")
    p.add_argument("--context", type=int, default=4096, help="context before decoding (context row)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=OUT / "moe_rows")
    args = p.parse_args(argv)
    args.rows, args.models = args.rows.split(","), args.models.split(",")
    args.context_models, args.dtypes = args.context_models.split(","), args.dtypes.split(",")
    return args


def batched_bench_binary() -> Path:
    """``llama-batched-bench`` beside ``llama-bench``, built (that target only) when missing.

    Raises:
        RuntimeError: no cached llama.cpp sources, or the build failed.
    """
    src = llama_cpp_peer.sources(fetch=True)
    if src is None:
        raise RuntimeError(f"no llama-cpp-python sdist in {llama_cpp_peer.CACHE}")
    llama_cpp_peer.build_llama_bench(src)  # configures build/ when it is not yet
    binary = src / "build" / "bin" / "llama-batched-bench"
    if not binary.exists():
        subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-batched-bench"], check=True,
                       capture_output=True)
    return binary


def llama_batched(binary: Path, model: Path, args) -> dict[str, Any]:
    """One ``llama-batched-bench`` run: its JSONL row as a result dict."""
    s, p, n = args.sequences, args.prompt_tokens, args.new_tokens
    cmd = [str(binary), "-m", str(model), "-t", str(args.threads), "-tb", str(args.threads), "-ngl", "0",
           "-c", str(s * (p + n)), "-b", "2048", "-ub", "512", "-npp", str(p), "-ntg", str(n), "-npl", str(s),
           "--output-format", "jsonl"]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
        out.seek(0)
        text = out.read()
    rows = [json.loads(line) for line in text.splitlines() if line.startswith('{"n_kv_max"')]
    if proc.returncode != 0 or len(rows) != 1:
        return {"error": f"{' '.join(cmd)} exited with {proc.returncode}", "stderr_tail": text[-1500:]}
    row = rows[0]
    return {"engine": "llama.cpp", "decode_tok_s": row["speed_tg"], "prefill_tok_s": row["speed_pp"], "raw": row}


def zllm_batched(model: Path, info: dict[str, Any], args) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    prompts = [random_prompt(rng, args.prompt_tokens, info) for _ in range(args.sequences)]
    warmup = [random_prompt(random.Random(10_000 + args.seed), args.prompt_tokens, info)]
    spec = {"mode": "batch", "engine": "zllm", "prompts": prompts, "warmup_prompts": warmup,
            "new_tokens": args.new_tokens, "threads": args.threads, "model_path": str(model), "dtype": "auto"}
    return run_worker(spec, args.threads, args.timeout)


def zllm_context(model: Path, info: dict[str, Any], args) -> dict[str, Any]:
    prompt = random_prompt(random.Random(args.seed), args.context, info)
    warmup = random_prompt(random.Random(10_000 + args.seed), 32, info)
    spec = {"mode": "measure", "engine": "zllm", "model_path": str(model), "prompt_ids": prompt,
            "warmup_ids": warmup, "new_tokens": args.new_tokens, "threads": args.threads}
    res = run_worker(spec, args.threads, args.timeout)
    res.pop("token_ids", None)
    return res


def llama_context(model: Path, args) -> dict[str, Any]:
    src = llama_cpp_peer.sources(fetch=True)
    if src is None:
        return {"error": f"no llama-cpp-python sdist in {llama_cpp_peer.CACHE}"}
    binary = llama_cpp_peer.build_llama_bench(src)
    common = ["-m", str(model), "-t", str(args.threads), "-ngl", "0"]
    try:
        row, _ = llama_cpp_peer._bench_once(
            binary, [*common, "-p", "0", "-n", str(args.new_tokens), "-d", str(args.context)], args.timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    return {"engine": "llama.cpp", "decode_tok_s": float(row["avg_ts"]), "raw": row}


def step_bytes(path: Path, sequences: int) -> dict[str, Any]:
    """Weight bytes one decode step of ``sequences`` tokens reads (module doc), with the file's
    expert counts."""
    f = bytes_per_token(path)
    shared = f["bytes_per_token"] - f["routed_expert_bytes"] * f["experts_per_token"] // f["experts"]
    touched = experts_touched(f["experts"], f["experts_per_token"], sequences)
    return {**f, "step_bytes": int(shared + f["routed_expert_bytes"] * touched), "touched_fraction": touched}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    vals = [r["decode_tok_s"] for r in runs if "error" not in r and r.get("decode_tok_s")]
    if not vals:
        return {"error": next((r["error"] for r in runs if "error" in r), "no runs")}
    return {"decode_tok_s": statistics.median(vals), "range": [min(vals), max(vals)], "ok_runs": len(vals)}


def _fmt(s: dict[str, Any]) -> str:
    if "error" in s:
        return "error"
    lo, hi = s["range"]
    return f"{s['decode_tok_s']:.1f} ({lo:.1f}-{hi:.1f})"


def render(report: dict[str, Any]) -> str:
    lines = [f"threads {report['threads']}, repeats {report['repeats']}, bandwidth "
             f"{report['bandwidth'].get('dram_gb_s', float('nan')):.1f} GB/s (2 GiB working set); medians (min-max)\n"]
    if report.get("batch"):
        lines.append(f"### {report['sequences']} concurrent sequences ({report['prompt_tokens']} prompt + "
                     f"{report['new_tokens']} new tokens each): decode tok/s, all sequences together\n")
        lines.append("| model | dtype | experts touched | MiB / step | bound tok/s | zllm | llama.cpp | "
                     "zllm/llama.cpp | zllm % of bound |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for key, row in report["batch"].items():
            z, ll = row["zllm"], row["llama.cpp"]
            ratio = z["decode_tok_s"] / ll["decode_tok_s"] if "error" not in z and "error" not in ll else None
            pct = 100 * z["decode_tok_s"] / row["bound_tok_s"] if "error" not in z and row["bound_tok_s"] else None
            lines.append(f"| {key.split(':')[0]} | {key.split(':')[1].upper()} | {100 * row['touched_fraction']:.0f}% "
                         f"| {row['step_bytes'] / 2**20:.0f} | {row['bound_tok_s']:.0f} | {_fmt(z)} | {_fmt(ll)} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} | {'-' if pct is None else f'{pct:.0f}%'} |")
        lines.append("")
    if report.get("context"):
        lines.append(f"### Batch-1 decode after {report['context_tokens']} tokens of context ({report['new_tokens']} "
                     "new tokens): tok/s\n")
        lines.append("| model | dtype | zllm | llama.cpp | zllm/llama.cpp | zllm prefill tok/s |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: |")
        for key, row in report["context"].items():
            z, ll = row["zllm"], row["llama.cpp"]
            ratio = z["decode_tok_s"] / ll["decode_tok_s"] if "error" not in z and "error" not in ll else None
            prefill = [r["prefill_tok_s"] for r in row["runs"]["zllm"] if "error" not in r]
            lines.append(f"| {key.split(':')[0]} | {key.split(':')[1].upper()} | {_fmt(z)} | {_fmt(ll)} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
                         f"{statistics.median(prefill) if prefill else float('nan'):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bw = measure_bandwidth(args.threads, args.timeout)
    report: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats, "sequences": args.sequences,
                              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                              "context_tokens": args.context, "bandwidth": bw, "batch": {}, "context": {}}
    failures = 0
    if "batch" in args.rows:
        binary = batched_bench_binary()
        for name in args.models:
            info = model_info(ensure(name))
            for dtype in args.dtypes:
                path, _ = ensure_gguf(name, dtype)
                runs: dict[str, list] = {"zllm": [], "llama.cpp": []}
                for rep in range(args.repeats):
                    runs["zllm"].append(zllm_batched(path, info, args))
                    runs["llama.cpp"].append(llama_batched(binary, path, args))
                    for engine, r in runs.items():
                        print(f"[moe-rows] batch {name} {dtype} {engine} {rep + 1}/{args.repeats}: "
                              f"{r[-1].get('decode_tok_s') or r[-1].get('error')}", flush=True)
                sb = step_bytes(path, args.sequences)
                limit = limit_bandwidth(bw, sb["step_bytes"])
                report["batch"][f"{name}:{dtype}"] = {
                    **sb, "bound_tok_s": args.sequences * limit / sb["step_bytes"] if limit else None,
                    "zllm": summary(runs["zllm"]), "llama.cpp": summary(runs["llama.cpp"]), "runs": runs}
                failures += sum("error" in r for rs in runs.values() for r in rs)
    if "context" in args.rows:
        for name in args.context_models:
            info = model_info(ensure(name))
            for dtype in args.dtypes:
                path, _ = ensure_gguf(name, dtype)
                runs = {"zllm": [], "llama.cpp": []}
                for rep in range(args.repeats):
                    runs["zllm"].append(zllm_context(path, info, args))
                    runs["llama.cpp"].append(llama_context(path, args))
                    for engine, r in runs.items():
                        print(f"[moe-rows] context {name} {dtype} {engine} {rep + 1}/{args.repeats}: "
                              f"{r[-1].get('decode_tok_s') or r[-1].get('error')}", flush=True)
                report["context"][f"{name}:{dtype}"] = {"zllm": summary(runs["zllm"]),
                                                       "llama.cpp": summary(runs["llama.cpp"]), "runs": runs}
                failures += sum("error" in r for rs in runs.values() for r in rs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    md = render(report)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
