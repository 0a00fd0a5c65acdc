"""zllm side by side with llama.cpp and HF transformers on the CPU: ``.venv/bin/python bench/run.py`` (``make bench``).

One run: build or reuse the checkpoints (:mod:`models`) and their GGUF files
(:mod:`gguf_export`), measure memory bandwidth, then for every model, repeat, dtype and
engine — interleaved, so slow drift in machine load hits every engine alike — one fresh
subprocess measures prefill tokens/s, batch-1 decode tokens/s, time to first token, load
time and peak-RSS growth (``bench/worker.py``; llama.cpp through ``llama-bench``, see
:mod:`llama_cpp_peer`). Optionally the batched throughput of the continuous-batching runtime
(``--batch``) and a per-op profile of one decode round (``--profile``). Prints Markdown
tables of medians (with min-max) and ratios zllm/llama.cpp and zllm/transformers, and writes
them plus every raw run as Markdown and JSON under ``bench/out/``. See ``bench/README.md``
and ``docs/performance.md``. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import llama_cpp_peer  # noqa: E402
from gguf_export import bytes_per_token  # noqa: E402
from models import GGUF_DTYPES, MODELS, OUT, ensure, ensure_gguf, model_info  # noqa: E402
from worker import RESULT_PREFIX  # noqa: E402  (stdlib-only at import time)

ENGINE_ORDER = ("zllm", "llama.cpp", "transformers")
#: The transformers run each row is compared with. transformers runs the HF checkpoint in f32
#: and bf16 (its CPU dtypes; f16 prefill on the CPU is ~20x slower than f32 there); F16 rows
#: compare with bf16, and Q8_0 (no transformers path) with f32. "= ref" needs the same dtype.
HF_DTYPE = {"f32": "f32", "f16": "bf16", "bf16": "bf16", "q8_0": "f32"}
DEFAULT_MODELS = ("llama-15m", "llama-110m", "llama-0.5b")
QUICK = {"models": "llama-15m,llama-110m", "dtypes": "f32,q8_0", "repeats": 3}

METRICS = (  # key in a worker result, column title, format, scale
    ("prefill_tok_s", "prefill tok/s", "{:.1f}", 1.0),
    ("decode_tok_s", "decode tok/s", "{:.1f}", 1.0),
    ("ttft_s", "TTFT ms", "{:.1f}", 1000.0),
    ("load_s", "load s", "{:.2f}", 1.0),
    ("peak_rss_growth_bytes", "peak RSS +MiB", "{:.1f}", 1.0 / (1 << 20)),
)


def default_threads() -> int:
    """2 (the reference machine's thread count), or fewer when fewer CPUs are usable."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return min(2, usable)


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=None, help=f"comma-separated (default {','.join(DEFAULT_MODELS)}); "
                                                  f"known: {', '.join(MODELS)}")
    p.add_argument("--dtypes", default=None, help=f"comma-separated GGUF weight types (default all: "
                                                  f"{','.join(GGUF_DTYPES)})")
    p.add_argument("--engines", default=",".join(ENGINE_ORDER), help="comma-separated engines")
    p.add_argument("--quick", action="store_true",
                   help=f"a short check: models {QUICK['models']}, dtypes {QUICK['dtypes']}, {QUICK['repeats']} "
                        "repeats (explicit --models/--dtypes/--repeats win)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (random token ids)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to generate (no early stop)")
    p.add_argument("--repeats", type=int, default=None, help="fresh processes per engine, model and dtype (default 5)")
    p.add_argument("--threads", type=int, default=default_threads(), help="CPU threads for every engine")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker process")
    p.add_argument("--llama-cpp", choices=("auto", "bench", "python", "off"), default="auto",
                   help="llama.cpp peer: auto = llama-bench (built once from the llama-cpp-python sdist when "
                        "missing), else the llama_cpp Python API if installed; bench / python force one")
    p.add_argument("--gguf-writer", choices=("auto", "llama.cpp", "gguf"), default="auto",
                   help="who writes missing GGUF files (see bench/gguf_export.py)")
    p.add_argument("--batch", default=None,
                   help="comma-separated concurrent sequences for the batched-throughput table "
                        "(default 1,4,16; 'none' skips it; --quick skips it unless given)")
    p.add_argument("--batch-model", default="llama-110m", help="model of the batched-throughput table")
    p.add_argument("--profile", action="store_true",
                   help="also profile one zllm decode round per model and dtype (into profile/ beside --out)")
    p.add_argument("--profile-only", action="store_true", help="only the profiles (no measurements)")
    p.add_argument("--out", type=Path, default=OUT / "bench", help="writes OUT.md and OUT.json")
    p.add_argument("--json", metavar="OUT", type=Path, help="also write the JSON report here")
    p.add_argument("--render", metavar="JSON", type=Path,
                   help="only print the Markdown report of an earlier run's JSON (nothing runs)")
    args = p.parse_args(argv)

    args.models = _csv(args.models or (QUICK["models"] if args.quick else ",".join(DEFAULT_MODELS)))
    args.dtypes = _csv(args.dtypes or (QUICK["dtypes"] if args.quick else ",".join(GGUF_DTYPES)))
    args.repeats = args.repeats if args.repeats is not None else (QUICK["repeats"] if args.quick else 5)
    args.engines = _csv(args.engines)
    batch = args.batch if args.batch is not None else ("none" if args.quick or args.profile_only else "1,4,16")
    for m in [*args.models, args.batch_model]:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    for d in args.dtypes:
        if d not in GGUF_DTYPES:
            p.error(f"unknown dtype {d!r}; known: {', '.join(GGUF_DTYPES)}")
    for e in args.engines:
        if e not in ENGINE_ORDER:
            p.error(f"unknown engine {e!r}; known: {', '.join(ENGINE_ORDER)}")
    try:
        args.batch = [] if batch == "none" else sorted({int(c) for c in _csv(batch)})
    except ValueError:
        p.error(f"--batch takes comma-separated integers or 'none', got {batch!r}")
    if any(c < 1 for c in args.batch):
        p.error("--batch values must be >= 1")
    for name in ("prompt_tokens", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode speed needs a token after the first)")
    if args.llama_cpp == "off" and "llama.cpp" in args.engines:
        args.engines.remove("llama.cpp")
    return args


# ---------------------------------------------------------------------------- workers


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    })
    return env


def run_worker(spec: dict[str, Any], threads: int, timeout: float) -> dict[str, Any]:
    """Run one worker process; its result dict, or ``{"error": ...}``."""
    cmd = [sys.executable, str(BENCH / "worker.py"), json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(threads), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    return {"error": f"exit status {proc.returncode}", "stderr_tail": tail}


def random_prompt(rng: random.Random, n: int, info: dict[str, Any]) -> list[int]:
    """``n`` ids: BOS (when the model has one) then uniform ids that are not special."""
    bos = info["bos_token_id"]
    special = {0, 1, 2, *info["eos_token_ids"], *([bos] if bos is not None else [])}
    ids = [bos] if bos is not None else []
    while len(ids) < n:
        t = rng.randrange(info["vocab_size"])
        if t not in special:
            ids.append(t)
    return ids[:n]


# ---------------------------------------------------------------------------- llama.cpp


def resolve_llama_cpp(mode: str) -> dict[str, Any]:
    """How llama.cpp runs in this benchmark: ``{"kind": "llama-bench", "binary", "source"}``,
    ``{"kind": "python"}`` or ``{"kind": None, "why"}``."""
    reasons = []
    if mode in ("auto", "bench"):
        try:
            src = llama_cpp_peer.sources(fetch=True)
            if src is None:
                raise RuntimeError(f"no llama-cpp-python sdist in {llama_cpp_peer.CACHE}")
            binary = llama_cpp_peer.build_llama_bench(src)
            return {"kind": "llama-bench", "binary": str(binary),
                    "source": f"llama-cpp-python {llama_cpp_peer.sdist_version(src)} sdist, vendor/llama.cpp"}
        except RuntimeError as exc:
            reasons.append(f"llama-bench unavailable: {exc}")
    if mode in ("auto", "python"):
        if importlib.util.find_spec("llama_cpp") is not None:
            return {"kind": "python", "source": "llama_cpp Python API (installed llama-cpp-python)"}
        reasons.append("the llama_cpp Python package is not installed")
    return {"kind": None, "why": "; ".join(reasons) or "off"}


def describe_peer(peer: dict[str, Any]) -> str:
    if peer["kind"] == "llama-bench":
        return f"llama.cpp: llama-bench built from the {peer['source']}"
    if peer["kind"] == "python":
        return f"llama.cpp: the {peer['source']}"
    return f"llama.cpp: not run ({peer['why']})"


def run_llama_cpp(peer: dict[str, Any], spec: dict[str, Any], args) -> dict[str, Any]:
    if peer["kind"] == "python":
        return run_worker(spec, args.threads, args.timeout)
    try:
        return llama_cpp_peer.run_llama_bench(Path(peer["binary"]), Path(spec["model_path"]), args.prompt_tokens,
                                         args.new_tokens, args.threads, args.timeout)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        return {"error": str(exc)}


# ---------------------------------------------------------------------------- bandwidth


def measure_bandwidth(threads: int, timeout: float) -> dict[str, Any]:
    """Memory read bandwidth with ``threads`` threads (worker mode ``bandwidth``)."""
    res = run_worker({"mode": "bandwidth", "threads": threads}, threads, timeout)
    if "error" in res:
        print(f"[bench] bandwidth measurement failed: {res['error']}", file=sys.stderr, flush=True)
    return res


def best_bandwidth(*measurements: dict[str, Any]) -> dict[str, Any]:
    """Per working-set size, the best of several bandwidth measurements (a machine shared with
    other work only ever makes a sum slower), plus the measurements themselves."""
    ok = [m for m in measurements if "error" not in m]
    if not ok:
        return measurements[0]
    curve = {mib: max(m["cache_curve_gb_s"][mib] for m in ok) for mib in ok[0]["cache_curve_gb_s"]}
    mib = max(curve, key=curve.get)
    return {**ok[0], "dram_gb_s": max(m["dram_gb_s"] for m in ok), "cache_mib": int(mib), "cache_gb_s": curve[mib],
            "cache_curve_gb_s": curve, "measurements": list(measurements)}


def limit_bandwidth(bw: dict[str, Any], nbytes: int) -> float | None:
    """The bandwidth that bounds reading ``nbytes`` per token, bytes/s: the figure measured
    for the smallest working set of at least ``nbytes`` (16, 32, 64, 128 MiB or 2 GiB)."""
    if "error" in bw:
        return None
    curve = {int(mib): gb_s for mib, gb_s in bw["cache_curve_gb_s"].items()}
    curve[bw["dram_mib"]] = bw["dram_gb_s"]
    mib = min((m for m in curve if m << 20 >= nbytes), default=bw["dram_mib"])
    return curve[mib] * 1e9


# ---------------------------------------------------------------------------- aggregation


def summarize(runs: list[dict[str, Any]], reference_ids: list[int] | None) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"ok_runs": len(ok), "failed_runs": len(runs) - len(ok)}
    if not ok:
        out["error"] = runs[0].get("error") if runs else "no runs"
        return out
    for key, *_ in METRICS:
        vals = [r[key] for r in ok if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
        out[key + "_range"] = [min(vals), max(vals)] if vals else None  # spread over repeats
    out["generated_tokens"] = min(r["generated_tokens"] for r in ok)
    ids = ok[0].get("token_ids")
    if reference_ids is not None and ids is not None:
        same = 0
        for a, b in zip(ids, reference_ids, strict=True):
            if a != b:
                break
            same += 1
        out["tokens_matching_reference"] = same
    out["versions"] = ok[0].get("versions", {})
    out["how"] = ok[0].get("how")
    return out


def ratios(summary: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, float | None] | None:
    if ref is None or "error" in ref or "error" in summary:
        return None
    res = {}
    for key, *_ in METRICS:
        a, b = summary.get(key), ref.get(key)
        res[key] = a / b if a is not None and b not in (None, 0) else None
    return res


# ---------------------------------------------------------------------------- tables


def _md(header: list[str], rows: list[list[str]], right_from: int) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r + [""] * (len(header) - len(r))) + " |" for r in rows]
    return "\n".join(lines)


def _cell(s: dict[str, Any], key: str, fmt: str, scale: float, spread: bool = False) -> str:
    v = s.get(key)
    if v is None:
        return "-"
    text = fmt.format(v * scale)
    rng = s.get(key + "_range")
    if spread and rng and rng[0] != rng[1]:
        text += f" ({fmt.format(rng[0] * scale)}–{fmt.format(rng[1] * scale)})"
    return text


def format_table(report: dict[str, Any]) -> str:
    header = ["model", "dtype", "engine", *[m[1] for m in METRICS], "% BW limit", "tokens", "= ref"]
    rows: list[list[str]] = []
    for model, data in report["models"].items():
        for dtype, row in data["dtypes"].items():
            for engine, s in row["engines"].items():
                if "error" in s:
                    rows.append([model, dtype, engine, "ERROR: " + str(s["error"])[:120]])
                    continue
                cells = [model, dtype, engine]
                cells += [_cell(s, key, fmt, scale, spread=key == "decode_tok_s") for key, _, fmt, scale in METRICS]
                pct = s.get("bandwidth_pct")
                cells.append("-" if pct is None else f"{pct:.0f}%")
                cells.append(str(s["generated_tokens"]))
                m = s.get("tokens_matching_reference")
                cells.append("-" if m is None else f"{m}/{s['generated_tokens']}")
                rows.append(cells)
            for peer, r in row["ratios"].items():
                if r is None:
                    continue
                cells = [model, dtype, f"zllm/{peer}"]
                cells += ["-" if r[key] is None else f"{r[key]:.2f}x" for key, *_ in METRICS]
                rows.append(cells)
    return _md(header, rows, right_from=3)


def format_batch_table(batch: dict[str, Any]) -> str:
    header = ["engine", "sequences", "decode tok/s", "vs 1 sequence", "overall tok/s", "TTFT p50 ms",
              "zllm/transformers"]
    rows = []
    for engine, levels in batch["engines"].items():
        base = levels.get("1", {}).get("decode_tok_s")
        for c, s in levels.items():
            if "error" in s:
                rows.append([engine, c, "ERROR: " + str(s["error"])[:120]])
                continue
            hf = batch["engines"].get("transformers", {}).get(c, {}).get("decode_tok_s")
            rows.append([engine, c, _cell(s, "decode_tok_s", "{:.1f}", 1.0, spread=True),
                         f"{s['decode_tok_s'] / base:.2f}x" if base else "-",
                         _cell(s, "tok_s", "{:.1f}", 1.0), _cell(s, "ttft_p50_s", "{:.0f}", 1000.0),
                         f"{s['decode_tok_s'] / hf:.2f}x" if engine == "zllm" and hf else "-"])
    return _md(header, rows, right_from=1)


def format_bandwidth(bw: dict[str, Any]) -> str:
    if "error" in bw:
        return f"memory bandwidth: not measured ({bw['error']})"
    return (f"memory read bandwidth ({bw['threads']} threads, torch sum, best of repeats): "
            f"{bw['dram_gb_s']:.1f} GB/s over {bw['dram_mib']} MiB; {bw['cache_gb_s']:.1f} GB/s in cache "
            f"({bw['cache_mib']} MiB working set)")


#: Batch-1 decode targets as a fraction of llama.cpp's rate (the performance issue); the
#: small model's target is about per-token overhead, so it holds for every dtype.
DECODE_TARGETS = {"f32": 0.9, "f16": 1.0, "bf16": 1.0, "q8_0": 0.8}
SMALL_MODEL_TARGET = ("llama-15m", 0.6)


def kv_bytes_per_token(cfg: dict[str, Any], elem_bytes: int = 4) -> tuple[int, int | None]:
    """``(zllm's KV-cache bytes per token, an equivalent cache's or None)`` from a
    ``config.json``, ``elem_bytes`` per cached value: K and V per KV head, or for MLA
    (``kv_lora_rank``) one latent row of ``kv_lora_rank + qk_rope_head_dim`` beside the K
    (``nope + rope``) and V per head the same attention would cache without the latent."""
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):
        latent = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem_bytes
        per_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
        return latent, layers * heads * per_head * elem_bytes
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * layers * cfg.get("num_key_value_heads", heads) * head_dim * elem_bytes, None


def kv_cache_bytes(hf_dir: Path, tokens: int, block_size: int = 16) -> int:
    """Bytes of zllm's f32 KV cache for ``tokens`` tokens (whole blocks), from ``config.json``."""
    per_token, _ = kv_bytes_per_token(json.loads((hf_dir / "config.json").read_text()))
    return -(-tokens // block_size) * block_size * per_token


def format_targets(report: dict[str, Any]) -> str:
    """One row per model and dtype: each target of the performance issue, met (yes) or not."""
    header = ["model", "dtype", "decode vs llama.cpp", "% BW limit", "decode vs transformers (≥ 1.25x)",
              "prefill vs llama.cpp (≥ 1.0x)", "load vs transformers (≤ 1.0x)", "RSS / (1.1 x weights + KV) (≤ 1.0)"]

    def mark(value: float | None, target: float, higher: bool = True, fmt: str = "{:.2f}x") -> str:
        if value is None:
            return "-"
        ok = value >= target if higher else value <= target
        return f"{fmt.format(value)} {'yes' if ok else 'no'}"

    rows = []
    tokens = report["settings"]["prompt_tokens"] + report["settings"]["new_tokens"]
    for model, data in report["models"].items():
        for dtype, row in data["dtypes"].items():
            zl = row["engines"].get("zllm", {})
            if "error" in zl or not zl:
                continue
            to_cpp = row["ratios"].get("llama.cpp") or {}
            to_hf = row["ratios"].get("transformers") or {}
            target = SMALL_MODEL_TARGET[1] if model == SMALL_MODEL_TARGET[0] else DECODE_TARGETS[dtype]
            pct = zl.get("bandwidth_pct")
            pct_cell = "-" if pct is None else f"{pct:.0f}%" + (" (≥ 85%: " + ("yes" if pct >= 85 else "no") + ")"
                                                                 if dtype == "f32" else "")
            kv = data.get("kv_cache_bytes") or kv_cache_bytes(Path(data["path"]), tokens)
            budget = 1.1 * row["file"]["weight_bytes"] + kv
            rss = zl.get("peak_rss_growth_bytes")
            rows.append([model, dtype, mark(to_cpp.get("decode_tok_s"), target) + f" (≥ {target}x)", pct_cell,
                         mark(to_hf.get("decode_tok_s"), 1.25), mark(to_cpp.get("prefill_tok_s"), 1.0),
                         mark(to_hf.get("load_s"), 1.0, higher=False),
                         mark(rss / budget if rss is not None else None, 1.0, higher=False, fmt="{:.2f}")])
    return _md(header, rows, right_from=2)


def experts_touched(experts: int, per_token: int, sequences: int) -> float:
    """Expected fraction of the routed experts a decode step of ``sequences`` tokens reads when
    routing is uniform and independent (random routers): ``1 - (1 - k/E)^n``."""
    return 1 - (1 - per_token / experts) ** sequences


def format_moe(report: dict[str, Any]) -> str:
    """Per MoE/MLA model: total vs active weight bytes (what the ``% BW limit`` of its rows
    counts), the experts a batch of 16 touches, and the KV-cache bytes per token beside an
    equivalent cache of K and V per head."""
    header = ["model", "dtype", "weights MiB", "active MiB/token", "experts (top-k of E)",
              "touched by 16 seqs", "KV bytes/token (f16, as run)", "equivalent K+V per head"]
    rows = []
    for model, data in report["models"].items():
        cfg = json.loads((Path(data["path"]) / "config.json").read_text())
        kv, equivalent = kv_bytes_per_token(cfg, elem_bytes=2)  # the runs cache in f16
        for dtype, row in data["dtypes"].items():
            f = row["file"]
            if "experts" not in f:
                continue
            rows.append([model, dtype, f"{f['weight_bytes'] / 2**20:.0f}", f"{f['bytes_per_token'] / 2**20:.0f}",
                         f"{f['experts_per_token']} of {f['experts']}",
                         f"{100 * experts_touched(f['experts'], f['experts_per_token'], 16):.0f}%",
                         f"{kv:,}", "-" if equivalent is None else f"{equivalent:,} ({equivalent / kv:.1f}x)"])
    return _md(header, rows, right_from=2) if rows else ""


# ---------------------------------------------------------------------------- the parts of a run


def add_bandwidth_limits(report: dict[str, Any], bw: dict[str, Any]) -> None:
    """Set each row's ``bandwidth_limit_tok_s`` and each engine's ``bandwidth_pct`` (decode
    tok/s x its bytes per token / the bandwidth for that working set)."""
    for data in report["models"].values():
        for row in data["dtypes"].values():
            limit = limit_bandwidth(bw, row["file"]["bytes_per_token"])
            row["bandwidth_limit_tok_s"] = limit / row["file"]["bytes_per_token"] if limit else None
            for s in row["engines"].values():
                nbytes, tok_s = s.get("bytes_per_token"), s.get("decode_tok_s")
                own = limit_bandwidth(bw, nbytes) if nbytes else None
                s["bandwidth_pct"] = 100 * tok_s * nbytes / own if tok_s and own else None


def run_measurements(args, report: dict[str, Any], peer: dict[str, Any]) -> int:
    failures = 0
    engines = [e for e in ENGINE_ORDER if e in args.engines and (e != "llama.cpp" or peer["kind"])]
    for name in args.models:
        hf_dir = ensure(name)
        info = model_info(hf_dir)
        if args.prompt_tokens + args.new_tokens > info["context_length"]:
            print(f"[bench] {name}: prompt + new tokens exceed its context of {info['context_length']}",
                  file=sys.stderr)
            return failures + 1
        prompt = random_prompt(random.Random(args.seed), args.prompt_tokens, info)
        warmup = random_prompt(random.Random(10_000 + args.seed), args.prompt_tokens, info)
        files: dict[str, dict[str, Any]] = {}
        for dtype in args.dtypes:
            try:
                path, how = ensure_gguf(name, dtype, args.gguf_writer)
            except (ValueError, RuntimeError) as exc:
                print(f"[bench] {name} {dtype}: skipped ({exc})", file=sys.stderr, flush=True)
                continue
            files[dtype] = {"path": str(path), "written_by": how, **bytes_per_token(path)}
        hf_dtypes = {HF_DTYPE[d] for d in files} if "transformers" in engines else set()
        print(f"[bench] {name}: {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, "
              f"{args.threads} threads, dtypes {', '.join(files)}", flush=True)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for rep in range(args.repeats):  # interleaved, so slow drift hits every engine alike
            jobs = [(d, e) for d in files for e in engines if e != "transformers"]
            jobs += [(d, "transformers") for d in sorted(hf_dtypes)]
            for dtype, engine in jobs:
                base = {"engine": engine, "prompt_ids": prompt, "warmup_ids": warmup,
                        "new_tokens": args.new_tokens, "threads": args.threads}
                load = _loadavg()
                if engine == "transformers":
                    res = run_worker({**base, "model_path": str(hf_dir), "dtype": dtype}, args.threads, args.timeout)
                elif engine == "llama.cpp":
                    res = run_llama_cpp(peer, {**base, "model_path": files[dtype]["path"]}, args)
                else:
                    res = run_worker({**base, "model_path": files[dtype]["path"]}, args.threads, args.timeout)
                res["repeat"] = rep
                res["loadavg_before"] = load
                runs.setdefault((dtype, engine), []).append(res)
                label = f"[bench] {name} {dtype} {engine} repeat {rep + 1}/{args.repeats}"
                if "error" in res:
                    failures += 1
                    print(f"{label}: {res['error']}\n{res.get('stderr_tail', '')}", file=sys.stderr, flush=True)
                else:
                    print(f"{label}: prefill {res['prefill_tok_s']:.1f} tok/s, decode {res['decode_tok_s'] or 0:.1f} "
                          f"tok/s, {res['generated_tokens']} tokens", flush=True)
        hf_summ = {d: summarize(runs[(d, "transformers")], None) for d in hf_dtypes}
        dtypes_out = {}
        for dtype, f in files.items():
            hf_dtype = HF_DTYPE[dtype]
            ref_runs = [r for r in runs.get((hf_dtype, "transformers"), []) if "error" not in r]
            ref_ids = ref_runs[0]["token_ids"] if ref_runs and hf_dtype == dtype else None
            engines_out = {e: summarize(runs[(dtype, e)], ref_ids) for e in engines if e != "transformers"}
            if hf_dtype in hf_summ:
                engines_out[f"transformers {hf_dtype}"] = dict(hf_summ[hf_dtype])
            for engine, s in engines_out.items():
                # transformers reads its own dtype's bytes (an F16 or Q8_0 row shows a bf16 / f32 run)
                s["bytes_per_token"] = files.get(hf_dtype, {}).get("bytes_per_token") \
                    if engine.startswith("transformers") else f["bytes_per_token"]
            zl = engines_out.get("zllm")
            rat = {}
            if zl is not None:
                rat["llama.cpp"] = ratios(zl, engines_out.get("llama.cpp"))
                rat["transformers"] = ratios(zl, hf_summ.get(hf_dtype))
            dtypes_out[dtype] = {"file": f, "transformers_dtype": hf_dtype, "engines": engines_out, "ratios": rat,
                                 "runs": {e: runs.get((dtype, e), []) for e in engines if e != "transformers"}}
        report["models"][name] = {"path": str(hf_dir), "description": MODELS[name].description,
                                  "kv_cache_bytes": kv_cache_bytes(hf_dir, args.prompt_tokens + args.new_tokens),
                                  "prompt_seed": args.seed, "prompt_ids": prompt, "dtypes": dtypes_out,
                                  "transformers_runs": {d: runs[(d, "transformers")] for d in hf_dtypes}}
    return failures


def run_batch(args, report: dict[str, Any]) -> int:
    """Aggregate tokens/s of ``args.batch`` concurrent sequences: zllm's continuous batching
    vs transformers' batched generate, on the f32 weights of ``--batch-model``."""
    name = args.batch_model
    hf_dir = ensure(name)
    info = model_info(hf_dir)
    path, _ = ensure_gguf(name, "f32", args.gguf_writer)
    rng = random.Random(args.seed + 1)
    prompts = [random_prompt(rng, args.prompt_tokens, info) for _ in range(max(args.batch))]
    warmup = [random_prompt(random.Random(10_000 + args.seed), args.prompt_tokens, info)] * 2
    engines = [e for e in ("zllm", "transformers") if e in args.engines]
    repeats = min(args.repeats, 3)
    raw: dict[str, dict[str, list]] = {e: {str(c): [] for c in args.batch} for e in engines}
    failures = 0
    for rep in range(repeats):
        for c in args.batch:
            for engine in engines:
                spec = {"mode": "batch", "engine": engine, "prompts": prompts[:c], "warmup_prompts": warmup,
                        "new_tokens": args.new_tokens, "threads": args.threads,
                        "model_path": str(path if engine == "zllm" else hf_dir), "dtype": "f32"}
                res = run_worker(spec, args.threads, args.timeout)
                raw[engine][str(c)].append(res)
                if "error" in res:
                    failures += 1
                    print(f"[bench] batch {engine} x{c}: {res['error']}\n{res.get('stderr_tail', '')}",
                          file=sys.stderr, flush=True)
                else:
                    print(f"[bench] batch {engine} x{c} repeat {rep + 1}/{repeats}: decode "
                          f"{res['decode_tok_s'] or 0:.1f} tok/s, overall {res['tok_s']:.1f} tok/s", flush=True)
    out: dict[str, dict[str, Any]] = {}
    for engine, levels in raw.items():
        out[engine] = {}
        for c, runs in levels.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                out[engine][c] = {"error": runs[0]["error"]}
                continue
            out[engine][c] = {"generated_tokens": ok[0]["generated_tokens"],
                              "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in ok)}
            for key in ("decode_tok_s", "tok_s"):
                vals = [r[key] for r in ok if r.get(key) is not None]
                out[engine][c][key] = statistics.median(vals) if vals else None
                out[engine][c][key + "_range"] = [min(vals), max(vals)] if vals else None
    report["batch"] = {"model": name, "dtype": "f32", "file": str(path), "levels": args.batch, "repeats": repeats,
                       "engines": out, "runs": raw}
    return failures


def run_profiles(args, report: dict[str, Any]) -> int:
    failures = 0
    report["profiles"] = {}
    for name in args.models:
        info = model_info(ensure(name))
        prompt = random_prompt(random.Random(args.seed), args.prompt_tokens, info)
        warmup = random_prompt(random.Random(10_000 + args.seed), args.prompt_tokens, info)
        for dtype in args.dtypes:
            try:
                path, _ = ensure_gguf(name, dtype, args.gguf_writer)
            except (ValueError, RuntimeError) as exc:
                print(f"[bench] profile {name} {dtype}: skipped ({exc})", file=sys.stderr)
                continue
            out = args.out.parent / "profile" / f"{name}-{dtype}"
            spec = {"mode": "profile", "engine": "zllm", "model_path": str(path), "prompt_ids": prompt,
                    "warmup_ids": warmup, "new_tokens": args.new_tokens, "threads": args.threads, "out": str(out)}
            res = run_worker(spec, args.threads, args.timeout)
            report["profiles"][f"{name}/{dtype}"] = res
            if "error" in res:
                failures += 1
                print(f"[bench] profile {name} {dtype}: {res['error']}\n{res.get('stderr_tail', '')}", file=sys.stderr)
                continue
            res["out"] = str(out)
            print(format_profile(f"{name} {dtype}", res))
    return failures


def format_profile(title: str, res: dict[str, Any]) -> str:
    wall = res["wall"]["median_ms"]
    lines = [f"profile {title}: median ms per decode step over {res['wall']['decode_steps']} steps "
             f"(written to {res['out']}.txt/.json/.trace.json)"]
    order = ["interval", "step", "execute", "forward", "forward python", "runtime python", "sample", "accept",
             "schedule"]
    order += sorted((k for k in wall if k.startswith("op.")), key=lambda k: -wall[k])
    lines.append("  " + ", ".join(f"{k} {wall[k]:.3f}" for k in order if k in wall))
    top = [r for r in res["torch_profile_top"] if not r["name"].startswith(("op.", "forward", "execute", "step",
                                                                             "sample", "accept", "schedule"))]
    lines.append("  top aten ops by self CPU time in one decode round (torch.profiler): " + ", ".join(
        f"{r['name']} {r['self_cpu_us'] / 1000:.3f} ms x{r['calls']}" for r in top[:6]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        settings = report["settings"]
        args.prompt_tokens, args.new_tokens = settings["prompt_tokens"], settings["new_tokens"]
        args.threads, args.repeats, args.engines = settings["threads"], settings["repeats"], settings["engines"]
        print(render(report, args))
        return 0
    report: dict[str, Any] = {
        "settings": {"models": args.models, "dtypes": args.dtypes, "engines": args.engines,
                     "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "threads": args.threads, "seed": args.seed, "batch": args.batch},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "cpu_model": _cpu_model(), "loadavg_start": _loadavg()},
        "models": {},
    }
    started = time.time()
    failures = 0
    if args.profile_only:
        failures += run_profiles(args, report)
    else:
        peer = resolve_llama_cpp(args.llama_cpp) if "llama.cpp" in args.engines else {"kind": None, "why": "off"}
        report["llama_cpp"] = peer
        if "llama.cpp" in args.engines:
            print(f"[bench] {describe_peer(peer)}", flush=True)
        # Measured before and after the engines, the best of both bounds the rates.
        first_bw = measure_bandwidth(args.threads, args.timeout)
        print("[bench] " + format_bandwidth(first_bw), flush=True)
        failures += run_measurements(args, report, peer)
        bw = best_bandwidth(first_bw, measure_bandwidth(args.threads, args.timeout))
        report["bandwidth"] = bw
        print("[bench] " + format_bandwidth(bw) + " (best of the measurements before and after)", flush=True)
        add_bandwidth_limits(report, bw)
        if args.batch:
            failures += run_batch(args, report)
        if args.profile:
            failures += run_profiles(args, report)
    report["elapsed_s"] = time.time() - started
    report["machine"]["loadavg_end"] = _loadavg()

    text = render(report, args)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    for path in {args.out.with_suffix(".json"), *([args.json] if args.json else [])}:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[bench] wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}"
          + (f" and {args.json}" if args.json else "") + f" ({report['elapsed_s'] / 60:.1f} min)")
    return 1 if failures else 0


def render(report: dict[str, Any], args) -> str:
    """The Markdown report: settings, machine, bandwidth, the tables, and load warnings."""
    m = report["machine"]
    parts = [f"# zllm CPU benchmark\n\n{args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens (greedy, "
             f"batch 1), {args.threads} threads, median of {args.repeats} (decode: min–max), "
             f"{m['cpu_model']} ({m['cpus']} CPUs)."]
    if "bandwidth" in report:
        parts.append(format_bandwidth(report["bandwidth"]) + ".")
    peer = report.get("llama_cpp")
    if peer is not None and "llama.cpp" in args.engines:
        parts.append(describe_peer(peer) + ".")
    if report["models"]:
        parts.append("## Batch-1 generation\n\n" + format_table(report))
        parts.append("Ratios: tok/s > 1 means zllm is faster; TTFT, load and RSS < 1 mean zllm is better. "
                     "`% BW limit`: decode tok/s x weight bytes read per token / memory bandwidth. "
                     "`= ref`: leading tokens equal to transformers' output in the same dtype.")
        parts.append("## Targets\n\n" + format_targets(report))
        moe = format_moe(report)
        if moe:
            parts.append("## MoE and MLA models\n\n" + moe + "\n\nA batch-1 decode step reads only the "
                         "selected experts: `active MiB/token` counts k/E of every expert stack, and the "
                         "rows' `% BW limit` uses it.")
    if "batch" in report:
        b = report["batch"]
        parts.append(f"## Batched throughput ({b['model']} {b['dtype']}, median of {b['repeats']})\n\n"
                     + format_batch_table(b))
    profiles = {k: v for k, v in report.get("profiles", {}).items() if "error" not in v}
    if profiles:
        parts.append("## Profiles (zllm, one decode step)\n\n" + "\n\n".join(
            format_profile(k, v) for k, v in profiles.items()))
    load = m.get("loadavg_start")
    if load is not None and load >= 1.0:
        parts.append(f"Warning: the 1-minute load average was {load:.1f} on {m['cpus']} CPUs when the run "
                     "started: other work shared the CPUs, so timings are noisy; compare ratios within this run.")
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
