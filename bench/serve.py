"""Serving benchmark: ``zllm serve`` under concurrent streaming clients vs HF batched ``generate``.

``.venv/bin/python bench/serve.py`` (``make bench-serve``). On loopback it starts ``zllm serve``
(its own process) on a benchmark model, sends the same R random-id prompts (default 16) as
streaming ``/v1/completions`` requests with at most C in flight for every C in
``--concurrency`` (C = 1 is the same requests one after another), and measures aggregate
generated tokens/s and p50/p99 time to first token. Then transformers' batched ``generate``
runs on the same R prompts (left padding, greedy, the same token count) in a
``bench/worker.py`` subprocess. Every run generates exactly ``--max-tokens`` per request
(``ignore_eos`` / ``min_new_tokens``). ``--batch-invariant on,off`` repeats the server part
with ``runtime.batch_invariant`` on and off. See bench/README.md. Nothing here asserts on
timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from models import MODELS, ensure, model_info  # noqa: E402
from run import default_threads, random_prompt, run_worker, worker_env  # noqa: E402

STARTUP_TIMEOUT_S = 300.0
WARMUP_TOKENS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama-110m", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (no early stop)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (random token ids)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated; requests in flight at once")
    p.add_argument("--requests", type=int, default=None, help="prompts per run (default: the largest concurrency)")
    p.add_argument("--batch-invariant", default="off", help="comma-separated on/off: runtime.batch_invariant")
    p.add_argument("--threads", type=int, default=default_threads(), help="CPU threads for the server and HF")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--skip-hf", action="store_true", help="leave out transformers' batched generate")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per HF worker / per server run")
    p.add_argument("--json", metavar="OUT", type=Path, help="write settings and every measurement here")
    load = p.add_argument_group("load run (bench/serve_load.py): --load-s switches to it")
    load.add_argument("--load-s", type=float, default=None, help="seconds of load over all four POST routes")
    load.add_argument("--load-concurrency", type=int, default=16, help="closed-loop clients during the load")
    load.add_argument("--disconnect-frac", type=float, default=0.1, help="requests dropped after the first event")
    load.add_argument("--malformed-frac", type=float, default=0.05, help="requests sent with a malformed body")
    load.add_argument("--rss-interval-s", type=float, default=0.5, help="seconds between server RSS samples")
    load.add_argument("--num-blocks", type=int, default=None,
                      help="KV blocks (default: every client's request fits; fewer forces preemption)")
    load.add_argument("--request-timeout-s", type=float, default=None, help="server.request_timeout_s")
    args = p.parse_args(argv)
    if args.model not in MODELS:
        p.error(f"unknown model {args.model!r}; known: {', '.join(MODELS)}")
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error(f"--concurrency must be comma-separated ints, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency values must be >= 1")
    modes = [m.strip() for m in args.batch_invariant.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        p.error(f"--batch-invariant takes on, off or on,off; got {args.batch_invariant!r}")
    args.batch_invariant = list(dict.fromkeys(modes))
    args.requests = args.requests or max(args.concurrency)
    for name in ("max_tokens", "prompt_tokens", "requests", "threads", "load_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("disconnect_frac", "malformed_frac"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.load_s is not None and not args.load_s > 0:
        p.error("--load-s must be > 0")
    return args


# ---------------------------------------------------------------------------- the server


def server_config(model_dir: Path, name: str, args, batch_invariant: bool) -> dict[str, Any]:
    """Runtime sized to the workload: every concurrent request fits in the KV cache at once,
    one prefill chunk per prompt, no prefix cache (every prompt is new anyway)."""
    block = 16
    per_seq = -(-(args.prompt_tokens + args.max_tokens) // block)
    seqs = max(args.concurrency)
    config = {
        "schema_version": 1,
        "model": {"path": str(model_dir), "dtype": "f32"},
        "backend": {"name": "cpu", "threads": args.threads},
        "runtime": {
            "kv_cache": {"block_size": block, "num_blocks": per_seq * seqs + 1},
            "max_num_seqs": seqs,
            "max_prefill_tokens": max(512, args.prompt_tokens),
            "context_length": per_seq * block,
            "prefix_cache_seqs": 0,
        },
        "server": {"served_model_name": name},
    }
    if batch_invariant or config_supports_batch_invariant() is None:  # "off" runs without the key too
        config["runtime"]["batch_invariant"] = batch_invariant
    return config


def config_supports_batch_invariant() -> str | None:
    """None when ``runtime.batch_invariant`` is a key of the config contract; else why not."""
    from zllm.spec.config import RuntimeConfig, config_from_dict
    from zllm.spec.errors import ConfigError

    if "batch_invariant" in {a.name for a in RuntimeConfig.__attrs_attrs__}:
        return None
    try:  # say what the config loader itself answers
        config_from_dict({"schema_version": 1, "model": {"path": str(BENCH)}, "backend": {"name": "cpu"},
                          "runtime": {"batch_invariant": True}})
    except ConfigError as exc:
        return str(exc)
    return "RuntimeConfig has no batch_invariant field"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _zllm_command() -> list[str]:
    script = Path(sys.executable).with_name("zllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "zllm.cli.main"]


class ServerProcess:
    """``zllm serve`` on a free loopback port, its output in ``log``."""

    def __init__(self, config: dict[str, Any], workdir: Path, threads: int):
        from ruamel.yaml import YAML

        cfg_path = workdir / "config.yaml"
        with cfg_path.open("w") as f:
            YAML().dump(config, f)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "server.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            [*_zllm_command(), "serve", "--config", str(cfg_path), "--port", str(self.port), "--log-level", "warning"],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=worker_env(threads))

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> float:
        import httpx

        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zllm serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"zllm serve not healthy after {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


# ---------------------------------------------------------------------------- the clients


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streaming completion; send time, first-token time, end time and generated tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    tokens = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if first is None and chunk["choices"]:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None or tokens is None:
        raise RuntimeError("the stream ended without a token or without usage")
    return {"sent": sent, "first": first, "end": end, "tokens": tokens}


async def run_level(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int):
    """All ``prompts`` with at most ``concurrency`` requests in flight (a closed loop)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def gated(p):
            async with gate:
                return await one_request(client, url, model, p, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        end = time.perf_counter()
    return summarize_level(results, start, end, concurrency)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]), as numpy's default."""
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize_level(results: list[dict[str, float]], start: float, end: float, concurrency: int) -> dict[str, Any]:
    ttfts = [r["first"] - r["sent"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "generated_tokens": tokens,
            "wall_s": end - start, "tok_s": tokens / (end - start),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99), "ttft_s": ttfts}


def bench_server(model_dir: Path, args, prompts, warmup, batch_invariant: bool) -> dict[str, Any]:
    name = args.model
    with tempfile.TemporaryDirectory(prefix="zllm-bench-serve-") as tmp:
        server = ServerProcess(server_config(model_dir, name, args, batch_invariant), Path(tmp), args.threads)
        try:
            startup_s = server.wait_healthy()
            asyncio.run(run_level(server.url, name, [warmup], WARMUP_TOKENS, 1))
            levels = {}
            for c in sorted({1, *args.concurrency}):  # 1 = the requests one after another
                levels[c] = asyncio.run(run_level(server.url, name, prompts, args.max_tokens, c))
                lv = levels[c]
                print(f"[bench-serve] batch_invariant={'on' if batch_invariant else 'off'} concurrency {c}: "
                      f"{lv['tok_s']:.1f} tok/s, TTFT p50 {lv['ttft_p50_s'] * 1000:.0f} ms, "
                      f"{lv['generated_tokens']} tokens in {lv['wall_s']:.1f} s", flush=True)
        finally:
            server.stop()
    return {"startup_s": startup_s, "levels": levels}


# ---------------------------------------------------------------------------- the table


def format_table(report: dict[str, Any]) -> str:
    cols = ("engine", "mode", "concurrency", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "wall s", "tokens",
            "vs sequential", "vs HF batched")
    rows: list[tuple[str, ...]] = []
    hf = report.get("transformers")
    hf_tok_s = hf["tok_s"] if hf and "error" not in hf else None

    def ratio(a: float, b: float | None) -> str:
        return f"{a / b:.2f}x" if b else "-"

    for mode, res in report["zllm"].items():
        if "skipped" in res or "error" in res:
            rows.append(("zllm serve", f"bi={mode}", "-", "-", "-", "-", "-", "-", "-", "-"))
            continue
        seq = res["levels"][1]["tok_s"]
        for c, lv in res["levels"].items():
            rows.append(("zllm serve", f"bi={mode}", f"{c}" + (" (sequential)" if c == 1 else ""),
                         f"{lv['tok_s']:.1f}", f"{lv['ttft_p50_s'] * 1000:.1f}", f"{lv['ttft_p99_s'] * 1000:.1f}",
                         f"{lv['wall_s']:.2f}", str(lv["generated_tokens"]), ratio(lv["tok_s"], seq),
                         ratio(lv["tok_s"], hf_tok_s)))
    if hf is not None:
        if "error" in hf:
            rows.append(("transformers", "batched", "-", "-", "-", "-", "-", "-", "-", "-"))
        else:
            ttft = f"{hf['ttft_s'] * 1000:.1f}"
            rows.append(("transformers", "batched", str(hf["requests"]), f"{hf['tok_s']:.1f}", ttft, ttft,
                         f"{hf['total_s']:.2f}", str(hf["generated_tokens"]), "-", "1.00x"))
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def load_main(model_dir: Path, args) -> int:
    """``--load-s``: one server under the load of bench/serve_load.py; 0 when it held."""
    from serve_load import format_load, run_load, with_chat_template

    with tempfile.TemporaryDirectory(prefix="zllm-bench-load-") as tmp:
        served = with_chat_template(model_dir, Path(tmp))
        # The chat routes' prompts are text through a template: room for 64 prompt tokens.
        sizing = argparse.Namespace(**{**vars(args), "concurrency": [args.load_concurrency],
                                       "prompt_tokens": max(args.prompt_tokens, 64)})
        config = server_config(served, args.model, sizing, batch_invariant=False)
        if args.num_blocks is not None:
            config["runtime"]["kv_cache"]["num_blocks"] = args.num_blocks
        if args.request_timeout_s is not None:
            config["server"]["request_timeout_s"] = args.request_timeout_s
        server = ServerProcess(config, Path(tmp), args.threads)
        try:
            server.wait_healthy()
            report = run_load(server, args.model, args)
        finally:
            server.stop()
        report["exit_status"] = server.proc.returncode
    report["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(format_load(report))
    print(f"server exit status after SIGTERM: {report['exit_status']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench-serve] wrote {args.json}")
    return 0 if report["held"] and report["exit_status"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = ensure(args.model)
    if args.load_s is not None:
        return load_main(model_dir, args)
    info = model_info(model_dir)
    if args.prompt_tokens + args.max_tokens > info["context_length"]:
        print(f"[bench-serve] {args.model}: prompt + max tokens exceed its context of {info['context_length']}",
              file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, args.prompt_tokens, info) for _ in range(args.requests)]
    warmup = random_prompt(random.Random(10_000 + args.seed), args.prompt_tokens, info)
    report: dict[str, Any] = {
        "settings": {"model": args.model, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                     "requests": args.requests, "concurrency": args.concurrency,
                     "batch_invariant": args.batch_invariant, "threads": args.threads, "seed": args.seed},
        "loadavg_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "zllm": {},
    }
    failures = 0
    missing = config_supports_batch_invariant()
    for mode in args.batch_invariant:
        if missing is not None and mode == "on":
            why = f"runtime.batch_invariant is not a config key in this zllm ({missing})"
            print(f"[bench-serve] skipping batch_invariant={mode}: {why}", flush=True)
            report["zllm"][mode] = {"skipped": why}
            continue
        try:
            report["zllm"][mode] = bench_server(model_dir, args, prompts, warmup, mode == "on")
        except RuntimeError as exc:
            failures += 1
            print(f"[bench-serve] batch_invariant={mode} failed: {exc}", file=sys.stderr, flush=True)
            report["zllm"][mode] = {"error": str(exc)}
    if not args.skip_hf:
        spec = {"mode": "batch", "model_path": str(model_dir), "dtype": "f32", "prompts": prompts,
                "warmup_prompts": [warmup] * min(len(prompts), 2), "new_tokens": args.max_tokens,
                "threads": args.threads}
        hf = run_worker(spec, args.threads, args.timeout)
        if "error" in hf:
            failures += 1
            print(f"[bench-serve] transformers batched generate failed: {hf['error']}\n{hf.get('stderr_tail', '')}",
                  file=sys.stderr, flush=True)
        else:
            print(f"[bench-serve] transformers batched generate: {hf['tok_s']:.1f} tok/s, "
                  f"{hf['generated_tokens']} tokens in {hf['total_s']:.1f} s", flush=True)
        report["transformers"] = hf
    report["loadavg_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    print()
    print(f"serving {args.model}: {args.requests} streaming requests, {args.prompt_tokens} prompt tokens, "
          f"{args.max_tokens} generated tokens each (greedy, no early stop), {args.threads} threads, loopback")
    print(format_table(report))
    print("tok/s: generated tokens of all requests / wall time of the run. TTFT: request sent -> first token "
          "(for transformers: the batch's first step). 'vs sequential': tok/s over concurrency 1; "
          "'vs HF batched': tok/s over transformers' batched generate.")
    if report["loadavg_start"] is not None and report["loadavg_start"] >= 1.0:
        print(f"[bench-serve] warning: the 1-minute load average was {report['loadavg_start']:.1f} on "
              f"{os.cpu_count()} CPUs before the run: other work shares the CPUs, timings are noisy")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench-serve] wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
