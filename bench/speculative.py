"""Speculative decoding benchmark: decode tokens/s with speculation vs without, in one run.

``.venv/bin/python bench/speculative.py`` (``make bench-speculative``). In process, one
``zllm.Engine`` per row, on the benchmark models of ``bench/models.py``, greedy, every
request generating exactly ``--new-tokens`` after ``--prompt-tokens`` random ids, batch 1
and ``--batch`` concurrent sequences:

- **Verify-overhead bound** (``replay`` rows): a zero-cost proposer replays the known
  greedy continuation (from the run without speculation), each proposed token replaced by
  a wrong one with probability ``1 - acceptance`` — so the ratio to the plain run is what
  verification itself costs and saves. Batch-invariant kernels on both sides, so the
  continuation replayed is exactly what the model computes (``runtime.batch_invariant``;
  the plain baseline runs in the same mode).
- **Always wrong** (``wrong`` rows): acceptance 0, with adaptive K (speculation falls to an
  occasional probe) and with a fixed K per K: the cost of verification that never pays.
- **n-gram on stories260K** (``ngram`` rows): prompt lookup on the one trained model, on a
  prompt that already holds the story it will continue (input-repetitive, as summarising or
  editing a document is).

Decode tok/s is the tokens delivered after every sequence had its first one, over that
time; medians of ``--repeats``. Wall-clock timings; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from models import ensure, ensure_gguf, model_info  # noqa: E402
from run import default_threads, random_prompt  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama-110m", help="benchmark model of the replay and wrong rows")
    p.add_argument("--dtypes", default="f32,q8_0", help="weights: f32 (HF safetensors) and/or GGUF dtypes")
    p.add_argument("--batch", type=int, default=8, help="concurrent sequences of the batched rows (1 always runs)")
    p.add_argument("--k", type=int, default=4, help="proposed tokens per step (K) of the replay rows")
    p.add_argument("--acceptance", default="1.0,0.8,0.5", help="replay acceptance rates")
    p.add_argument("--wrong-k", default="1,2,4,8", help="fixed K values of the always-wrong rows")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels on both sides (exact replays; slower steps)")
    p.add_argument("--json", metavar="OUT", type=Path, help="write settings and every measurement here")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.acceptance = [float(a) for a in args.acceptance.split(",") if a.strip()]
    args.wrong_k = [int(k) for k in args.wrong_k.split(",") if k.strip()]
    return args


class ReplayProposer:
    """Proposes the known continuation of each prompt; each token wrong with probability
    ``1 - acceptance`` (seeded by prompt and position, so every run proposes the same)."""

    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], acceptance: float, vocab: int):
        self.continuations, self.acceptance, self.vocab = continuations, acceptance, vocab

    def propose(self, seqs, ks):
        from zllm.runtime.speculative import Proposal

        out = []
        for seq, k in zip(seqs, ks, strict=True):
            known = self.continuations[tuple(seq.prompt_ids)]
            at = len(seq.output_ids)
            rng = random.Random(hash((tuple(seq.prompt_ids), at)))
            out.append(Proposal([t if rng.random() < self.acceptance else (t + 1 + rng.randrange(self.vocab - 1))
                                 % self.vocab for t in known[at: at + k]]))
        return out

    def release(self, seq) -> None:
        """Nothing is kept per sequence."""


def engine_config(path: Path, args, spec: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model": {"path": str(path)}, "backend": {"name": "cpu", "threads": args.threads},
                           "runtime": {"batch_invariant": args.batch_invariant, "max_num_seqs": 16}}
    if spec is not None:
        cfg["speculative"] = spec
    return cfg


def decode(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s of all ``prompts`` at once (one thread per request), and their tokens."""
    stamps: list[tuple[float, int]] = []
    first: dict[int, float] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    lock = threading.Lock()

    def run(i: int) -> None:
        req = {"prompt_token_ids": prompts[i], "max_tokens": new_tokens, "ignore_eos": True, "temperature": 0.0}
        for event in engine.generate_stream(req):
            if event["type"] == "delta" and event["token_ids"]:
                now = time.perf_counter()
                with lock:
                    first.setdefault(i, now)
                    stamps.append((now, len(event["token_ids"])))
                    tokens[i] += event["token_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(first.values())
    end = max(t for t, _ in stamps)
    decoded = sum(n for t, n in stamps if t > start)
    return (decoded / (end - start) if end > start else 0.0), tokens


def measure(path: Path, args, prompts: list[list[int]], spec: dict[str, Any] | None,
            proposer_factory=None) -> dict[str, Any]:
    import zllm

    with zllm.Engine.from_config(engine_config(path, args, spec)) as engine:
        if proposer_factory is not None:
            proposer = proposer_factory(engine)
            engine.loop.call(lambda llm: setattr(llm, "proposer", proposer))
        decode(engine, prompts[:1], 8)  # warm-up
        engine.loop.call(lambda llm: setattr(llm, "spec_stats", type(llm.spec_stats)()))
        runs = [decode(engine, prompts, args.new_tokens) for _ in range(args.repeats)]
        rate = engine.loop.call(lambda llm: llm.spec_stats.acceptance_rate)
    return {"tok_s": statistics.median(r for r, _ in runs), "runs": [r for r, _ in runs],
            "tokens": runs[0][1], "acceptance": rate}


def weights(name: str, dtype: str) -> Path:
    return ensure(name) if dtype == "f32" else ensure_gguf(name, dtype)[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        base = next((r for r in reversed(rows) if r["model"] == row["model"] and r["batch"] == row["batch"]
                     and r["method"] == "none"), row)
        acc = "-" if row.get("acceptance") is None else f"{row['acceptance']:.2f}"
        print(f"| {row['model']} | {row['batch']} | {row['method']} | {row['setting']} | {acc} | "
              f"{row['tok_s']:.1f} | {row['tok_s'] / base['tok_s']:.2f}x |", flush=True)

    print("| model | batch | method | setting | acceptance | decode tok/s | vs none |")
    print("|---|---|---|---|---|---|---|")
    info = model_info(ensure(args.model))
    for dtype in args.dtypes:
        path = weights(args.model, dtype)
        label = f"{args.model} {dtype}"
        for batch in sorted({1, args.batch}):
            rng = random.Random(batch)
            prompts = [random_prompt(rng, args.prompt_tokens, info) for _ in range(batch)]
            plain = measure(path, args, prompts, None)
            report({"model": label, "batch": batch, "method": "none", "setting": "-", **plain})
            known = {tuple(p): t for p, t in zip(prompts, plain["tokens"], strict=True)}
            # Proposals must reach past the measured tokens: the replay continues the known run.
            for acceptance in args.acceptance:
                spec = {"method": "ngram", "num_tokens": args.k, "adaptive": False}
                res = measure(path, args, prompts, spec,
                              lambda e, a=acceptance, c=known: ReplayProposer(c, a, e.tokenizer.vocab_size))
                report({"model": label, "batch": batch, "method": "replay", "setting": f"K={args.k} p={acceptance}",
                        **res})
            for adaptive, ks in ((True, [args.k]), (False, args.wrong_k)):
                for k in ks:
                    spec = {"method": "ngram", "num_tokens": k, "adaptive": adaptive}
                    res = measure(path, args, prompts, spec,
                                  lambda e, c=known: ReplayProposer(c, 0.0, e.tokenizer.vocab_size))
                    setting = f"K={k} " + ("adaptive" if adaptive else "fixed")
                    report({"model": label, "batch": batch, "method": "wrong", "setting": setting, **res})
    # n-gram on the trained model, on a prompt that already holds the story it continues.
    import zllm

    story_path = ensure("stories260k")
    story_label = "stories260k f32 (story prompt)"
    with zllm.Engine.from_config(engine_config(story_path, args, None)) as engine:
        story = engine.generate({"prompt": "", "max_tokens": 400})["token_ids"]
    prompt = story[:300] + story[:60]
    for batch in sorted({1, args.batch}):
        prompts = [prompt] * batch
        plain = measure(story_path, args, prompts, None)
        report({"model": story_label, "batch": batch, "method": "none", "setting": "-", **plain})
        res = measure(story_path, args, prompts, {"method": "ngram", "num_tokens": args.k, "adaptive": True})
        report({"model": story_label, "batch": batch, "method": "ngram", "setting": f"K={args.k} adaptive",
                **res})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"settings": settings,
                                         "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]},
                                        indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
