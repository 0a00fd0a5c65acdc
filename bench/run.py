"""zllm side by side with HF transformers: ``.venv/bin/python bench/run.py`` (``make bench``).

For every model, every engine and every repeat, one subprocess (``bench/worker.py``) loads
the model and measures prefill tokens/s, decode tokens/s at batch 1, time to first token
and peak-RSS growth; this script picks the prompt, runs the workers, prints a table of
medians with zllm/transformers ratios and optionally writes everything as JSON.
See ``bench/README.md`` for what each number means. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
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

from models import MODELS, ensure, model_info  # noqa: E402
from worker import RESULT_PREFIX  # noqa: E402  (stdlib-only at import time)

#: The engine every other engine is compared with (the ratio rows are ENGINE/REFERENCE).
REFERENCE = "transformers"
ENGINE_ORDER = ("zllm", "transformers")
#: Prompts tried (seed, seed+1, ...) until transformers' greedy output has no EOS.
PROBE_CANDIDATES = 8

METRICS = (  # key in a worker result, column title, format, scale
    ("prefill_tok_s", "prefill tok/s", "{:.1f}", 1.0),
    ("decode_tok_s", "decode tok/s", "{:.1f}", 1.0),
    ("ttft_s", "TTFT ms", "{:.1f}", 1000.0),
    ("peak_rss_growth_bytes", "peak RSS +MiB", "{:.1f}", 1.0 / (1 << 20)),
    ("load_s", "load s", "{:.2f}", 1.0),
)


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="stories260k,llama-110m",
                   help=f"comma-separated; known: {', '.join(MODELS)}")
    p.add_argument("--engines", default=",".join(ENGINE_ORDER), help="comma-separated engines")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (random token ids)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to generate (no early stop)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per engine and model; medians")
    p.add_argument("--threads", type=int, default=default_threads(), help="CPU threads for every engine")
    p.add_argument("--seed", type=int, default=0, help="first seed for the random prompt")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker process")
    p.add_argument("--json", metavar="OUT", type=Path, help="write all results (raw and medians) here")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    for e in args.engines:
        if e not in ENGINE_ORDER:
            p.error(f"unknown engine {e!r}; known: {', '.join(ENGINE_ORDER)}")
    for name in ("prompt_tokens", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode speed needs a token after the first)")
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


def pick_prompt(model_dir: Path, info: dict[str, Any], args) -> tuple[list[int], dict[str, Any]]:
    """A prompt whose greedy continuation (per transformers) runs ``--new-tokens`` without EOS,
    so no engine stops early. Falls back to the longest-running candidate (reported)."""
    candidates = [random_prompt(random.Random(args.seed + i), args.prompt_tokens, info)
                  for i in range(PROBE_CANDIDATES)]
    if not info["eos_token_ids"]:
        return candidates[0], {"seed": args.seed, "eos_free_tokens": args.new_tokens}
    spec = {"mode": "probe", "model_dir": str(model_dir), "candidates": candidates,
            "new_tokens": args.new_tokens, "threads": args.threads}
    res = run_worker(spec, args.threads, args.timeout)
    if "error" in res:
        print(f"[bench] prompt probe failed ({res['error']}); using seed {args.seed}", flush=True)
        return candidates[0], {"seed": args.seed, "probe_error": res["error"]}
    lengths = res["lengths"]
    best = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
    if lengths[best] < args.new_tokens:
        print(f"[bench] warning: every probed prompt hits EOS early; best runs {lengths[best]} tokens",
              flush=True)
    return candidates[best], {"seed": args.seed + best, "eos_free_tokens": lengths[best]}


# ---------------------------------------------------------------------------- aggregation


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict[str, Any]], reference_ids: list[int] | None) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"ok_runs": len(ok), "failed_runs": len(runs) - len(ok)}
    if not ok:
        out["error"] = runs[0].get("error") if runs else "no runs"
        return out
    for key, *_ in METRICS:
        vals = [r[key] for r in ok if r.get(key) is not None]
        out[key] = median(vals)
        out[key + "_range"] = [min(vals), max(vals)] if vals else None  # spread over repeats
    out["generated_tokens"] = min(r["generated_tokens"] for r in ok)
    out["finish_reasons"] = sorted({str(r["finish_reason"]) for r in ok})
    if reference_ids is not None:
        ids = ok[0]["token_ids"]
        same = 0
        for a, b in zip(ids, reference_ids):
            if a != b:
                break
            same += 1
        out["tokens_matching_reference"] = same
    out["versions"] = ok[0].get("versions", {})
    out["peak_reset"] = all(r.get("peak_reset") for r in ok)
    return out


def ratios(summary: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    res = {}
    for key, *_ in METRICS:
        a, b = summary.get(key), ref.get(key)
        res[key] = a / b if a is not None and b not in (None, 0) else None
    return res


# ---------------------------------------------------------------------------- table


def format_table(report: dict[str, Any]) -> str:
    header = ["model", "engine", *[m[1] for m in METRICS], "tokens", "= ref"]
    rows = []
    for model, data in report["models"].items():
        for engine, s in data["engines"].items():
            if "error" in s:
                rows.append([model, engine, "ERROR: " + str(s["error"])] + [""] * (len(header) - 3))
                continue
            cells = [model, engine]
            for key, _, fmt, scale in METRICS:
                v = s.get(key)
                cells.append("-" if v is None else fmt.format(v * scale))
            cells.append(str(s["generated_tokens"]))
            m = s.get("tokens_matching_reference")
            cells.append("ref" if engine == REFERENCE else ("-" if m is None else f"{m}/{s['generated_tokens']}"))
            rows.append(cells)
        for engine, r in data["ratios"].items():
            cells = [model, f"{engine}/{REFERENCE}"]
            cells += ["-" if r[key] is None else f"{r[key]:.2f}x" for key, *_ in METRICS]
            rows.append(cells + ["", ""])
    widths = [max(len(str(row[i])) for row in [header, *rows] if i < len(row)) for i in range(len(header))]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i >= 2 else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------- main


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e for e in ENGINE_ORDER if e in args.engines]
    report: dict[str, Any] = {
        "settings": {"models": args.models, "engines": engines, "prompt_tokens": args.prompt_tokens,
                     "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
                     "seed": args.seed},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "processor": platform.processor()},
        "models": {},
    }
    started = time.time()
    report["machine"]["loadavg_start"] = _loadavg()
    failures = 0
    for name in args.models:
        model_dir = ensure(name)
        info = model_info(model_dir)
        if args.prompt_tokens + args.new_tokens > info["context_length"]:
            print(f"[bench] {name}: prompt + new tokens exceed its context of {info['context_length']}",
                  file=sys.stderr)
            return 2
        prompt, prompt_info = pick_prompt(model_dir, info, args)
        warmup = random_prompt(random.Random(10_000 + args.seed), args.prompt_tokens, info)
        print(f"[bench] {name}: prompt seed {prompt_info.get('seed')}, {args.prompt_tokens} prompt tokens, "
              f"{args.new_tokens} new tokens, {args.threads} threads", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        for rep in range(args.repeats):  # interleaved, so slow drift hits every engine alike
            for engine in engines:
                spec = {"engine": engine, "model_dir": str(model_dir), "prompt_ids": prompt,
                        "warmup_ids": warmup, "new_tokens": args.new_tokens, "threads": args.threads}
                res = run_worker(spec, args.threads, args.timeout)
                res["repeat"] = rep
                runs[engine].append(res)
                if "error" in res:
                    failures += 1
                    print(f"[bench] {name} {engine} repeat {rep + 1}: {res['error']}\n{res.get('stderr_tail', '')}",
                          file=sys.stderr, flush=True)
                else:
                    print(f"[bench] {name} {engine} repeat {rep + 1}/{args.repeats}: "
                          f"prefill {res['prefill_tok_s']:.1f} tok/s, decode {res['decode_tok_s'] or 0:.1f} tok/s, "
                          f"{res['generated_tokens']} tokens", flush=True)
        ref_ok = [r for r in runs.get(REFERENCE, []) if "error" not in r]
        ref_ids = ref_ok[0]["token_ids"] if ref_ok else None
        summaries = {e: summarize(runs[e], ref_ids if e != REFERENCE else None) for e in engines}
        rat = {}
        if REFERENCE in summaries and "error" not in summaries[REFERENCE]:
            rat = {e: ratios(s, summaries[REFERENCE]) for e, s in summaries.items()
                   if e != REFERENCE and "error" not in s}
        report["models"][name] = {"path": str(model_dir), "description": MODELS[name].description,
                                  "prompt": prompt_info, "prompt_ids": prompt, "engines": summaries,
                                  "ratios": rat, "runs": runs}
    report["elapsed_s"] = time.time() - started
    report["machine"]["loadavg_end"] = _loadavg()

    print()
    print(f"zllm vs {REFERENCE}: {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens (greedy, batch 1), "
          f"{args.threads} threads, median of {args.repeats}")
    print(format_table(report))
    load_start = report["machine"]["loadavg_start"]
    if load_start is not None and load_start >= 1.0:
        print(f"[bench] warning: the 1-minute load average was {load_start:.1f} on {os.cpu_count()} CPUs "
              "before the benchmark started: other work shares the CPUs, timings are noisy")
    print("ratios: tok/s > 1 means zllm is faster; TTFT, RSS and load < 1 mean zllm is better. "
          "'= ref': leading tokens equal to transformers' output.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench] wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
