"""Load run of ``bench/serve.py --load-s SECONDS``: C closed-loop clients for a bounded time.

Each client loops until the time is up over all four POST routes (streaming), and mixes in
client disconnects after the first event (``--disconnect-frac``) and malformed bodies
(``--malformed-frac``). Meanwhile the server's RSS is sampled from ``/proc/<pid>/status``.
After the load it waits (bounded) for the batch to drain and reads the KV gauges from
``/metrics``. The report says whether the load was held — no 5xx, no transport error, every
malformed body a 4xx, no KV block left to a running sequence, the server still healthy —
with status counts, requests/s and TTFT percentiles. Nothing here asserts on timings.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# A ChatML-like template for checkpoints without one (the chat routes need a template).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MALFORMED = [b"{", b'{"prompt": ' + b"[" * 5000, b'{"max_tokens": "many"}', b"\xc3\x28", b"[]", b'{"model": 1}']
PROMPTS = ["Once upon a time", "The little dog", "Lily found a red ball", "One day the sun", "Tom and his cat"]
DRAIN_BOUND_S = 60.0


def with_chat_template(model_dir: Path, workdir: Path) -> Path:
    """``model_dir`` itself when its tokenizer_config has a chat template; else a folder of
    links to its files with a tokenizer_config that adds :data:`CHAT_TEMPLATE`."""
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if cfg.get("chat_template"):
        return model_dir
    dst = workdir / model_dir.name
    dst.mkdir()
    for f in model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f.resolve())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    return dst


def request_body(route: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    if route == "/v1/completions":
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if route == "/v1/chat/completions":
        return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if route == "/v1/responses":
        return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": True, "ignore_eos": True}
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}


def is_content(route: str, event: dict[str, Any]) -> bool:
    """Whether a streamed event carries generated text (the first one stops the TTFT clock)."""
    if route == "/v1/completions":
        return bool(event.get("choices"))
    if route == "/v1/chat/completions":
        return bool(event.get("choices")) and event["choices"][0].get("delta", {}).get("content") is not None \
            and "role" not in event["choices"][0]["delta"]
    if route == "/v1/responses":
        return event.get("type") == "response.output_text.delta"
    return event.get("type") == "content_block_delta"


def stream_error(event: dict[str, Any]) -> str | None:
    """The code of an error event (any protocol's shape), else None."""
    if event.get("type") == "error":
        err = event.get("error", event)
        return str(err.get("code") or err.get("type"))
    if isinstance(event.get("error"), dict):
        return str(event["error"].get("code"))
    return None


async def one(client, url: str, route: str, body: dict[str, Any], disconnect: bool) -> dict[str, Any]:
    sent = time.perf_counter()
    out: dict[str, Any] = {"route": route, "sent": sent, "ttft_s": None}
    try:
        async with client.stream("POST", url + route, json=body) as r:
            out["status"] = str(r.status_code)
            if r.status_code != 200:
                out["body"] = (await r.aread()).decode(errors="replace")[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if (code := stream_error(event)) is not None:
                    out["status"] = f"200+error:{code}"
                if out["ttft_s"] is None and is_content(route, event):
                    out["ttft_s"] = time.perf_counter() - sent
                    if disconnect:
                        out["status"] = "disconnected"
                        return out
    except Exception as exc:  # noqa: BLE001 - every transport failure is a finding of the run
        out["status"] = f"transport:{type(exc).__name__}"
    return out


async def malformed(client, url: str, route: str, content: bytes) -> dict[str, Any]:
    try:
        r = await client.post(url + route, content=content, headers={"content-type": "application/json"})
        status = str(r.status_code)
    except Exception as exc:  # noqa: BLE001
        status = f"transport:{type(exc).__name__}"
    return {"route": route, "status": f"malformed:{status}", "ttft_s": None}


async def clients(url: str, model: str, args, end: float) -> list[dict[str, Any]]:
    import httpx

    limits = httpx.Limits(max_connections=args.load_concurrency, max_keepalive_connections=args.load_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        async def worker(i: int) -> list[dict[str, Any]]:
            rng = random.Random(args.seed * 1000 + i)
            done = []
            while time.perf_counter() < end:
                route = rng.choice(ROUTES)
                if rng.random() < args.malformed_frac:
                    done.append(await malformed(client, url, route, rng.choice(MALFORMED)))
                    continue
                body = request_body(route, model, rng.choice(PROMPTS), args.max_tokens)
                done.append(await one(client, url, route, body, rng.random() < args.disconnect_frac))
            return done

        per_worker = await asyncio.gather(*(worker(i) for i in range(args.load_concurrency)))
    return [r for results in per_worker for r in results]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def sample_rss(pid: int, start: float, end: float, interval_s: float) -> list[tuple[float, float]]:
    samples = []
    while time.perf_counter() < end:
        mib = rss_mib(pid)
        if mib is not None:
            samples.append((round(time.perf_counter() - start, 2), round(mib, 1)))
        await asyncio.sleep(interval_s)
    return samples


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` samples as ``{'name{labels}': value}``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


KV_GAUGES = ("zllm_kv_blocks_free", "zllm_kv_blocks_used", "zllm_kv_blocks_running", "zllm_num_requests_running",
             "zllm_num_requests_waiting")


def drained(url: str) -> dict[str, float]:
    """The gauges once nothing runs or waits (or after :data:`DRAIN_BOUND_S`)."""
    deadline = time.perf_counter() + DRAIN_BOUND_S
    while True:
        m = scrape(url)
        if (m["zllm_num_requests_running"] == 0 and m["zllm_num_requests_waiting"] == 0) \
                or time.perf_counter() > deadline:
            return m
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_load(server, model: str, args) -> dict[str, Any]:
    """Drive ``server`` (a ``ServerProcess``, healthy) for ``args.load_s`` seconds; the report."""
    import httpx

    idle = scrape(server.url)
    start = time.perf_counter()
    end = start + args.load_s

    async def both():
        return await asyncio.gather(clients(server.url, model, args, end),
                                    sample_rss(server.proc.pid, start, end, args.rss_interval_s))

    results, rss = asyncio.run(both())
    wall_s = time.perf_counter() - start
    after = drained(server.url)
    healthy = httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    statuses = Counter(r["status"] for r in results)
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    bad = {s: n for s, n in statuses.items()
           if s.startswith("transport:") or s[:1] == "5" or s.startswith("malformed:5")
           or (s.startswith("malformed:") and not s.startswith("malformed:4"))}
    kv_leak = after["zllm_kv_blocks_running"] != 0 or after["zllm_kv_blocks_free"] < idle["zllm_kv_blocks_free"]
    return {
        "load_s": args.load_s, "wall_s": wall_s, "concurrency": args.load_concurrency,
        "requests": len(results), "requests_per_s": len(results) / wall_s,
        "statuses": dict(sorted(statuses.items())),
        "by_route": {route: dict(Counter(r["status"] for r in results if r["route"] == route)) for route in ROUTES},
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
        "examples": {r["status"]: r["body"] for r in results if "body" in r},
        "rss_mib": rss,
        "kv_idle": {k: idle[k] for k in KV_GAUGES}, "kv_after": {k: after[k] for k in KV_GAUGES},
        "expired": {k: v for k, v in after.items() if k.startswith("zllm_requests_expired_total")},
        "held": not bad and not kv_leak and healthy, "failures": bad, "kv_leak": kv_leak, "healthy_after": healthy,
    }


def format_load(report: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    rss = [m for _, m in report["rss_mib"]]
    lines = [
        f"load: {report['concurrency']} clients for {report['wall_s']:.1f} s, {report['requests']} requests "
        f"({report['requests_per_s']:.1f}/s) — {'HELD' if report['held'] else 'NOT HELD'}",
        "statuses: " + ", ".join(f"{s} {n}" for s, n in report["statuses"].items()),
        f"TTFT p50 {ms(report['ttft_p50_s'])}, p90 {ms(report['ttft_p90_s'])}, p99 {ms(report['ttft_p99_s'])}",
        (f"server RSS: {rss[0]:.0f} MiB at start, {max(rss):.0f} MiB max, {rss[-1]:.0f} MiB at the end "
         f"({len(rss)} samples)") if rss else "server RSS: not sampled",
        "KV after the load: " + ", ".join(f"{k.removeprefix('zllm_')} {v:g}" for k, v in report["kv_after"].items())
        + f" (idle free: {report['kv_idle']['zllm_kv_blocks_free']:g})",
    ]
    if report["failures"]:
        lines.append(f"failures: {report['failures']}")
    if report["kv_leak"]:
        lines.append("KV blocks were not all returned after the load")
    return "\n".join(lines)
