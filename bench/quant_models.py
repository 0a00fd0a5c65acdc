"""Quantized HF checkpoints end to end: ``.venv/bin/python bench/quant_models.py`` (``make bench-quant``).

The bench's random ``llama-0.5b`` (:mod:`models`) written as quantized HF directories the way
their quantizers lay them out (the writers of ``tests/quant_checkpoints.py``, values from
``zllm.conformance.quantizers``): FP8 with DeepSeek-V3's 128 x 128 blocks (transformers
``fp8``), W4A16 (compressed-tensors ``pack-quantized`` int4, asymmetric groups of 128), W8A16
(``pack-quantized`` int8, symmetric per channel) and MXFP4 (compressed-tensors
``mxfp4-pack-quantized``). Their unquantized tensors (embeddings, norms, ``lm_head``) are
bf16, as in the uploads people download. Beside them, zllm's own Q8_0 and Q4_0 GGUF files of
the same model (every 2-D tensor quantized, ``bench/gguf_export.py``'s gguf-package writer).

Every row is one fresh ``bench/worker.py`` process (load, warm-up, one greedy generation:
prefill tokens/s, batch-1 decode tokens/s, load time, peak-RSS growth), all rows of a round
before the next round (interleaved: a busy spell hits every row of its round), medians over
the rounds. transformers runs the directories it can load on a CPU (it dequantizes them at
load; the rows say in which dtype), and the rows it cannot say why. Ratios: decode against
zllm's GGUF at about the same bits (FP8 / W8A16 vs Q8_0, W4A16 / MXFP4 vs Q4_0) — the GGUF
with bf16 embeddings and output as the HF directories have (its linear layers are then the
only difference), and the GGUF with every 2-D tensor quantized — decode
against the bandwidth limit of the bytes a token reads (every stored tensor but the embedding
table), prefill against the Q8_0 GGUF, and zllm against transformers on the same directory.
Writes ``bench/out/quant_models.json``. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from models import GENERATED, MODELS, OUT, ensure, gguf_path  # noqa: E402
from run import best_bandwidth, limit_bandwidth, measure_bandwidth, random_prompt, run_worker  # noqa: E402

#: HF layouts: name -> (zllm format, the GGUF type of its linear layers' peer, how it is written).
HF_LAYOUTS = {
    "fp8-block": ("fp8_e4m3", "q8_0", "transformers fp8, weight_block_size [128, 128]"),
    "w8a16": ("int8_g", "q8_0", "compressed-tensors pack-quantized int8, symmetric per channel"),
    "w4a16": ("int4_g", "q4_0", "compressed-tensors pack-quantized int4, asymmetric groups of 128"),
    "mxfp4": ("mxfp4", "q4_0", "compressed-tensors mxfp4-pack-quantized"),
}
#: The suffix of a GGUF row whose token_embd and output stay bf16, as the HF directories keep
#: their embeddings and lm_head: its linear layers are the only difference from an HF row.
BF16_ENDS = "-bf16-ends"
GGUF_TYPES = ("q8_0", "q4_0")
GGUF_ROWS = (*GGUF_TYPES, *(t + BF16_ENDS for t in GGUF_TYPES))
#: transformers' dtype per layout it is tried on. Not W4A16: its compressed-tensors path refuses
#: the packed zero points of an asymmetric int4 scheme (tests/parity/test_quant_hf_vs_transformers.py);
#: MXFP4 decompresses to bf16 only. A row that fails its first round is not run again.
TRANSFORMERS = {"fp8-block": "f32", "w8a16": "f32", "mxfp4": "bf16"}
_DONE = ".quant-complete"


def _bf16_source(name: str, work: Path) -> Path:
    """``name``'s checkpoint with every tensor in bf16 (what quantized uploads keep dense)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = ensure(name)
    dst = work / f"{name}-bf16"
    if (dst / _DONE).exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("."):
            shutil.copy(f, dst / f.name)
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / _DONE).write_text("bf16\n")
    return dst


def ensure_hf_layout(name: str, layout: str, work: Path = GENERATED) -> Path:
    """The quantized HF directory of ``name`` in ``layout`` (a :data:`HF_LAYOUTS` key), written
    once into ``work``."""
    from tests import quant_checkpoints as qc

    dst = work / f"{name}-{layout}"
    if (dst / _DONE).exists():
        return dst
    src = _bf16_source(name, work)
    print(f"[bench] writing {dst.name} (once) ...", flush=True)
    if layout == "fp8-block":
        qc.write_fp8(src, dst, (128, 128))
    elif layout == "w4a16":
        qc.write_compressed_tensors(src, dst, "w4a16", group=128)
    else:
        qc.write_compressed_tensors(src, dst, layout)
    (dst / _DONE).write_text(HF_LAYOUTS[layout][2] + "\n")
    return dst


def ensure_gguf_row(name: str, row: str, work: Path = GENERATED) -> Path:
    """``name`` as the GGUF file of ``row`` (a :data:`GGUF_ROWS` entry: ``q8_0`` / ``q4_0``, with
    :data:`BF16_ENDS` its embeddings and output in bf16): a shipped one, else written once by the
    gguf package (beside a generated checkpoint, or into ``work`` for a shipped one)."""
    from gguf_export import export_gguf, written_by

    model = MODELS[name]
    dtype = row.removesuffix(BF16_ENDS)
    dense_ends = "bf16" if row != dtype else None
    shipped = dtype in model.shipped_gguf or model.create is not None
    path = gguf_path(name, dtype) if shipped else work / f"{name}-{dtype.upper()}.gguf"
    if dense_ends:
        path = path.with_name(path.stem + BF16_ENDS.upper() + path.suffix)
    if written_by(path) is None:
        print(f"[bench] writing {path.name} (once) ...", flush=True)
        export_gguf(ensure(name), path, dtype, writer="gguf", dense_ends=dense_ends)
    return path


def bytes_per_token(path: Path) -> int:
    """Bytes a decode token reads: every stored tensor but the embedding table (one row of it
    is read), from the safetensors headers or the GGUF tensor table."""
    if path.is_dir():
        total = 0
        for f in path.glob("*.safetensors"):
            with f.open("rb") as fh:
                header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            total += sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()
                         if k != "__metadata__" and k != "model.embed_tokens.weight")
        return total
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if t.name != "token_embd.weight")


def measure(name: str, layouts: list[str], rounds: int, threads: int, prompt_len: int, new_tokens: int,
            hf: bool, timeout: float, work: Path = GENERATED, bandwidth: bool = True,
            partial: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """Build what is missing (into ``work``), then ``rounds`` interleaved rounds of every row
    (the raw runs so far written to ``partial`` after each round); the report dict."""
    paths: dict[str, Path] = {layout: ensure_hf_layout(name, layout, work) for layout in layouts}
    paths.update({dtype: ensure_gguf_row(name, dtype, work) for dtype in GGUF_ROWS})
    info = json.loads((ensure(name) / "config.json").read_text())
    info = {"bos_token_id": info.get("bos_token_id"), "eos_token_ids": [info.get("eos_token_id")],
            "vocab_size": info["vocab_size"]}
    rng = random.Random(seed)
    prompt, warmup = random_prompt(rng, prompt_len, info), random_prompt(rng, prompt_len, info)
    rows = [("zllm", key) for key in paths]
    rows += [("transformers", k) for k in layouts if k in TRANSFORMERS] if hf else []
    runs: dict[str, list[dict[str, Any]]] = {f"{engine} {key}": [] for engine, key in rows}
    bandwidths = [measure_bandwidth(threads, timeout)] if bandwidth else []
    for r in range(rounds):
        for engine, key in rows:
            if r and all("error" in x for x in runs[f"{engine} {key}"]):
                continue
            spec = {"engine": engine, "model_path": str(paths[key]), "dtype": TRANSFORMERS.get(key, "f32"),
                    "prompt_ids": prompt, "warmup_ids": warmup, "new_tokens": new_tokens, "threads": threads}
            res = run_worker(spec, threads, timeout)
            print(f"[bench] round {r + 1}/{rounds} {engine} {key}: "
                  + (res["error"] + " " + res.get("stderr_tail", "")[-300:] if "error" in res else
                     f"decode {res['decode_tok_s']:.2f} tok/s, prefill {res['prefill_tok_s']:.1f} tok/s"),
                  flush=True)
            runs[f"{engine} {key}"].append(res)
        if partial is not None:
            partial.write_text(json.dumps({"paths": {k: str(v) for k, v in paths.items()}, "runs": runs,
                                           "bandwidths": bandwidths}) + "\n")
    if bandwidth:
        bandwidths.append(measure_bandwidth(threads, timeout))
    report = summarize(name, paths, runs, bandwidths)
    report.update(threads=threads, prompt_tokens=prompt_len, new_tokens=new_tokens)
    return report


def summarize(name: str, paths: dict[str, Path], runs: dict[str, list[dict[str, Any]]],
              bandwidths: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per row and the ratios, from the raw ``runs`` (row -> one result per round)."""
    bw = best_bandwidth(*bandwidths) if bandwidths else {"error": "not measured"}
    summary: dict[str, Any] = {}
    for row, results in runs.items():
        ok = [x for x in results if "error" not in x]
        if not ok:
            summary[row] = {"error": results[0]["error"], "stderr_tail": results[0].get("stderr_tail", "")}
            continue
        summary[row] = {key: statistics.median(x[key] for x in ok) for key in
                        ("decode_tok_s", "prefill_tok_s", "load_s", "peak_rss_growth_bytes")}
        summary[row]["decode_range"] = [min(x["decode_tok_s"] for x in ok), max(x["decode_tok_s"] for x in ok)]
        summary[row]["runs"] = len(ok)
    for key, path in paths.items():
        row = summary.get(f"zllm {key}")
        if row is None or "error" in row:
            continue
        nbytes = bytes_per_token(path)
        limit = limit_bandwidth(bw, nbytes) if "error" not in bw else None
        row["bytes_per_token"] = nbytes
        row["stored_bytes"] = sum(f.stat().st_size for f in ([path] if path.is_file() else path.glob("*.safetensors")))
        row["pct_of_bw_limit"] = row["decode_tok_s"] * nbytes / limit if limit else None
        q8 = summary.get("zllm q8_0")
        hf_row = summary.get(f"transformers {key}")
        if key in HF_LAYOUTS:
            for field, peer_row in (("decode_vs_gguf", HF_LAYOUTS[key][1] + BF16_ENDS),
                                    ("decode_vs_gguf_all", HF_LAYOUTS[key][1])):
                peer = summary.get(f"zllm {peer_row}")
                if peer and "error" not in peer:
                    row[field] = per_round_ratio(runs[f"zllm {key}"], runs[f"zllm {peer_row}"], "decode_tok_s")
        if q8 and "error" not in q8 and key != "q8_0":
            row["prefill_vs_q8_0"] = per_round_ratio(runs[f"zllm {key}"], runs["zllm q8_0"], "prefill_tok_s")
        if hf_row and "error" not in hf_row:
            row["decode_vs_transformers"] = row["decode_tok_s"] / hf_row["decode_tok_s"]
            row["prefill_vs_transformers"] = row["prefill_tok_s"] / hf_row["prefill_tok_s"]
    return {"model": name, "weights": weights_per_token(name), "rounds": max(map(len, runs.values())),
            "bandwidth": {k: bw.get(k) for k in ("dram_gb_s", "cache_curve_gb_s")},
            "rows": summary}


def per_round_ratio(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> float | None:
    """Median over rounds of ``a[r][key] / b[r][key]`` (rounds where both ran)."""
    ratios = [x[key] / y[key] for x, y in zip(a, b, strict=False) if "error" not in x and "error" not in y]
    return statistics.median(ratios) if ratios else None


def format_table(report: dict[str, Any]) -> str:
    """The Markdown table of a :func:`measure` report."""
    def f(v: float | None, fmt: str) -> str:
        return "—" if v is None else fmt.format(v)

    lines = ["| row | bits/weight | decode tok/s (min-max) | % of BW limit | decode vs GGUF, bf16 ends "
             "| vs GGUF, all quantized | prefill tok/s | prefill vs Q8_0 | vs transformers (decode / prefill) "
             "| load s | peak RSS +MiB |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row, s in report["rows"].items():
        if "error" in s:
            lines.append(f"| {row} | — | failed: {s['error']} | | | | | | | | |")
            continue
        bits = s.get("bytes_per_token")
        lo, hi = s["decode_range"]
        vs_hf = (f"{s['decode_vs_transformers']:.2f}x / {s['prefill_vs_transformers']:.2f}x"
                 if "decode_vs_transformers" in s else "—")
        lines.append(
            f"| {row} | {f(8 * bits / report['weights'] if bits else None, '{:.2f}')} "
            f"| {s['decode_tok_s']:.2f} ({lo:.2f}-{hi:.2f}) | {f(s.get('pct_of_bw_limit'), '{:.0%}')} "
            f"| {f(s.get('decode_vs_gguf'), '{:.2f}x')} | {f(s.get('decode_vs_gguf_all'), '{:.2f}x')} "
            f"| {s['prefill_tok_s']:.1f} "
            f"| {f(s.get('prefill_vs_q8_0'), '{:.2f}x')} | {vs_hf} | {s['load_s']:.1f} "
            f"| {s['peak_rss_growth_bytes'] / (1 << 20):.0f} |")
    return "\n".join(lines)


def weights_per_token(name: str) -> int:
    """Weights a decode token reads (every 2-D weight but the embedding table), for bits/weight."""
    cfg = json.loads((ensure(name) / "config.json").read_text())
    h, ffn, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    return layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) + cfg["vocab_size"] * h


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-0.5b", choices=sorted(MODELS))
    p.add_argument("--layouts", default=",".join(HF_LAYOUTS), help="HF layouts to run (default: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefill)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth measurement (no %% of limit)")
    p.add_argument("--summarize", type=Path, help="only summarize the raw runs of an interrupted run's .partial file")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker")
    p.add_argument("--out", type=Path, default=OUT / "quant_models.json")
    p.add_argument("--work", type=Path, default=GENERATED, help="where the quantized copies are written")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = set(layouts) - set(HF_LAYOUTS)
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}; known: {', '.join(HF_LAYOUTS)}")
    if args.summarize:
        raw = json.loads(args.summarize.read_text())
        report = summarize(args.model, {k: Path(v) for k, v in raw["paths"].items()}, raw["runs"], raw["bandwidths"])
    else:
        report = measure(args.model, layouts, args.rounds, args.threads, args.prompt, args.new_tokens,
                         not args.no_transformers, args.timeout, args.work, not args.no_bandwidth,
                         args.out.with_suffix(".partial.json"))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
