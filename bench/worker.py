"""One measurement in its own process: ``python bench/worker.py '<json spec>'``.

``bench/run.py`` starts one worker per (model, engine, repeat), so every measurement begins
from a fresh interpreter and its peak-RSS growth is its own. The worker prints exactly one
line starting with ``BENCH_RESULT `` followed by a JSON object; everything else it prints
(library logs, warnings) is ignored by the parent.

Spec keys: ``engine`` (a key of :data:`ENGINES`), ``model_dir``, ``prompt_ids``,
``warmup_ids``, ``new_tokens``, ``threads``, and ``mode``: ``measure`` (default),
``probe`` (transformers only: greedy generation *with* EOS allowed for each candidate in
``candidates``; returns how many tokens each produced before EOS) or ``batch``
(transformers only, for ``bench/serve.py``: one batched greedy ``generate`` over
``prompts``, left-padded, after a warm-up batch over ``warmup_prompts``).

How a measurement runs (the same for every engine):

1. import torch and the engine's library, ``torch.set_num_threads(threads)``;
2. baseline: ``gc.collect()``, read ``VmRSS`` and reset the kernel's peak-RSS counter
   (``echo 5 > /proc/self/clear_refs``; if that is refused, the peak since start is used);
3. load the model (timed: ``load_s``);
4. warm up: one generation of ``warmup_ids`` (same length as the prompt, different ids, so
   no prefix cache can serve the measured prompt) for :data:`WARMUP_TOKENS` tokens;
5. measure: one greedy streaming generation of ``prompt_ids`` for ``new_tokens`` tokens,
   recording ``time.perf_counter()`` whenever the engine hands out new tokens.
   ``ttft_s`` = first token time - start; ``prefill_tok_s`` = prompt length / ``ttft_s``;
   ``decode_tok_s`` = (generated - 1) / (last token time - first token time);
6. ``peak_rss_growth`` = ``VmHWM`` at the end - baseline ``VmRSS``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any, Callable

WARMUP_TOKENS = 4
RESULT_PREFIX = "BENCH_RESULT "


# ---------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Current resident set size (``VmRSS``), bytes."""
    kib = _status_kib("VmRSS")
    if kib is None:  # not Linux: best effort
        import resource

        return _maxrss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return kib * 1024


def _maxrss_bytes(value: int) -> int:
    return value if sys.platform == "darwin" else value * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``) to the current RSS; False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since start or the last :func:`reset_peak_rss`, bytes."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        return _maxrss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return kib * 1024


# ---------------------------------------------------------------------------- engines
#
# An engine runner has: ``load(model_dir, spec)`` and
# ``generate(prompt_ids, new_tokens, on_tokens) -> (token_ids, finish_reason)``, where
# ``on_tokens(k)`` is called as soon as the engine has handed out k more tokens.
# Add a peer (llama.cpp, vLLM, ...) by adding a class and an ENGINES entry.


class ZllmRunner:
    """zllm in process: ``Engine.generate_stream`` with greedy sampling and no stop ids.

    The config sizes the runtime to the workload, the way HF's cache grows to exactly
    prompt + new tokens: one running sequence, no prefix cache, a KV cache of
    ``ceil((prompt + new) / block_size)`` blocks, the whole prompt in one prefill chunk.
    """

    name = "zllm"
    block_size = 16

    def import_libs(self) -> None:
        import torch  # noqa: F401
        import zllm  # noqa: F401
        import zllm.engine.engine  # noqa: F401  (zllm.Engine is lazy; import it before the baseline)
        import zllm_backend_cpu  # noqa: F401
        import zllm_model_llama  # noqa: F401

    def versions(self) -> dict[str, str]:
        from importlib.metadata import version

        import torch

        return {"torch": torch.__version__, **{d: version(d) for d in
                ("zllm-core", "zllm-backend-cpu", "zllm-model-llama")}}

    def load(self, model_dir: str, spec: dict[str, Any]) -> None:
        import zllm
        from zllm.spec.config import config_from_dict

        tokens = len(spec["prompt_ids"]) + spec["new_tokens"]
        blocks = -(-tokens // self.block_size)
        data = {
            "schema_version": 1,
            "model": {"path": model_dir, "dtype": "f32"},
            "backend": {"name": "cpu", "threads": spec["threads"]},
            "runtime": {
                "kv_cache": {"block_size": self.block_size, "num_blocks": blocks},
                "max_num_seqs": 1,
                "max_prefill_tokens": max(512, len(spec["prompt_ids"])),
                "context_length": blocks * self.block_size,
                "prefix_cache_seqs": 0,
            },
        }
        self.engine = zllm.Engine.from_config(config_from_dict(data))

    def generate(self, prompt_ids: list[int], new_tokens: int, on_tokens: Callable[[int], None]):
        request = {"prompt_token_ids": prompt_ids, "max_tokens": new_tokens, "temperature": 0.0,
                   "stop_token_ids": [], "stop": []}
        ids: list[int] = []
        finish = None
        for event in self.engine.generate_stream(request):
            if "finish_reason" in event:
                finish = event["finish_reason"]
            elif event.get("token_ids"):
                on_tokens(len(event["token_ids"]))
                ids.extend(event["token_ids"])
        return ids, finish


class TransformersRunner:
    """HF transformers: ``LlamaForCausalLM.from_pretrained(dir, dtype=float32,
    attn_implementation="sdpa")`` and ``generate(do_sample=False, max_new_tokens=N,
    min_new_tokens=N)`` with a streamer that timestamps every new token."""

    name = "transformers"

    def import_libs(self) -> None:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401  (resolves the lazy module)

    def versions(self) -> dict[str, str]:
        import torch
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__}

    def load(self, model_dir: str, spec: dict[str, Any]) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                      attn_implementation="sdpa").eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])

    def generate(self, prompt_ids: list[int], new_tokens: int, on_tokens: Callable[[int], None],
                 allow_eos: bool = False):
        import torch
        from transformers.generation.streamers import BaseStreamer

        class Stamp(BaseStreamer):
            def __init__(self):
                self.prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # generate() first hands the streamer the prompt
                    self.prompt_seen = True
                    return
                on_tokens(int(value.numel()))

            def end(self):
                pass

        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        kwargs = dict(
            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0 if allow_eos else new_tokens,
            attention_mask=torch.ones_like(input_ids), streamer=Stamp(),
            pad_token_id=self.eos[0] if self.eos else 0, eos_token_id=self.eos or None,
            temperature=None, top_p=None, top_k=None,
        )
        with torch.inference_mode():
            out = self.model.generate(input_ids, **kwargs)
        ids = out[0, len(prompt_ids):].tolist()
        finish = "stop" if ids and ids[-1] in self.eos and len(ids) < new_tokens else "length"
        return ids, finish


ENGINES: dict[str, type] = {"zllm": ZllmRunner, "transformers": TransformersRunner}


# ---------------------------------------------------------------------------- measurement


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    runner = ENGINES[spec["engine"]]()
    runner.import_libs()
    import torch

    torch.set_num_threads(spec["threads"])
    gc.collect()
    baseline = rss_bytes()
    peak_reset = reset_peak_rss()

    t0 = time.perf_counter()
    runner.load(spec["model_dir"], spec)
    load_s = time.perf_counter() - t0

    runner.generate(spec["warmup_ids"], WARMUP_TOKENS, lambda k: None)

    stamps: list[tuple[float, int]] = []
    start = time.perf_counter()
    ids, finish = runner.generate(spec["prompt_ids"], spec["new_tokens"],
                                  lambda k: stamps.append((time.perf_counter(), k)))
    n = sum(k for _, k in stamps)
    ttft = stamps[0][0] - start
    decode_time = stamps[-1][0] - stamps[0][0]
    decoded = n - stamps[0][1]  # tokens after the first delivery
    peak = peak_rss_bytes()
    return {
        "engine": spec["engine"],
        "prompt_tokens": len(spec["prompt_ids"]),
        "generated_tokens": n,
        "finish_reason": finish,
        "token_ids": ids,
        "load_s": load_s,
        "ttft_s": ttft,
        "prefill_tok_s": len(spec["prompt_ids"]) / ttft,
        "decode_s": decode_time,
        "decode_tok_s": decoded / decode_time if decode_time > 0 and decoded > 0 else None,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak,
        "peak_rss_growth_bytes": peak - baseline,
        "peak_reset": peak_reset,
        "threads": torch.get_num_threads(),
        "versions": runner.versions(),
    }


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """For each candidate prompt: tokens of greedy output before EOS (``new_tokens`` if none)."""
    runner = TransformersRunner()
    runner.import_libs()
    import torch

    torch.set_num_threads(spec["threads"])
    runner.load(spec["model_dir"], spec)
    lengths = []
    for ids in spec["candidates"]:
        out, finish = runner.generate(ids, spec["new_tokens"], lambda k: None, allow_eos=True)
        lengths.append(len(out) if finish == "stop" else spec["new_tokens"])
        if lengths[-1] >= spec["new_tokens"]:
            break
    return {"lengths": lengths}


def batch(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers' batched ``generate`` over ``prompts`` (left padding, greedy, exactly
    ``new_tokens`` each): the time to the first generated token of the batch and in all."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    runner = TransformersRunner()
    runner.import_libs()
    torch.set_num_threads(spec["threads"])
    runner.load(spec["model_dir"], spec)
    pad = runner.eos[0] if runner.eos else 0

    def run(prompts: list[list[int]], n: int, on_step: Callable[[], None]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)

        class Stamp(BaseStreamer):
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # generate() first hands the streamer the prompts
                    self.prompt_seen = True
                    return
                on_step()

            def end(self):
                pass

        with torch.inference_mode():
            out = runner.model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                        min_new_tokens=n, streamer=Stamp(), pad_token_id=pad,
                                        eos_token_id=runner.eos or None, temperature=None, top_p=None, top_k=None)
        return out[:, width:].tolist()

    run(spec["warmup_prompts"], WARMUP_TOKENS, lambda: None)
    steps: list[float] = []
    start = time.perf_counter()
    ids = run(spec["prompts"], spec["new_tokens"], lambda: steps.append(time.perf_counter()))
    end = time.perf_counter()
    generated = sum(len(row) for row in ids)
    return {"engine": "transformers", "mode": "batch", "requests": len(ids), "generated_tokens": generated,
            "ttft_s": steps[0] - start, "total_s": end - start, "tok_s": generated / (end - start),
            "threads": torch.get_num_threads(), "versions": runner.versions()}


MODES = {"measure": measure, "probe": probe, "batch": batch}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    result = MODES[spec.get("mode", "measure")](spec)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
