"""Where a zllm decode step's time goes (``bench/run.py --profile``), measured two ways in one process.

1. **Wall-clock split** over every decode step of one generation (prompt P, N new tokens):
   the runtime's entry points and each bound op are wrapped with ``time.perf_counter``
   accumulators (about 0.3 us per call) and the medians per step are reported:

   ========================  ========================================================
   ``interval``              time between the ends of two steps on the engine loop's thread
                             (what decode tok/s sees)
   ``interval cpu``          CPU time the process used in that interval (all its threads):
                             with one thread, the work itself without the time other
                             processes held the core — the steadier figure on a shared machine
   ``step``                  ``LLMEngine.step``
   ``schedule``              ``Scheduler.schedule``
   ``execute``               ``ModelRunner.execute`` (batch building, forward, sampling)
   ``forward``               the model's ``forward``
   ``op.<name>``             each bound op (``linear``, ``attention``, ...), summed
   ``sample``                the runtime's sampler (``ModelRunner.sampler``)
   ``accept``                ``LLMEngine._accept``: detokenization and stop checks
   ``runtime python``        ``interval - forward - sample``: everything but the model
                             and the sampler
   ``forward python``        ``forward - sum(op.*)``: the layer loop's own Python
   ========================  ========================================================

2. **torch.profiler** over one decode round (after two warm-up rounds), with a
   ``record_function`` range around every wrapped call, so aten ops are attributed to the
   op that issued them. The table sorted by self CPU time goes to ``<out>.txt``, the rows
   to ``<out>.json``, the Chrome trace to ``<out>.trace.json``.

The wrappers are set on the loaded engine's objects (instance attributes), so zllm's
code is measured as shipped.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

OP_NAMES = ("embedding", "linear", "rms_norm", "add_rms_norm", "rope", "attention", "attention_sliding", "silu_mul",
            "moe", "mla_attention")


class _Clock:
    """Accumulated seconds and call counts per label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.profiling = False
        # (perf_counter, process_time, snapshot) at the end of each step, taken on the engine
        # loop's thread: the consumer's receipt times would blur steps into each other.
        self.step_ends: list[tuple[float, float, dict[str, float]]] = []

    def wrap(self, label: str, fn: Callable) -> Callable:
        import torch

        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            if self.profiling:
                with torch.profiler.record_function(label):
                    return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - t0
                calls[label] += 1

        return timed

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


def instrument(engine) -> _Clock:
    """Wrap the runtime entry points and every bound op of ``engine`` (a ``zllm.Engine``)."""
    clock = _Clock()
    llm = engine.llm
    timed_step = clock.wrap("step", llm.step)

    def step():
        outputs = timed_step()
        clock.step_ends.append((time.perf_counter(), time.process_time(), clock.snapshot()))
        return outputs

    llm.step = step
    llm._accept = clock.wrap("accept", llm._accept)
    llm.scheduler.schedule = clock.wrap("schedule", llm.scheduler.schedule)
    llm.runner.execute = clock.wrap("execute", llm.runner.execute)
    model = llm.runner.model
    model.forward = clock.wrap("forward", model.forward)
    llm.runner.sampler = clock.wrap("sample", llm.runner.sampler)
    ops = model.ops
    for name in OP_NAMES:
        if hasattr(ops, name):
            setattr(ops, name, clock.wrap(f"op.{name}", getattr(ops, name)))
    return clock


def wall_split(engine, clock: _Clock, prompt_ids: list[int], new_tokens: int, request: Callable) -> dict[str, Any]:
    """Median milliseconds per decode step for every label (see the module docstring)."""
    clock.step_ends.clear()
    for _ in engine.generate_stream(request(prompt_ids, new_tokens)):
        pass
    # The request's steps, prefill first; the loop idles (no step) once it has finished.
    stamps = [end[0] for end in clock.step_ends]
    cpu = [end[1] for end in clock.step_ends]
    snaps = [end[2] for end in clock.step_ends]
    steps = []
    for i in range(1, len(stamps)):
        delta = {k: v - snaps[i - 1].get(k, 0.0) for k, v in snaps[i].items()}
        delta["interval"] = stamps[i] - stamps[i - 1]
        delta["interval cpu"] = cpu[i] - cpu[i - 1]
        ops = sum(v for k, v in delta.items() if k.startswith("op."))
        delta["runtime python"] = delta["interval"] - delta.get("forward", 0.0) - delta.get("sample", 0.0)
        delta["forward python"] = delta.get("forward", 0.0) - ops
        steps.append(delta)
    labels = sorted({k for s in steps for k in s})
    return {"decode_steps": len(steps),
            "median_ms": {k: 1000 * statistics.median(s.get(k, 0.0) for s in steps) for k in labels},
            "calls_per_step": {k: clock.calls[k] / max(1, clock.calls["step"]) for k in clock.calls}}


def torch_profile(engine, clock: _Clock, prompt_ids: list[int], request: Callable, out: Path) -> list[dict[str, Any]]:
    """Profile one decode round; write ``out``.txt/.json/.trace.json; the rows by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    req = engine.parse(request(prompt_ids, 16))
    ids = engine.prompt_ids(req)

    def one_round(llm):
        # On the engine loop's thread, between its own steps (no other request is live), so
        # the profiled window holds exactly one step: one decode round of one sequence.
        seq = llm.add_request(req, ids, req.max_tokens)
        clock.profiling = True
        try:
            for _ in range(3):  # the prefill, then two decode rounds as warm-up of the record_function path
                llm.step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                llm.step()
            return prof
        finally:
            clock.profiling = False
            llm.abort(seq)

    prof = engine.loop.call(one_round)
    averages = prof.key_averages()
    rows = [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total, "cpu_total_us": e.cpu_time_total}
            for e in averages]
    rows.sort(key=lambda r: -r["self_cpu_us"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    prof.export_chrome_trace(str(out.with_suffix(".trace.json")))
    return rows


def profile_zllm(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``profile`` worker mode: load zllm on ``model_path``, warm up, then both profiles."""
    import torch
    from worker import WARMUP_TOKENS, ZllmRunner

    runner = ZllmRunner()
    runner.import_libs()
    torch.set_num_threads(spec["threads"])
    runner.load(spec)
    runner.generate(spec["warmup_ids"], WARMUP_TOKENS, lambda k: None)
    clock = instrument(runner.engine)
    split = wall_split(runner.engine, clock, spec["prompt_ids"], spec["new_tokens"], runner.request)
    rows = torch_profile(runner.engine, clock, spec["warmup_ids"], runner.request, Path(spec["out"]))
    return {"engine": "zllm", "mode": "profile", "wall": split, "torch_profile_top": rows[:40],
            "threads": torch.get_num_threads(), "versions": runner.versions()}
