"""One measurement in its own process: ``python bench/worker.py '<json spec>'``.

``bench/run.py`` starts one worker per (model, engine, repeat), so every measurement begins
from a fresh interpreter and its peak-RSS growth is its own. The worker prints exactly one
line starting with ``BENCH_RESULT `` followed by a JSON object; everything else it prints
(library logs, warnings) is ignored by the parent.

Spec keys: ``engine`` (a key of :data:`ENGINES`), ``model_path`` (zllm and llama.cpp: the
GGUF file; transformers: the HF directory), ``dtype`` (transformers' torch dtype: ``f32``,
``f16`` or ``bf16``), ``prompt_ids``, ``warmup_ids``, ``new_tokens``, ``threads``, and
``mode``:

- ``measure`` (default): the steps below;
- ``batch`` (``bench/run.py --batch``, ``bench/serve.py``): ``prompts`` generated
  concurrently — zllm through one in-process ``Engine`` (continuous batching), transformers
  as one batched greedy ``generate`` (left-padded), after a warm-up over ``warmup_prompts``;
- ``bandwidth``: memory read bandwidth (:func:`bandwidth`);
- ``profile`` (zllm only, ``bench/run.py --profile``): see :mod:`profile_decode`.

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
from collections.abc import Callable
from typing import Any

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
# An engine runner has: ``import_libs()``, ``load(spec)``, ``versions()`` and
# ``generate(prompt_ids, new_tokens, on_tokens) -> (token_ids, finish_reason)``, where
# ``on_tokens(k)`` is called as soon as the engine has handed out k more tokens.
# Add a peer (vLLM, ...) by adding a class and an ENGINES entry.


class ZllmRunner:
    """zllm in process: ``Engine.generate_stream`` with greedy sampling, ``ignore_eos``.

    ``model_path`` is the GGUF file (or HF directory) the row benchmarks, loaded with
    ``model.dtype: auto`` so weights stay in their stored format (F16/BF16/Q8_0 included).
    The config sizes the runtime to the workload, the way HF's cache grows to exactly
    prompt + new tokens: one running sequence, no prefix cache, a KV cache of
    ``ceil((prompt + new) / block_size)`` blocks of f16 keys/values (the cache type llama-bench uses
    by default), the whole prompt in one prefill chunk.
    """

    name = "zllm"
    block_size = 16

    def import_libs(self) -> None:
        import torch  # noqa: F401

        import zllm  # noqa: F401
        import zllm.engine.engine  # noqa: F401  (zllm.Engine is lazy; import it before the baseline)
        import zllm.weights.gguf_file  # noqa: F401  (the GGUF reader, as transformers' runner resolves its model class)
        import zllm_backend_cpu  # noqa: F401
        import zllm_model_llama  # noqa: F401

    def versions(self) -> dict[str, str]:
        from importlib.metadata import version

        import torch

        return {"torch": torch.__version__, **{d: version(d) for d in
                ("zllm-core", "zllm-backend-cpu", "zllm-model-llama")}}

    @classmethod
    def config(cls, spec: dict[str, Any], seqs: int = 1) -> dict[str, Any]:
        """The engine config for ``seqs`` concurrent sequences of prompt + ``new_tokens``."""
        tokens = len(spec["prompt_ids"]) + spec["new_tokens"]
        blocks = -(-tokens // cls.block_size)
        return {
            "schema_version": 1,
            "model": {"path": spec["model_path"], "dtype": "auto"},
            "backend": {"name": "cpu", "threads": spec["threads"]},
            "runtime": {
                # f16 keys/values: llama-bench's default cache type (-ctk/-ctv f16)
                "kv_cache": {"block_size": cls.block_size, "num_blocks": blocks * seqs, "dtype": "f16"},
                "max_num_seqs": seqs,
                "max_prefill_tokens": max(512, len(spec["prompt_ids"])),
                "context_length": blocks * cls.block_size,
                "prefix_cache_seqs": 0,
            },
        }

    def load(self, spec: dict[str, Any], seqs: int = 1) -> None:
        import zllm
        from zllm.spec.config import config_from_dict

        self.engine = zllm.Engine.from_config(config_from_dict(self.config(spec, seqs)))

    @staticmethod
    def request(prompt_ids: list[int], new_tokens: int) -> dict[str, Any]:
        return {"prompt_token_ids": prompt_ids, "max_tokens": new_tokens, "temperature": 0.0,
                "ignore_eos": True, "stop": []}

    def generate(self, prompt_ids: list[int], new_tokens: int, on_tokens: Callable[[int], None]):
        ids: list[int] = []
        finish = None
        for event in self.engine.generate_stream(self.request(prompt_ids, new_tokens)):
            if "finish_reason" in event:
                finish = event["finish_reason"]
            elif event.get("token_ids"):
                on_tokens(len(event["token_ids"]))
                ids.extend(event["token_ids"])
        return ids, finish


TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


class TransformersRunner:
    """HF transformers: ``AutoModelForCausalLM.from_pretrained(dir, dtype=<dtype>,
    attn_implementation=<spec's, default "sdpa">)`` and ``generate(do_sample=False, max_new_tokens=N,
    min_new_tokens=N)`` with a streamer that timestamps every new token."""

    name = "transformers"

    def import_libs(self) -> None:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401  (resolves the lazy module)

    def versions(self) -> dict[str, str]:
        import torch
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__}

    def load(self, spec: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, TORCH_DTYPES[spec.get("dtype", "f32")])
        self.model = AutoModelForCausalLM.from_pretrained(
            spec["model_path"], dtype=dtype, attn_implementation=spec.get("attn_implementation", "sdpa")).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])

    def generate(self, prompt_ids: list[int], new_tokens: int, on_tokens: Callable[[int], None]):
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
            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            attention_mask=torch.ones_like(input_ids), streamer=Stamp(),
            pad_token_id=self.eos[0] if self.eos else 0, eos_token_id=self.eos or None,
            temperature=None, top_p=None, top_k=None,
        )
        with torch.inference_mode():
            out = self.model.generate(input_ids, **kwargs)
        return out[0, len(prompt_ids):].tolist(), "length"


class LlamaCppPythonRunner:
    """llama.cpp through its Python binding (``llama_cpp.Llama``), when that is installed:
    the GGUF ``model_path``, ``n_threads`` threads, the prompt evaluated in one batch, then
    greedy tokens (``top_k=1``) until ``new_tokens`` were produced (EOS does not stop it)."""

    name = "llama.cpp"

    def import_libs(self) -> None:
        import llama_cpp  # noqa: F401
        import torch  # noqa: F401  (set_num_threads is called for every engine)

    def versions(self) -> dict[str, str]:
        import llama_cpp

        return {"llama-cpp-python": llama_cpp.__version__}

    def load(self, spec: dict[str, Any]) -> None:
        import llama_cpp

        n_ctx = len(spec["prompt_ids"]) + spec["new_tokens"]
        self.llm = llama_cpp.Llama(model_path=spec["model_path"], n_ctx=n_ctx, n_batch=max(512, n_ctx),
                                   n_threads=spec["threads"], n_threads_batch=spec["threads"], verbose=False)

    def generate(self, prompt_ids: list[int], new_tokens: int, on_tokens: Callable[[int], None]):
        self.llm.reset()
        ids: list[int] = []
        for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            ids.append(int(token))
            on_tokens(1)
            if len(ids) == new_tokens:
                break
        return ids, "length"


ENGINES: dict[str, type] = {"zllm": ZllmRunner, "transformers": TransformersRunner,
                            "llama.cpp": LlamaCppPythonRunner}


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
    runner.load(spec)
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
        "how": "in-process (llama_cpp Python API)" if spec["engine"] == "llama.cpp" else "in-process",
    }


def _batch_result(engine: str, prompts: list[list[int]], stamps: list[tuple[float, int]], decode_from: float,
                  first: list[float], start: float, end: float, threads: int,
                  versions: dict[str, str]) -> dict[str, Any]:
    """Aggregate rates of one batched run. ``stamps``: (time, tokens delivered) for every
    delivery; ``decode_from``: when every sequence had its first token, so the tokens after it
    are pure decode rounds."""
    ttfts = sorted(f - start for f in first)
    generated = sum(n for _, n in stamps)
    decoded = sum(n for t, n in stamps if t > decode_from)
    return {"engine": engine, "mode": "batch", "requests": len(prompts), "generated_tokens": generated,
            "ttft_s": ttfts[0], "ttft_p50_s": ttfts[len(ttfts) // 2], "total_s": end - start,
            "tok_s": generated / (end - start),
            "decode_tok_s": decoded / (end - decode_from) if decoded and end > decode_from else None,
            "threads": threads, "versions": versions}


def batch_zllm(spec: dict[str, Any]) -> dict[str, Any]:
    """All ``prompts`` submitted at once to one in-process ``Engine`` (continuous batching,
    ``max_num_seqs`` = the number of prompts, KV for all of them), streams drained round-robin
    from one thread: every ``next`` on a stream whose tokens are not there yet runs one engine
    step, which serves every sequence."""
    import torch

    runner = ZllmRunner()
    runner.import_libs()
    torch.set_num_threads(spec["threads"])
    prompts = spec["prompts"]
    runner.load({**spec, "prompt_ids": prompts[0]}, seqs=len(prompts))
    runner.generate(spec["warmup_prompts"][0], WARMUP_TOKENS, lambda k: None)

    start = time.perf_counter()
    streams = {i: runner.engine.generate_stream(runner.request(p, spec["new_tokens"])) for i, p in enumerate(prompts)}
    first: dict[int, float] = {}
    stamps: list[tuple[float, int]] = []
    while streams:
        for i, stream in list(streams.items()):
            event = next(stream, None)
            if event is None:
                del streams[i]
            elif event.get("token_ids"):
                now = time.perf_counter()
                first.setdefault(i, now)
                stamps.append((now, len(event["token_ids"])))
    end = time.perf_counter()
    return _batch_result("zllm", prompts, stamps, max(first.values()), list(first.values()), start, end,
                         torch.get_num_threads(), runner.versions())


def batch_transformers(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers' batched ``generate`` over ``prompts`` (left padding, greedy, exactly
    ``new_tokens`` each): the time to the first generated token of the batch and in all."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    runner = TransformersRunner()
    runner.import_libs()
    torch.set_num_threads(spec["threads"])
    runner.load(spec)
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
    # Every step hands out one token per sequence; the first step ends the batched prefill.
    stamps = [(t, len(ids)) for t in steps]
    return _batch_result("transformers", spec["prompts"], stamps, steps[0], [steps[0]] * len(ids), start, end,
                         torch.get_num_threads(), runner.versions())


def batch(spec: dict[str, Any]) -> dict[str, Any]:
    return (batch_zllm if spec.get("engine", "transformers") == "zllm" else batch_transformers)(spec)


def bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    """Memory read bandwidth as ``torch.sum`` sees it with ``threads`` threads: best of repeated
    sums over a 2 GiB f32 tensor (DRAM) and over 16-128 MiB tensors (the best of those sizes
    is the in-cache figure: the data is resident after the first pass)."""
    import torch

    torch.set_num_threads(spec["threads"])

    def best_gb_s(mib: int, repeats: int) -> float:
        x = torch.ones(mib * (1 << 20) // 4)
        x.sum()
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
        return best / 1e9

    dram = best_gb_s(2048, 5)
    cache = {mib: best_gb_s(mib, 20) for mib in (16, 32, 64, 128)}
    mib = max(cache, key=cache.get)
    return {"threads": torch.get_num_threads(), "dram_mib": 2048, "dram_gb_s": dram, "cache_mib": mib,
            "cache_gb_s": cache[mib], "cache_curve_gb_s": cache}


def profile(spec: dict[str, Any]) -> dict[str, Any]:
    from profile_decode import profile_zllm

    return profile_zllm(spec)


MODES = {"measure": measure, "batch": batch, "bandwidth": bandwidth, "profile": profile}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    result = MODES[spec.get("mode", "measure")](spec)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(sys.argv))
