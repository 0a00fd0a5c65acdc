"""A gpt-oss-shaped MoE with MXFP4 experts, HF and GGUF, side by side: ``.venv/bin/python
bench/gpt_oss_moe.py`` (``make bench-gpt-oss``).

The checkpoint: a random ``GptOssForCausalLM`` saved by transformers (``tests/gpt_oss_checkpoint.py``'s
writer: GPT-2 BPE + harmony's specials, widened weights), made the way the released gpt-oss
files are stored: experts in MXFP4 (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``, values
from zllm's quantizer written from the format's definition), everything else bf16. Shape
(``--size``): ``bench`` = hidden 1024, 12 layers, 16 / 4 heads of 64, 32 experts of 1024, top-4,
alternating sliding-window (128) and full layers, YaRN as released (~1.3B parameters, ~0.2B
active); ``tiny`` = the test model's shape, for the smoke test. The GGUF file is what llama.cpp's
own converter writes from that directory (``tests/llama_cpp_converter``, ``--outtype bf16``:
MXFP4 experts stay MXFP4 in ggml's block layout, the rest bf16).

Rows, interleaved in every round (fresh processes, medians over ``--rounds``): zllm on the HF
directory, zllm on the GGUF file, llama.cpp's ``llama-bench`` on the same GGUF file (built from
the ``llama-cpp-python`` sdist by ``bench/llama_cpp_peer.py``; ``--no-llama-cpp`` skips it) and
transformers on the HF directory (on a CPU it dequantizes the MXFP4 experts at load, so it runs
bf16 experts, with its eager attention: gpt-oss's sinks have no sdpa path; ``--no-transformers``
skips it). ``% of BW limit``: the bytes a decode token reads —
every stored tensor but the embedding table, counting ``top-k / E`` of each expert stack — at
``torch.sum``'s read bandwidth. Ratios: zllm HF / zllm GGUF (the same bits), zllm GGUF /
llama.cpp, zllm HF / transformers. Writes ``bench/out/gpt_oss_moe.json``. Nothing here asserts on
timings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from models import GENERATED, OUT  # noqa: E402
from quant_models import per_round_ratio  # noqa: E402
from run import best_bandwidth, limit_bandwidth, measure_bandwidth, random_prompt, resolve_llama_cpp, run_worker  # noqa: E402

CONVERTER = REPO / "tests" / "llama_cpp_converter" / "convert_hf_to_gguf.py"
#: ``save_gpt_oss`` overrides per ``--size``.
SIZES: dict[str, dict[str, Any]] = {
    "bench": dict(
        hidden_size=1024, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    ),
    "tiny": {},
}
_DONE = ".gpt-oss-complete"


def ensure_checkpoint(size: str, work: Path) -> Path:
    """The MXFP4 HF directory of ``size``, written once into ``work``."""
    from tests.gpt_oss_checkpoint import save_bf16_copy, save_gpt_oss, save_mxfp4_copy

    dst = work / f"gpt-oss-{size}-mxfp4"
    if (dst / _DONE).exists():
        return dst
    print(f"[bench] writing {dst.name} (once) ...", flush=True)
    import shutil

    f32, bf16 = work / f"gpt-oss-{size}-f32", work / f"gpt-oss-{size}-bf16"
    for d in (f32, bf16, dst):
        shutil.rmtree(d, ignore_errors=True)
    save_gpt_oss(f32, **SIZES[size])
    save_bf16_copy(f32, bf16)
    shutil.rmtree(f32)
    save_mxfp4_copy(bf16, dst)
    shutil.rmtree(bf16)
    (dst / _DONE).write_text(json.dumps(SIZES[size]) + "\n")
    return dst


def ensure_gguf(hf_dir: Path) -> Path:
    """llama.cpp's converter's GGUF file of ``hf_dir`` (bf16 outtype, MXFP4 experts kept), once."""
    out = hf_dir.with_name(hf_dir.name + ".gguf")
    if out.exists():
        return out
    print(f"[bench] converting {hf_dir.name} with llama.cpp's convert_hf_to_gguf.py (once) ...", flush=True)
    tmp = out.with_suffix(".partial")
    proc = subprocess.run([sys.executable, str(CONVERTER), str(hf_dir), "--outtype", "bf16", "--outfile", str(tmp)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
    tmp.rename(out)
    return out


def _expert_share(name: str, cfg: dict[str, Any]) -> float:
    """The share of a stored tensor one decode token reads: ``top-k / E`` of an expert stack (and
    of its biases and scales; HF ``*.experts.*``, GGUF ``ffn_*_exps*``), else all of it."""
    return cfg["num_experts_per_tok"] / cfg["num_local_experts"] if ".experts." in name or "_exps" in name else 1.0


def bytes_per_token(path: Path, cfg: dict[str, Any]) -> int:
    """Bytes a batch-1 decode token reads from ``path`` (HF directory or GGUF file): every stored
    tensor but the embedding table, expert stacks at ``top-k / E``."""
    sizes: list[tuple[str, int]] = []
    if path.is_dir():
        for f in path.glob("*.safetensors"):
            with f.open("rb") as fh:
                header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            sizes += [(k, e["data_offsets"][1] - e["data_offsets"][0])
                      for k, e in header.items() if k != "__metadata__"]
    else:
        from gguf import GGUFReader

        sizes = [(t.name, int(t.n_bytes)) for t in GGUFReader(str(path)).tensors]
    return int(sum(n * _expert_share(k, cfg) for k, n in sizes
                   if k not in ("model.embed_tokens.weight", "token_embd.weight")))


def measure(size: str, rounds: int, threads: int, prompt_len: int, new_tokens: int, work: Path,
            transformers: bool, llama_cpp: bool, bandwidth: bool, timeout: float, seed: int = 0) -> dict[str, Any]:
    """Build what is missing, run ``rounds`` interleaved rounds of every row; the report dict."""
    from tests.gpt2_bpe import GPT2_VOCAB_SIZE
    from tests.gpt_oss_checkpoint import RETURN_ID, VOCAB

    hf_dir = ensure_checkpoint(size, work)
    gguf = ensure_gguf(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    rng = random.Random(seed)
    info = {"bos_token_id": None, "eos_token_ids": [RETURN_ID], "vocab_size": GPT2_VOCAB_SIZE}  # plain GPT-2 ids
    prompt, warmup = random_prompt(rng, prompt_len, info), random_prompt(rng, prompt_len, info)
    peer = resolve_llama_cpp("bench") if llama_cpp else {"kind": None, "why": "--no-llama-cpp"}
    rows: dict[str, dict[str, Any]] = {
        "zllm hf-mxfp4": {"engine": "zllm", "model_path": str(hf_dir)},
        "zllm gguf-mxfp4": {"engine": "zllm", "model_path": str(gguf)},
    }
    if peer["kind"] == "llama-bench":
        rows["llama.cpp gguf-mxfp4"] = {"engine": "llama-bench", "model_path": str(gguf)}
    if transformers:
        rows["transformers hf-mxfp4"] = {"engine": "transformers", "model_path": str(hf_dir), "dtype": "bf16",
                                            "attn_implementation": "eager"}  # its sdpa has no sinks
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    bandwidths = [measure_bandwidth(threads, timeout)] if bandwidth else []
    for r in range(rounds):
        for row, spec in rows.items():
            if r and all("error" in x for x in runs[row]):
                continue
            if spec["engine"] == "llama-bench":
                import llama_cpp_peer

                try:
                    res = llama_cpp_peer.run_llama_bench(Path(peer["binary"]), gguf, prompt_len, new_tokens, threads,
                                                         timeout)
                except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
                    res = {"error": str(exc)}
            else:
                res = run_worker({**spec, "prompt_ids": prompt, "warmup_ids": warmup, "new_tokens": new_tokens,
                                  "threads": threads}, threads, timeout)
            print(f"[bench] round {r + 1}/{rounds} {row}: "
                  + (res["error"] + " " + res.get("stderr_tail", "")[-300:] if "error" in res else
                     f"decode {res['decode_tok_s']:.2f} tok/s, prefill {res['prefill_tok_s']:.1f} tok/s"), flush=True)
            runs[row].append(res)
    if bandwidth:
        bandwidths.append(measure_bandwidth(threads, timeout))
    bw = best_bandwidth(*bandwidths) if bandwidths else {"error": "not measured"}
    summary: dict[str, Any] = {}
    for row, results in runs.items():
        ok = [x for x in results if "error" not in x]
        if not ok:
            summary[row] = {"error": results[0]["error"], "stderr_tail": results[0].get("stderr_tail", "")}
            continue
        s = summary[row] = {key: statistics.median(x[key] for x in ok) for key in ("decode_tok_s", "prefill_tok_s")}
        s["decode_range"] = [min(x["decode_tok_s"] for x in ok), max(x["decode_tok_s"] for x in ok)]
        nbytes = bytes_per_token(Path(rows[row]["model_path"]), cfg)
        limit = limit_bandwidth(bw, nbytes) if "error" not in bw else None
        s["bytes_per_token"] = nbytes
        s["pct_of_bw_limit"] = s["decode_tok_s"] * nbytes / limit if limit else None
    for row, other, key in (("zllm hf-mxfp4", "zllm gguf-mxfp4", "vs_zllm_gguf"),
                            ("zllm gguf-mxfp4", "llama.cpp gguf-mxfp4", "vs_llama_cpp"),
                            ("zllm hf-mxfp4", "transformers hf-mxfp4", "vs_transformers")):
        a, b = summary.get(row), summary.get(other)
        if a and b and "error" not in a and "error" not in b:
            a[key] = {"decode": per_round_ratio(runs[row], runs[other], "decode_tok_s"),
                      "prefill": per_round_ratio(runs[row], runs[other], "prefill_tok_s")}
    return {"size": size, "config": {k: cfg.get(k) for k in (*SIZES["bench"], "vocab_size")},
            "rounds": rounds, "threads": threads, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
            "llama_cpp": peer.get("source") or peer.get("why"), "vocab": VOCAB,
            "bandwidth": {k: bw.get(k) for k in ("dram_gb_s", "cache_curve_gb_s")}, "rows": summary, "runs": runs}


def format_table(report: dict[str, Any]) -> str:
    """The Markdown table of a :func:`measure` report."""
    def ratio(s: dict[str, Any], key: str) -> str:
        r = s.get(key)
        return "—" if not r or r["decode"] is None else f"{r['decode']:.2f}x / {r['prefill']:.2f}x"

    lines = ["| row | MiB read / token | decode tok/s (min-max) | % of BW limit | prefill tok/s "
             "| HF / GGUF (decode / prefill) | zllm / llama.cpp | zllm / transformers |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for row, s in report["rows"].items():
        if "error" in s:
            lines.append(f"| {row} | — | failed: {s['error']} | | | | | |")
            continue
        lo, hi = s["decode_range"]
        pct = "—" if s["pct_of_bw_limit"] is None else f"{s['pct_of_bw_limit']:.0%}"
        lines.append(f"| {row} | {s['bytes_per_token'] / (1 << 20):.0f} | {s['decode_tok_s']:.2f} ({lo:.2f}-{hi:.2f}) "
                     f"| {pct} | {s['prefill_tok_s']:.1f} | {ratio(s, 'vs_zllm_gguf')} | {ratio(s, 'vs_llama_cpp')} "
                     f"| {ratio(s, 'vs_transformers')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="bench", choices=sorted(SIZES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth measurement (no %% of limit)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker")
    p.add_argument("--work", type=Path, default=GENERATED, help="where the checkpoint and GGUF file are written")
    p.add_argument("--out", type=Path, default=OUT / "gpt_oss_moe.json")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = measure(args.size, args.rounds, args.threads, args.prompt, args.new_tokens, args.work,
                     not args.no_transformers, not args.no_llama_cpp, not args.no_bandwidth, args.timeout)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
