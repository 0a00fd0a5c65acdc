"""Tensor and pipeline parallelism on one machine: what the collectives cost.

``.venv/bin/python bench/parallel.py`` (``make bench-parallel``). In process, one
``zllm.Engine`` per row (the other ranks spawned by it, gloo on 127.0.0.1), greedy, random
prompt ids, every request generating exactly ``--new-tokens``:

- **TP** rows, batch 1: ``parallel.tensor`` 1 (``--threads`` threads) against 2 (one thread per
  rank, the same cores). Besides decode tokens/s, the time rank 0 spends inside collectives per
  decode step (``all_reduce`` after O and down in every layer, the embedding's ``all_reduce``,
  the logits' ``all_gather`` and the step's two metadata ``broadcast``\\ s) and that time's share of
  the step: transfer plus waiting for the other rank, timed around torch.distributed's calls.
- **comm** row: the same collectives of one batch-1 decode step (shapes from the model's config)
  run back to back between two processes that are both ready, with no model around them: the
  pure communication cost of a step, and its share of the TP = 2 step. Rank 0's time inside
  collectives in the TP = 2 row is larger: it also waits there for the other rank to finish its
  half of the work.
- **PP** rows, ``--batch`` concurrent sequences: ``parallel.pipeline`` 1 against 2 (decode rounds
  split into micro-batches so the stages overlap): tokens/s over all sequences.

No gain is expected on a 2-core CPU (each rank gets half the cores it would have alone); the
point is the communication overhead. Wall-clock timings, medians of ``--repeats``; nothing
asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from models import ensure, model_info  # noqa: E402
from run import default_threads, random_prompt  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "broadcast")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-0.5b", help="a bench/models.py model (default llama-0.5b)")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="concurrent sequences of the PP rows")
    p.add_argument("--threads", type=int, default=default_threads(), help="cores in all (TP/PP 1 takes them all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    return p.parse_args(argv)


class CollectiveClock:
    """Seconds and calls spent in torch.distributed's collectives by this process (rank 0),
    timed by wrapping them; the model calls them through the module at call time."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds, self.calls = 0.0, 0
        self._lock = threading.Lock()
        for name in COLLECTIVES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1

        return timed

    def read(self) -> tuple[float, int]:
        with self._lock:
            return self.seconds, self.calls


def config(path: Path, threads: int, tensor: int = 1, pipeline: int = 1, seqs: int = 1) -> dict[str, Any]:
    return {"schema_version": 1, "model": {"path": str(path)},
            "backend": {"name": "cpu", "threads": max(1, threads // (tensor * pipeline))},
            "parallel": {"tensor": tensor, "pipeline": pipeline, "timeout_s": 600},
            "runtime": {"max_num_seqs": max(seqs, 1), "kv_cache": {"num_blocks": 64 * max(seqs, 1)},
                        "prefix_cache_seqs": 0}}


def decode_row(engine, prompt: list[int], new_tokens: int, clock: CollectiveClock | None) -> dict[str, float]:
    """Batch 1: decode tokens/s (after the first token), step ms, and collective ms and calls per
    step. The collectives are counted over the whole request, prefill included (every step makes
    the same calls), from before it is submitted to after its last token: the engine's thread
    starts the next step before this one sees a token, so a count read at the first token
    would miss the calls that step already made. ``collective_share`` is their time over the
    request's wall time (submission to end of stream), the window they were counted in: the
    decode step time comes from token arrivals, which a consumer of buffered streams can see
    bunched together."""
    req = {"prompt_token_ids": prompt, "max_tokens": new_tokens, "ignore_eos": True}
    first = last = 0.0
    at_start = clock.read() if clock else (0.0, 0)
    start = time.perf_counter()
    n = 0
    for event in engine.generate_stream(req):
        got = len(event.get("token_ids", []))
        if got and n == 0:
            first = time.perf_counter()
        n += got
        if got:
            last = time.perf_counter()
    steps = n - 1
    step_s = (last - first) / steps
    row = {"decode_tok_s": steps / (last - first), "step_ms": 1e3 * step_s}
    if clock is not None:
        end = time.perf_counter()
        seconds, calls = clock.read()
        row |= {"collective_ms_per_step": 1e3 * (seconds - at_start[0]) / n,
                "collectives_per_step": (calls - at_start[1]) / n,
                "collective_share": (seconds - at_start[0]) / (end - start)}
    return row


def batch_row(engine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """``len(prompts)`` concurrent sequences: generated tokens/s over the whole run."""
    done: list[int] = [0] * len(prompts)

    def drive(i: int) -> None:
        out = engine.generate({"prompt_token_ids": prompts[i], "max_tokens": new_tokens, "ignore_eos": True})
        done[i] = len(out["token_ids"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"tok_s": sum(done) / (time.perf_counter() - t0)}


def _comm_worker(rank: int, port: int, hidden: int, vocab: int, layers: int, steps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    header, payload = torch.zeros(4, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    x, logits = torch.zeros(1, hidden), torch.zeros(1, -(-vocab // 2))
    parts = [torch.empty_like(logits) for _ in range(2)]

    def step() -> None:
        dist.broadcast(header, src=0)
        dist.broadcast(payload, src=0)
        for _ in range(1 + 2 * layers):  # the embedding's all-reduce, then O and down of every layer
            dist.all_reduce(x)
        dist.all_gather(parts, logits)

    for _ in range(5):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if rank == 0:
        out.put((time.perf_counter() - t0) / steps)
    dist.destroy_process_group()


def comm_row(info: dict[str, Any], config_json: dict[str, Any], steps: int = 200) -> dict[str, float]:
    """ms per decode step of the collectives alone, two processes over gloo on 127.0.0.1."""
    import multiprocessing

    from zllm.engine.distributed import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    args = (port, config_json["hidden_size"], info["vocab_size"], config_json["num_hidden_layers"], steps, out)
    procs = [ctx.Process(target=_comm_worker, args=(rank, *args)) for rank in range(2)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=600)
    for p in procs:
        p.join()
    return {"comm_ms_per_step": 1e3 * seconds, "collectives_per_step": 2 + 1 + 2 * config_json["num_hidden_layers"] + 1}


def median_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the spawned ranks: backend.threads sets torch's own
    import zllm

    path = ensure(args.model)
    info = model_info(path)
    rng = random.Random(0)
    prompt = random_prompt(rng, args.prompt_tokens, info)
    prompts = [random_prompt(rng, args.prompt_tokens, info) for _ in range(args.batch)]
    clock = CollectiveClock()
    results: list[dict[str, Any]] = []
    for name, tensor in (("TP=1", 1), ("TP=2", 2)):
        with zllm.Engine.from_config(config(path, args.threads, tensor=tensor)) as engine:
            decode_row(engine, prompt, 4, None)  # warm up
            row = median_rows([decode_row(engine, prompt, args.new_tokens, clock if tensor > 1 else None)
                               for _ in range(args.repeats)])
        results.append({"row": name, "batch": 1, **row})
        print(json.dumps(results[-1]), flush=True)
    comm = comm_row(info, json.loads((path / "config.json").read_text()))
    tp2 = next(r for r in results if r["row"] == "TP=2")
    results.append({"row": "comm", "batch": 1, **comm, "share_of_tp2_step": comm["comm_ms_per_step"] / tp2["step_ms"]})
    print(json.dumps(results[-1]), flush=True)
    for name, pipeline in (("PP=1", 1), ("PP=2", 2)):
        with zllm.Engine.from_config(config(path, args.threads, pipeline=pipeline, seqs=args.batch)) as engine:
            batch_row(engine, prompts, 4)  # warm up
            row = median_rows([batch_row(engine, prompts, args.new_tokens) for _ in range(args.repeats)])
        results.append({"row": name, "batch": args.batch, **row})
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{args.model}, {args.threads} cores, {args.new_tokens} new tokens after {args.prompt_tokens}")
    for r in results:
        if r["row"] == "comm":
            print(f"  comm only: {r['comm_ms_per_step']:.2f} ms/step ({r['collectives_per_step']} collectives), "
                  f"{100 * r['share_of_tp2_step']:.1f}% of the TP=2 step")
            continue
        extra = (f", rank 0 in collectives {r['collective_ms_per_step']:.2f} ms/step "
                 f"({r['collectives_per_step']:.0f} calls, {100 * r['collective_share']:.0f}% of the request's time, "
                 f"waiting included)" if "collective_ms_per_step" in r else "")
        speed = (f"{r['decode_tok_s']:.2f} decode tok/s, {r['step_ms']:.1f} ms/step" if "decode_tok_s" in r
                 else f"{r['tok_s']:.2f} tok/s")
        print(f"  {r['row']} batch {r['batch']}: {speed}{extra}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
