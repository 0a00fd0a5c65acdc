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
- **n-gram on stories260K** (``ngram`` rows): prompt lookup on the one trained model (its
  shipped F32 GGUF), on a prompt that already holds the story it will continue
  (input-repetitive, as summarising or editing a document is); beside it llama.cpp's own
  prompt-lookup example (``llama-lookup``, built from the ``llama-cpp-python`` sdist with
  ``--llama-cpp build``; ``auto`` uses it when already built) on the same file, prompt, K and
  thread count. A ``draft`` row drafts with the same model's Q8_0 file (the only draft with
  stories260K's vocabulary; the bench models share another one, and are random).

Decode tok/s is the tokens delivered after every sequence had its first one, over that
time; medians of ``--repeats``. Wall-clock timings; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
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
    p.add_argument("--llama-cpp", choices=("auto", "build", "off"), default="auto",
                   help="llama.cpp's llama-lookup beside the n-gram rows: auto = when already built")
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


def llama_lookup_binary(mode: str) -> Path | None:
    """``llama-lookup`` from the sdist's llama.cpp (built on ``build``), or None."""
    if mode == "off":
        return None
    import llama_cpp_peer

    src = llama_cpp_peer.sources(fetch=mode == "build")
    if src is None:
        return None
    binary = src / "build" / "bin" / "llama-lookup"
    if not binary.exists() and mode == "build":
        flags = [*llama_cpp_peer.CMAKE_FLAGS, "-DLLAMA_BUILD_EXAMPLES=ON"]
        for cmd in (["cmake", "-S", str(src), "-B", str(src / "build"), *flags],
                    ["cmake", "--build", str(src / "build"), "--target", "llama-lookup", "-j", "2"]):
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return binary if binary.exists() else None


def llama_lookup(binary: Path, gguf: Path, prompt: str, args) -> dict[str, Any]:
    """Decode tok/s and acceptance of llama.cpp's prompt-lookup example (medians)."""
    runs, accepts = [], []
    for _ in range(args.repeats):
        proc = subprocess.run([str(binary), "-m", str(gguf), "-p", prompt, "-n", str(args.new_tokens),
                               "--spec-draft-n-max", str(args.k), "-t", str(args.threads), "--temp", "0", "-c", "1024"],
                              capture_output=True, text=True, timeout=600)
        speed = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", proc.stderr)
        accept = re.search(r"accept\s+=\s+([\d.]+)%", proc.stderr)
        if speed is None:
            raise RuntimeError(f"llama-lookup printed no speed:\n{proc.stderr[-2000:]}")
        runs.append(float(speed[1]))
        accepts.append(float(accept[1]) / 100 if accept else None)
    return {"tok_s": statistics.median(runs), "runs": runs, "acceptance": accepts[0]}


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

    story_path = ensure_gguf("stories260k", "f32")[0]
    story_label = "stories260k f32 (story prompt)"
    with zllm.Engine.from_config(engine_config(story_path, args, None)) as engine:
        story = engine.generate({"prompt": "", "max_tokens": 400})["token_ids"]
        prompt_text = engine.tokenizer.decode(story[:300] + story[:60])
        prompt = engine.prompt_ids(engine.parse({"prompt": prompt_text}))
    lookup = llama_lookup_binary(args.llama_cpp)
    for batch in sorted({1, args.batch}):
        prompts = [prompt] * batch
        plain = measure(story_path, args, prompts, None)
        report({"model": story_label, "batch": batch, "method": "none", "setting": "-", **plain})
        ngram = measure(story_path, args, prompts, {"method": "ngram", "num_tokens": args.k, "adaptive": True})
        report({"model": story_label, "batch": batch, "method": "ngram", "setting": f"K={args.k} adaptive",
                **ngram})
        draft = {"method": "draft", "num_tokens": args.k, "adaptive": True,
                 "draft": {"model": {"path": str(ensure_gguf("stories260k", "q8_0")[0])}}}
        res = measure(story_path, args, prompts, draft)
        report({"model": story_label, "batch": batch, "method": "draft", "setting": f"K={args.k} Q8_0 draft",
                **res})
        if batch == 1 and lookup is not None:
            peer = llama_lookup(lookup, story_path, prompt_text, args)
            report({"model": story_label, "batch": batch, "method": "llama.cpp llama-lookup",
                    "setting": f"K={args.k}", **peer})
            print(f"zllm n-gram / llama.cpp llama-lookup: {ngram['tok_s'] / peer['tok_s']:.2f}x", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"settings": settings,
                                         "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]},
                                        indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
