"""Decode throughput of a ~1B-parameter Llama on one GPU: tokens/s at batch 1 and 32, and how
close each decode step comes to the memory bandwidth.

``python bench/gpu_decode.py [--backend cuda] [--device cuda:0] [--out DIR]``
(``--device cpu --backend cpu --tiny`` runs the same path at toy size, without a GPU).

The model (default: hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 32000,
untied head: 1.1 B parameters) gets random bf16 weights created on the device — no
checkpoint file. It goes through the loader's own steps with the checkpoint left out
(``select_backend``, the device capability check, ``BoundOps``, ``family.build``), then
into ``zllm.Engine``, whose runtime (scheduler, model runner, sampler) runs every step.

For each batch size ``B``: ``B`` requests of ``--prompt-tokens`` random ids are prefilled,
``--warmup`` decode rounds run, then ``--steps`` decode rounds are timed (each round ends
with the sampled tokens read back to the host, so its wall time is complete). Reported:

- ``decode_tokens_per_s = B * steps / seconds``;
- ``weight_bytes_per_step``: every weight byte except the embedding table (a decode round
  reads all of them once; the embedding only ``B`` rows), and the KV-cache bytes read;
- ``weight_bandwidth_pct``: ``weight_bytes_per_step / step_seconds`` as a share of the
  device-to-device copy bandwidth measured here (``2 * bytes / seconds`` of a large
  ``copy_``: each byte is read once and written once).

Writes ``gpu_decode.json`` and ``gpu_decode.md`` under ``--out``. Asserts nothing on speed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from zllm.engine.engine import Engine
from zllm.engine.loader import LoadedModel, check_device_capabilities
from zllm.kernels.bound import BoundOps
from zllm.plugins.host import PluginHost
from zllm.plugins.selection import select_backend
from zllm.spec.config import BackendConfig, KvCacheConfig, ModelConfig, RuntimeConfig, ZllmConfig
from zllm.spec.errors import ZllmError
from zllm.tokenizer import Tokenizer
from zllm.weights.formats import DTYPE_OF_FORMAT

#: HF ``config.json`` fields of the models measured.
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=32000)
LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256)
BLOCK_SIZE = 16
INIT_STD = 0.02  # Llama's initializer_range: keeps activations and logits in a realistic range


def hf_config(size: dict, context: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": context, "tie_word_embeddings": False, **size}


def random_weights(specs: dict, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Every required tensor of ``specs``, drawn on ``device``: norms 1, matrices N(0, INIT_STD^2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, spec in specs.items():
        if spec.optional:
            continue
        if len(spec.shape) == 1:
            weights[name] = torch.ones(spec.shape, dtype=dtype, device=device)
        else:
            weights[name] = torch.empty(spec.shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=g)
    return weights


def word_tokenizer(vocab: int) -> Tokenizer:
    """A tokenizer whose ids are the words ``t0 .. t{vocab-1}``: the runtime detokenizes every output."""
    hf = HFTokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return Tokenizer(hf, source="random", bos_token_id=None, eos_token_ids=(), add_bos=False, add_eos=False)


def build_engine(args: argparse.Namespace) -> tuple[Engine, dict]:
    """The engine over a random model, and what was built (parameter count, weight bytes)."""
    size = LLAMA_TINY if args.tiny else LLAMA_1B
    context = args.prompt_tokens + args.warmup + args.steps + max(args.batches) + 8
    host = PluginHost()
    info = host.families["llama"]
    family = info.load()
    spec = family.parse_config(hf_config(size, context), "random weights")
    specs = family.tensor_specs(spec)
    formats = {name: args.dtype for name, s in specs.items() if not s.optional}
    needed = family.required_capabilities(spec, formats)
    t0 = time.perf_counter()
    choice = select_backend(host, args.backend, needed, info.name)
    backend = choice.cls(threads=None, device=args.device)
    check_device_capabilities(backend, needed, choice.info.name, info.name)
    ops = BoundOps(host.kernels, choice.info.name, needed, ops=host.ops)
    weights = random_weights(specs, DTYPE_OF_FORMAT[args.dtype], backend.device, args.seed)
    model = family.build(spec, weights, ops)
    max_batch = max(args.batches)
    blocks = max_batch * math.ceil(context / BLOCK_SIZE) + 1
    cfg = ZllmConfig(model=ModelConfig(path=f"random {args.dtype} weights on {backend.device}"),
                     backend=BackendConfig(name=choice.info.name),
                     runtime=RuntimeConfig(kv_cache=KvCacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks),
                                           max_num_seqs=max_batch, max_prefill_tokens=max(args.prompt_tokens, 16),
                                           prefix_cache_seqs=0))
    loaded = LoadedModel(cfg, None, info, spec, choice, backend, ops, model, word_tokenizer(spec.vocab_size),
                         frozenset(), context, time.perf_counter() - t0, blocks)
    embed = "model.embed_tokens.weight"
    built = {
        "parameters": sum(w.numel() for w in weights.values()),
        "weight_bytes": sum(w.numel() * w.element_size() for w in weights.values()),
        "embedding_bytes": weights[embed].numel() * weights[embed].element_size(),
        "config": hf_config(size, context), "backend": choice.info.name, "device": str(backend.device),
        "kernels": {e.capability: e.kernel for e in ops.explain()},
    }
    return Engine(loaded, host), built


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s: ``2 * nbytes / seconds`` (read + write), best of ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats + 1):  # the first copy warms up
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_decode(engine: Engine, batch: int, args: argparse.Namespace) -> dict:
    """Decode tokens/s of ``batch`` concurrent sequences, timed over ``args.steps`` decode rounds."""
    llm = engine.llm
    g = torch.Generator().manual_seed(args.seed + batch)
    vocab = engine.loaded.model.vocab_size
    seqs = []
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()
        # Prefills run one per step, so the first sequence decodes ``batch`` rounds before the
        # last one starts: room for those keeps every sequence running through the timed rounds.
        request = engine.parse({"prompt_token_ids": prompt, "max_tokens": args.warmup + args.steps + batch + 1,
                                "temperature": 0.0, "ignore_eos": True})
        seqs.append(llm.add_request(request, prompt, request.max_tokens))
    while any(not s.output_ids for s in seqs):  # prefill every prompt (its first token included)
        llm.step()
    for _ in range(args.warmup):
        llm.step()
    context = seqs[0].num_tokens
    t0 = time.perf_counter()
    for _ in range(args.steps):
        outputs = llm.step()
        assert len(outputs) == batch, "a timed step must be a decode round of every sequence"
    seconds = time.perf_counter() - t0
    for seq in seqs:
        llm.abort(seq)
    return {"batch": batch, "steps": args.steps, "seconds": seconds, "step_ms": 1e3 * seconds / args.steps,
            "decode_tokens_per_s": batch * args.steps / seconds, "context_tokens_at_start": context}


def kv_bytes_per_step(engine: Engine, batch: int, context: int, steps: int) -> int:
    """KV-cache bytes a decode round reads: every cached key and value of every sequence (mid-run context)."""
    kv = engine.llm.runner.kv
    per_token = kv.spec.token_bytes(kv.layers[0][0].dtype.itemsize)
    return batch * (context + steps // 2) * per_token


def render_md(result: dict) -> str:
    built = result["model"]
    lines = [
        "# zllm decode benchmark",
        "",
        f"Model: random Llama, {built['parameters'] / 1e9:.3f} B parameters "
        f"({result['dtype']}, {built['weight_bytes'] / 2**30:.2f} GiB), backend `{built['backend']}` on "
        f"`{built['device']}` ({result['device_name']}); torch {result['torch']}.",
        f"Device-to-device copy bandwidth: {result['copy_bandwidth_GBps']:.0f} GB/s.",
        "",
        "| batch | decode tok/s | step ms | weight GB/s | % of copy bandwidth | KV MB read per step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        lines.append(f"| {r['batch']} | {r['decode_tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
                     f"{r['weight_GBps']:.0f} | {r['weight_bandwidth_pct']:.1f} | {r['kv_bytes_per_step'] / 1e6:.1f} |")
    lines += ["", "Kernels bound:", "", *(f"- `{cap}` -> `{kernel}`" for cap, kernel in built["kernels"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda", help="backend name (default cuda)")
    parser.add_argument("--device", default="cuda:0",
                        help="device for the backend (default cuda:0; 'cpu' for the cpu backend)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"), help="weight dtype (default bf16)")
    parser.add_argument("--tiny", action="store_true", help="a toy model instead of the 1B one (checks the script)")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes (default 1,32)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length per sequence (default 128)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed decode rounds (default 8)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode rounds (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "gpu")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]

    try:
        engine, built = build_engine(args)
    except ZllmError as exc:  # no device, a backend that cannot run the model: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = engine.loaded.backend.device
    print(f"model: {built['parameters']:,} parameters ({built['parameters'] / 1e9:.3f} B), "
          f"{built['weight_bytes'] / 2**30:.2f} GiB of {args.dtype} weights on {device}", flush=True)
    bandwidth = copy_bandwidth(device, min(1 << 30, max(built["weight_bytes"], 64 << 20)))
    streamed = built["weight_bytes"] - built["embedding_bytes"]
    runs = []
    for batch in args.batches:
        run = measure_decode(engine, batch, args)
        run["weight_bytes_per_step"] = streamed
        run["kv_bytes_per_step"] = kv_bytes_per_step(engine, batch, run["context_tokens_at_start"], args.steps)
        run["weight_GBps"] = streamed / (run["seconds"] / args.steps) / 1e9
        run["weight_bandwidth_pct"] = 100 * run["weight_GBps"] * 1e9 / bandwidth
        runs.append(run)
        print(f"batch {batch:3d}: {run['decode_tokens_per_s']:9.1f} tok/s, {run['step_ms']:7.2f} ms/step, "
              f"weights {run['weight_GBps']:7.0f} GB/s = {run['weight_bandwidth_pct']:5.1f}% of copy bandwidth",
              flush=True)
    result = {
        "model": built, "dtype": args.dtype, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "copy_bandwidth_GBps": bandwidth / 1e9, "prompt_tokens": args.prompt_tokens, "warmup": args.warmup,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "gpu_decode.md").write_text(render_md(result), encoding="utf-8")
    print(f"wrote {args.out / 'gpu_decode.json'} and {args.out / 'gpu_decode.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
