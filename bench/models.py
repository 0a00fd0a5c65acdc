"""The benchmark's models: where each checkpoint lives, and how to create the ones we build.

A model is a name mapped to a :class:`BenchModel`. ``ensure(name)`` returns its Hugging Face
checkpoint directory, creating it first when the model is generated (random weights) and
not on disk yet; ``ensure_gguf(name, dtype)`` returns a GGUF file of it in one of
:data:`GGUF_DTYPES` (see :mod:`gguf_export` for how those are written). Add a model by adding
an entry to :data:`MODELS`.

Generated checkpoints go to ``bench/out/models/<name>/`` (``/bench/out/`` is gitignored) and
are written by transformers itself (``save_pretrained``), so they are exactly what an HF
user would load. They carry a ``tokenizer.json`` + ``tokenizer_config.json`` holding the real
32000-token Llama SentencePiece vocabulary (read from the shipped
``assets/models/llama.cpp-vocab/ggml-vocab-llama-spm.gguf``): zllm's HF loader and
llama.cpp's converter both need a tokenizer beside the weights. The benchmark feeds token
ids, so the tokenizer only matters for detokenizing the output.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
GENERATED = OUT / "models"
sys.path.insert(0, str(REPO))  # the test checkpoint writers (tests/) build some of the models
SPM_VOCAB = REPO / "assets" / "models" / "llama.cpp-vocab" / "ggml-vocab-llama-spm.gguf"
#: GGUF weight types the harness benchmarks, lower-case as in zllm configs and ``--outtype``.
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")

#: Written last into a generated checkpoint: its content says which layout wrote it, so a
#: checkpoint from an older harness (another tokenizer) is rebuilt rather than reused.
_DONE_MARKER = ".bench-complete"
_LAYOUT_VERSION = "layout=2"
_LAYOUT = f"{_LAYOUT_VERSION} (transformers save_pretrained, llama SPM tokenizer.json)"
_MOE_LAYOUT = f"{_LAYOUT_VERSION} (transformers save_pretrained, GPT-2 BPE tokenizer.json)"


@dataclass(frozen=True)
class BenchModel:
    """One benchmark model.

    Attributes:
        name: the ``--models`` name.
        path: the HF checkpoint directory (shipped) or where the generated one goes.
        description: one line for the README / report.
        create: builds the checkpoint into a directory; ``None`` for shipped checkpoints.
        shipped_gguf: GGUF files that ship with the repository, by dtype (used as they are).
    """

    name: str
    path: Path
    description: str
    create: Callable[[Path], None] | None = None
    shipped_gguf: dict[str, Path] = field(default_factory=dict)


def _llama_config(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, tied: bool) -> dict[str, Any]:
    """An HF ``LlamaConfig`` dict: vocab 32000, RMS eps 1e-5, RoPE theta 10000, SiLU, context 2048."""
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "vocab_size": 32000,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    }


# Shapes of llama2.c's stories15M and stories110M, and a Qwen2.5-0.5B-sized Llama with GQA.
LLAMA_15M_CONFIG = _llama_config(288, 6, 6, 6, 768, tied=True)
LLAMA_110M_CONFIG = _llama_config(768, 12, 12, 12, 2048, tied=True)
LLAMA_05B_CONFIG = _llama_config(1280, 24, 20, 10, 3328, tied=False)


def build_spm_tokenizer(directory: Path) -> None:
    """Write the Llama SentencePiece vocabulary of :data:`SPM_VOCAB` as an HF ``tokenizer.json``
    (BPE with byte fallback, as ``LlamaTokenizerFast`` saves it) plus ``tokenizer_config.json``.

    zllm builds the ``tokenizers`` model from the GGUF vocabulary (its GGUF tokenizer path);
    a ``<s> $A`` post-processor adds BOS as Llama's tokenizer does.
    """
    import gguf
    from tokenizers import processors

    from zllm.tokenizer.gguf_vocab import vocab_from_gguf_metadata

    reader = gguf.GGUFReader(str(SPM_VOCAB))
    vocab = vocab_from_gguf_metadata({k: f.contents() for k, f in reader.fields.items()}, str(SPM_VOCAB))
    tok = vocab.hf
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab.bos_token_id)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }, indent=2) + "\n")


def create_random_moe(directory: Path, config: dict[str, Any], seed: int = 0) -> None:
    """Save a randomly initialised MoE model of ``config["model_type"]`` (f32, safetensors,
    per-expert tensors as ``save_pretrained`` writes them) plus GPT-2's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.gpt2_bpe import write_gpt2_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / _DONE_MARKER).unlink(missing_ok=True)
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    write_gpt2_tokenizer(directory)
    (directory / _DONE_MARKER).write_text(f"{_MOE_LAYOUT}\nseed={seed}\n")


def create_random_llama(directory: Path, config: dict[str, Any], seed: int = 0) -> None:
    """Save a randomly initialised ``LlamaForCausalLM`` (f32, safetensors) plus a tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / _DONE_MARKER).unlink(missing_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**config)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=config["bos_token_id"],
                                               eos_token_id=config["eos_token_id"])
    model.save_pretrained(directory, safe_serialization=True)
    build_spm_tokenizer(directory)
    (directory / _DONE_MARKER).write_text(f"{_LAYOUT}\nseed={seed}\n")


def _generated(name: str, config: dict[str, Any], description: str) -> BenchModel:
    create = create_random_moe if "model_type" in config else create_random_llama
    return BenchModel(name=name, path=GENERATED / name, description=description,
                      create=lambda d: create(d, config))


_MOE_COMMON = {"vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 4608, "tie_word_embeddings": False, "hidden_act": "silu"}
# Qwen3-MoE-shaped (the MoE/MLA issue's section 6): ~1.3B total, ~0.3B active per token.
QWEN3_MOE_1B_CONFIG = {
    **_MOE_COMMON, "model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 3072,
    "moe_intermediate_size": 384, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "rope_theta": 1000000.0,
}
# DeepSeek-V2-Lite-shaped MLA + MoE (q_lora_rank null, 27 layers: llama.cpp's deepseek2 loader
# knows V2-Lite by its 27 layers), narrower: hidden 1024, 32 experts of 256, top-6, 2 shared
# (~0.9B total, ~0.3B active).
DEEPSEEK_V2_LITE_CONFIG = {
    **_MOE_COMMON, "model_type": "deepseek_v2", "hidden_size": 1024, "num_hidden_layers": 27,
    "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": None, "kv_lora_rank": 256,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "intermediate_size": 2816,
    "moe_intermediate_size": 256, "n_routed_experts": 32, "num_experts_per_tok": 6, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "rope_theta": 10000.0,
}


_STORIES = REPO / "assets" / "models" / "stories260k"

MODELS: dict[str, BenchModel] = {
    "stories260k": BenchModel(
        name="stories260k",
        path=_STORIES / "hf",
        description="shipped stories260K (llama2.c, 260K params, vocab 512, GQA 8/4, ctx 512)",
        shipped_gguf={d: _STORIES / "gguf" / f"stories260K-{d}.gguf" for d in ("f32", "f16", "q8_0")},
    ),
    "llama-15m": _generated(
        "llama-15m", LLAMA_15M_CONFIG,
        "random ~15M Llama (288 hidden, 6 layers, 6/6 heads, FFN 768, vocab 32000, tied)"),
    "llama-110m": _generated(
        "llama-110m", LLAMA_110M_CONFIG,
        "random ~110M Llama (768 hidden, 12 layers, 12/12 heads, FFN 2048, vocab 32000, tied)"),
    "llama-0.5b": _generated(
        "llama-0.5b", LLAMA_05B_CONFIG,
        "random ~0.5B Llama (1280 hidden, 24 layers, 20/10 heads, FFN 3328, vocab 32000, untied)"),
    "qwen3-moe-1b": _generated(
        "qwen3-moe-1b", QWEN3_MOE_1B_CONFIG,
        "random Qwen3-MoE (1024 hidden, 16 layers, 16/4 heads, 64 experts of 384, top-8, vocab 50257)"),
    "deepseek-v2-lite": _generated(
        "deepseek-v2-lite", DEEPSEEK_V2_LITE_CONFIG,
        "random DeepSeek-V2-Lite-shaped MLA + MoE (1024 hidden, 27 layers, 8 heads, latent 256 + rope 32, "
        "32 experts of 256, top-6, 2 shared, vocab 50257)"),
}


def ensure(name: str) -> Path:
    """The checkpoint directory of model ``name``, created first if it is generated and missing
    (or was written by an older layout of this harness)."""
    model = MODELS[name]
    marker = model.path / _DONE_MARKER
    if model.create is not None and not (marker.exists() and marker.read_text().startswith(_LAYOUT_VERSION + " ")):
        print(f"[bench] creating {name} in {model.path} (once) ...", flush=True)
        model.create(model.path)
    return model.path


def gguf_path(name: str, dtype: str) -> Path:
    """Where the GGUF file of ``name`` in ``dtype`` lives (shipped, or generated into the checkpoint's ``gguf/``)."""
    model = MODELS[name]
    if dtype in model.shipped_gguf:
        return model.shipped_gguf[dtype]
    return model.path / "gguf" / f"{name}-{dtype.upper()}.gguf"


def ensure_gguf(name: str, dtype: str, writer: str = "auto") -> tuple[Path, str]:
    """A GGUF file of model ``name`` with its weights in ``dtype`` (one of :data:`GGUF_DTYPES`),
    written once from the HF checkpoint; returns ``(path, how it was written)``.

    Raises:
        ValueError: ``dtype`` is not a benchmark dtype, or a shipped model has no file in it.
        RuntimeError: the writer failed (the message carries its output).
    """
    from gguf_export import export_gguf, written_by

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(GGUF_DTYPES)}")
    model = MODELS[name]
    path = gguf_path(name, dtype)
    if dtype in model.shipped_gguf:
        return path, "shipped"
    if model.create is None:
        raise ValueError(f"{name} ships no {dtype} GGUF file (it has {', '.join(model.shipped_gguf) or 'none'})")
    how = written_by(path)
    if how is None:
        print(f"[bench] writing {path.name} (once) ...", flush=True)
        how = export_gguf(ensure(name), path, dtype, writer)
    return path, how


def model_info(path: Path) -> dict[str, Any]:
    """The facts the harness needs from a checkpoint's ``config.json``/``generation_config.json``."""
    cfg = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return {
        "vocab_size": int(cfg["vocab_size"]),
        "bos_token_id": gen.get("bos_token_id", cfg.get("bos_token_id")),
        "eos_token_ids": [int(e) for e in eos_ids],
        "context_length": int(cfg.get("max_position_embeddings", 2048)),
    }


if __name__ == "__main__":  # python bench/models.py NAME...: create generated models (and their GGUFs) now
    sys.path.insert(0, str(BENCH))
    for arg in sys.argv[1:] or list(MODELS):
        print(arg, ensure(arg))
        for d in GGUF_DTYPES:
            try:
                print(" ", *ensure_gguf(arg, d))
            except ValueError as exc:
                print(" ", d, "-", exc)
