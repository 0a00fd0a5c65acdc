"""Grammar benchmark: decode speed with a JSON-schema grammar vs without, and what compiling one costs.

``.venv/bin/python bench/grammar.py`` (``make bench-grammar``). In process, through one
``zllm.Engine`` on a benchmark model (default the 110M Llama of ``bench/models.py``):

- **Decode.** For every batch size C in ``--batch``: C requests of ``--prompt-tokens`` random
  ids submitted at once (``Engine.generate_stream``, drained round-robin), greedy, each
  generating exactly ``--new-tokens``, once unconstrained and once with
  ``response_format: json_schema`` — alternately, ``--repeats`` times. The schema
  (:func:`decode_schema`) is an object holding one string whose ``minLength`` the requested
  tokens cannot reach, so the grammar constrains every token and never ends a sequence early:
  both runs have the same batch at every step. Decode tok/s counts the tokens the engine's steps
  made after the last step that gave a sequence its first token, over those steps' time, read
  on the engine loop's thread (a consumer of buffered streams can receive a short run's tokens
  all at once). There ``perf_counter`` wrappers time every decode step (``LLMEngine.step``), the model's forward,
  the runtime's sampler and the grammar matchers' work (llguidance's token mask, ``allowed_tokens``, and advancing
  it, ``accept``); each is the median per decode step. The grammar's cost per step is the
  matchers' time plus the extra sampling time (the mask applied to the logits, and the full
  sampler instead of the greedy ``argmax`` fast path), reported in ms and as % of an
  unconstrained step. On a shared machine that figure is steadier than the difference of two
  step times, which is reported too ("step Δ"): other processes slow the forward pass by tens
  of percent from one run to the next, and the forward column shows where a step Δ came from.
- **First-token latency.** ``Engine.generate`` with ``max_tokens: 1`` (prefill, one token):
  without a grammar (median of ``--repeats``), with the engine's first grammar (llguidance's
  token table for the vocabulary is built then, once per engine, plus the compile), with a
  schema it has not seen (the compile alone; a fresh schema each repeat), and with that same
  schema again (the compiled grammar comes from the cache). The grammar is prepared in the
  calling thread before the request is queued (``Engine.prepare``: validation — the schema's
  own check included —, tokenization, and ``StructuredOutput.constraint``: compile or cache
  look-up, and a fresh matcher), so what it adds to the first token is timed directly: "prepare
  ms" for the whole call, "grammar ms" for the constraint part. A difference of first-token
  times would drown it in the prefill's noise on a shared machine.

Wall-clock timings; nothing here asserts on them. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from models import MODELS, ensure, model_info  # noqa: E402
from run import default_threads, random_prompt, worker_env  # noqa: E402
from worker import ZllmRunner  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama-110m", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes (concurrent sequences)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (random token ids)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence (no early stop)")
    p.add_argument("--repeats", type=int, default=3, help="runs per (batch, grammar) and per latency row; medians")
    p.add_argument("--threads", type=int, default=default_threads(), help="CPU threads of the engine")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", metavar="OUT", type=Path, help="write settings and every measurement here")
    args = p.parse_args(argv)
    if args.model not in MODELS:
        p.error(f"unknown model {args.model!r}; known: {', '.join(MODELS)}")
    try:
        args.batch = sorted({int(b) for b in args.batch.split(",") if b.strip()})
    except ValueError:
        p.error(f"--batch must be comma-separated ints, got {args.batch!r}")
    if not args.batch or min(args.batch) < 1:
        p.error("--batch values must be >= 1")
    for name in ("prompt_tokens", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def max_token_chars(engine) -> int:
    """Characters of the vocabulary's longest token, plus one for a SentencePiece token's
    leading space (a lone token decodes without it)."""
    return 1 + max(len(engine.token_text(i)) for i in range(engine.tokenizer.vocab_size))


def decode_schema(new_tokens: int, token_chars: int) -> dict[str, Any]:
    """``{"story": "<text>"}`` with the text longer than ``new_tokens`` tokens of at most
    ``token_chars`` characters can spell (a JSON escape is more characters than it stands for)."""
    story = {"type": "string", "minLength": token_chars * new_tokens + 1}
    return {"type": "object", "properties": {"story": story}, "required": ["story"], "additionalProperties": False}


def latency_schema(variant: int) -> dict[str, Any]:
    """A typical API schema (an order: nested object, array of objects, enum, bounds);
    ``variant`` renames one field so every variant is a grammar the engine has not compiled."""
    item = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                             "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                             "unit_price": {"type": "number"}},
            "required": ["sku", "quantity", "unit_price"], "additionalProperties": False}
    return {"type": "object", "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                      "email": {"type": "string", "format": "email"}},
                     "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 10},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        f"notes_{variant}": {"type": "string"}},
        "required": ["order_id", "customer", "items", "status"], "additionalProperties": False}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def request(prompt: list[int], new_tokens: int, schema: dict[str, Any] | None) -> dict[str, Any]:
    req: dict[str, Any] = {"prompt_token_ids": prompt, "max_tokens": new_tokens, "temperature": 0.0,
                           "ignore_eos": True, "stop": []}
    if schema is not None:
        req["response_format"] = response_format(schema)
    return req


class StepClock:
    """Seconds per engine step, and within each step in the model's forward, the sampler and
    the grammar matchers, recorded on the engine loop's thread by wrappers around the loaded
    engine's ``step``, ``runner.model.forward`` and ``runner.sampler`` and around
    :class:`zllm.runtime.grammar.GrammarMatcher`'s ``allowed_tokens`` and ``accept``.
    ``steps``: ``(end time, {label: seconds}, tokens, first)`` per step, ``first`` True when the
    step gave some sequence its first token (a prefill step). Everything is read on the engine
    thread: a consumer reading buffered streams may see every token of a short run at once."""

    def __init__(self, engine):
        from zllm.runtime.grammar import GrammarMatcher

        self._seconds: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[float, dict[str, float], int, bool]] = []
        self._seen: set[int] = set()
        llm = engine.llm
        step = llm.step

        def timed_step():
            before = dict(self._seconds)
            t0 = time.perf_counter()
            outputs = step()
            t1 = time.perf_counter()
            spent = {k: v - before.get(k, 0.0) for k, v in self._seconds.items()}
            fresh = {id(o.seq) for o in outputs if o.token_ids} - self._seen
            self._seen |= fresh
            self.steps.append((t1, {**spent, "step": t1 - t0}, sum(len(o.token_ids) for o in outputs), bool(fresh)))
            return outputs

        llm.step = timed_step
        llm.runner.model.forward = self._wrap("forward", llm.runner.model.forward)
        llm.runner.sampler = self._wrap("sample", llm.runner.sampler)
        GrammarMatcher.allowed_tokens = self._wrap("matcher", GrammarMatcher.allowed_tokens)
        GrammarMatcher.accept = self._wrap("matcher", GrammarMatcher.accept)

    def _wrap(self, label: str, fn: Callable) -> Callable:
        seconds = self._seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - t0

        return timed

    def reset(self) -> None:
        self.steps.clear()
        self._seen.clear()

    def decode(self) -> tuple[float | None, dict[str, float]]:
        """Decode tok/s and the median ms per step of each label, over the steps after the
        last step that gave a sequence its first token (``None`` and ``{}`` when there are none)."""
        last_first = max((i for i, (_, _, _, first) in enumerate(self.steps) if first), default=-1)
        steps = self.steps[last_first + 1:]
        if not steps:
            return None, {}
        start = self.steps[last_first][0] if last_first >= 0 else steps[0][0] - steps[0][1]["step"]
        tok_s = sum(n for _, _, n, _ in steps) / (steps[-1][0] - start)
        labels = ("step", "forward", "sample", "matcher")
        return tok_s, {k: 1000 * statistics.median(spent.get(k, 0.0) for _, spent, _, _ in steps) for k in labels}


def decode_run(engine, clock: StepClock, prompts: list[list[int]], new_tokens: int,
               schema: dict[str, Any] | None) -> dict[str, Any]:
    """All ``prompts`` at once, streams drained round-robin from this thread (as
    ``bench/worker.py``'s batched run does): tokens delivered, and decode tok/s and the median
    ms per decode step (:class:`StepClock`) of the steps after every sequence had its first token."""
    clock.reset()
    start = time.perf_counter()
    streams = {i: engine.generate_stream(request(p, new_tokens, schema)) for i, p in enumerate(prompts)}
    generated = 0
    finish: dict[int, str] = {}
    while streams:
        for i, stream in list(streams.items()):
            event = next(stream, None)
            if event is None:
                del streams[i]
            elif event["type"] == "final":
                finish[i] = event["finish_reason"]
            else:
                generated += len(event["token_ids"])
    tok_s, per_step = clock.decode()
    return {"generated_tokens": generated, "finish_reasons": sorted(set(finish.values())),
            "decode_tok_s": tok_s, "total_s": time.perf_counter() - start, "per_step_ms": per_step}


def first_token_s(engine, prompt: list[int], schema: dict[str, Any] | None) -> dict[str, float]:
    """Seconds of one ``Engine.generate`` for one token: ``total``; ``prepare``, the work done
    in the calling thread before the request is queued (``Engine.prepare``: validation, the
    schema's check, tokenization, the grammar); ``grammar``, the part of it in
    ``StructuredOutput.constraint`` (compile or cache look-up, and a fresh matcher)."""
    spent: dict[str, float] = defaultdict(float)

    def timed(label: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
        return call

    # Instance attributes shadow the methods for this call only.
    engine.prepare = timed("prepare", engine.prepare)
    engine.structured.constraint = timed("grammar", engine.structured.constraint)
    try:
        start = time.perf_counter()
        engine.generate(request(prompt, 1, schema))
        return {"total": time.perf_counter() - start, "prepare": spent["prepare"], "grammar": spent["grammar"]}
    finally:
        del engine.prepare, engine.structured.constraint


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import zllm
    from zllm.spec.config import config_from_dict

    path = ensure(args.model)
    info = model_info(path)
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, args.prompt_tokens, info) for _ in range(max(args.batch))]
    torch.set_num_threads(args.threads)
    spec = {"model_path": str(path), "threads": args.threads, "prompt_ids": prompts[0], "new_tokens": args.new_tokens}
    engine = zllm.Engine.from_config(config_from_dict(ZllmRunner.config(spec, seqs=max(args.batch))))
    out: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "model_path": str(path), "vocab_size": info["vocab_size"], "torch": torch.__version__}
    with engine:
        engine.generate(request(prompts[-1], 4, None))  # warm-up: first-call costs of the kernels

        rows = {"no_grammar": [first_token_s(engine, prompts[0], None) for _ in range(args.repeats)],
                "first_grammar": [first_token_s(engine, prompts[0], latency_schema(0))],
                "new_schema": [first_token_s(engine, prompts[0], latency_schema(k + 1)) for k in range(args.repeats)],
                "cached_schema": [first_token_s(engine, prompts[0], latency_schema(args.repeats))
                                  for _ in range(args.repeats)]}
        out["first_token"] = {key: {f"{part}_s": [r[part] for r in runs] for part in ("total", "prepare", "grammar")}
                              for key, runs in rows.items()}

        schema = decode_schema(args.new_tokens, max_token_chars(engine))
        engine.generate(request(prompts[-1], 2, schema))  # compile the decode grammar outside the runs
        clock = StepClock(engine)
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for c in args.batch:
            runs[str(c)] = {"none": [], "json_schema": []}
            for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
                runs[str(c)]["none"].append(decode_run(engine, clock, prompts[:c], args.new_tokens, None))
                runs[str(c)]["json_schema"].append(decode_run(engine, clock, prompts[:c], args.new_tokens, schema))
        out["decode"] = runs
    return out


def summarize(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per batch size and grammar: medians over the repeats of decode tok/s and of each run's
    median ms per step; for the grammar rows the cost per step (matchers + extra sampling) and
    its % of the unconstrained step, and the step-time difference."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for c, by in result["decode"].items():
        rows: dict[str, dict[str, float | None]] = {}
        for kind, runs in by.items():
            per_step = [r["per_step_ms"] for r in runs if r["per_step_ms"]]
            rows[kind] = {"decode_tok_s": median([r["decode_tok_s"] for r in runs]),
                          **{k: median([p[k] for p in per_step]) for k in ("step", "forward", "sample", "matcher")},
                          "tokens": runs[-1]["generated_tokens"]}
        plain, constrained = rows["none"], rows["json_schema"]
        if None not in (plain["step"], plain["sample"], constrained["sample"], constrained["matcher"]):
            cost = constrained["matcher"] + constrained["sample"] - plain["sample"]
            constrained["grammar_ms"] = cost
            constrained["grammar_pct"] = 100 * cost / plain["step"]
            constrained["step_delta_pct"] = 100 * (constrained["step"] - plain["step"]) / plain["step"]
        out[c] = rows
    return out


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"grammar benchmark: {s['model']} (cpu, {s['threads']} threads), prompt {s['prompt_tokens']} tokens, "
             f"{s['new_tokens']} new tokens per sequence, medians of {s['repeats']}", "",
             f"{'batch':<7}{'grammar':<13}{'decode tok/s':>13}{'step ms':>9}{'forward ms':>12}{'sample ms':>11}"
             f"{'matcher ms':>12}"
             f"{'grammar ms':>12}{'% of step':>11}{'step Δ':>9}{'tokens':>8}"]
    for c, rows in result["summary"].items():
        for kind, r in rows.items():
            # The matchers and the grammar's cost exist only in the grammar rows.
            matcher, cost = (_num(r["matcher"], 2), _num(r.get("grammar_ms"), 2)) if kind != "none" else ("-", "-")
            lines.append(
                f"{c:<7}{kind:<13}{_num(r['decode_tok_s']):>13}{_num(r['step']):>9}{_num(r['forward']):>12}"
                f"{_num(r['sample'], 2):>11}"
                f"{matcher:>12}{cost:>12}{_pct(r.get('grammar_pct')):>11}{_pct(r.get('step_delta_pct')):>9}"
                f"{r['tokens']:>8}")
    ft = result["first_token"]
    lines += ["", f"{'first-token latency (Engine.generate, 1 token)':<54}{'first token ms':>16}{'prepare ms':>12}"
                  f"{'grammar ms':>12}"]
    for label, key in (("no grammar", "no_grammar"),
                       ("first grammar of the engine (token table + compile)", "first_grammar"),
                       ("a schema not seen before (compile)", "new_schema"),
                       ("the same schema again (cached)", "cached_schema")):
        total, prepare, grammar = (1000 * median(ft[key][f"{part}_s"]) for part in ("total", "prepare", "grammar"))
        lines.append(f"{label:<54}{total:>16.1f}{prepare:>12.2f}{grammar:>12.2f}")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import os

    os.environ.update({k: v for k, v in worker_env(args.threads).items() if k not in os.environ})
    result = measure(args)
    result["summary"] = summarize(result)
    print(report(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
