"""The benchmark's models: where each checkpoint lives, and how to create the ones we build.

A model is a name mapped to a :class:`BenchModel`. ``ensure(name)`` returns its Hugging Face
checkpoint directory, creating it first when the model is generated (random weights) and
not on disk yet. Add a model by adding an entry to :data:`MODELS`.

Generated checkpoints go to ``bench/out/models/<name>/`` (``/bench/out/`` is gitignored) and
are written by transformers itself (``save_pretrained``), so they are exactly what an HF
user would load. They carry a ``tokenizer.json`` + ``tokenizer_config.json`` because zllm's
HF loader wants them; the benchmark feeds token ids, so any tokenizer with the right
vocabulary size does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
GENERATED = OUT / "models"

#: Written last into a generated checkpoint: its presence means the checkpoint is complete.
_DONE_MARKER = ".bench-complete"


@dataclass(frozen=True)
class BenchModel:
    """One benchmark model.

    Attributes:
        name: the ``--models`` name.
        path: the HF checkpoint directory (shipped) or where the generated one goes.
        create: builds the checkpoint into a directory; ``None`` for shipped checkpoints.
        description: one line for the README / report.
    """

    name: str
    path: Path
    description: str
    create: Callable[[Path], None] | None = None


# ~110M-parameter Llama: the shape of the llama2.c "stories110M" model.
LLAMA_110M_CONFIG: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
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


def build_wordlevel_tokenizer(directory: Path, vocab_size: int) -> None:
    """Write a ``tokenizer.json`` (``tokenizers`` WordLevel, ``vocab_size`` tokens: ``<unk>``,
    ``<s>``, ``</s>``, then ``t3`` … ``t{V-1}``) and a matching ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
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


def create_random_llama(directory: Path, config: dict[str, Any], seed: int = 0) -> None:
    """Save a randomly initialised ``LlamaForCausalLM`` (f32, safetensors) plus a tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**config)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=config["bos_token_id"],
                                               eos_token_id=config["eos_token_id"])
    model.save_pretrained(directory, safe_serialization=True)
    build_wordlevel_tokenizer(directory, config["vocab_size"])
    (directory / _DONE_MARKER).write_text(f"seed={seed}\n")


MODELS: dict[str, BenchModel] = {
    "stories260k": BenchModel(
        name="stories260k",
        path=REPO / "assets" / "models" / "stories260k" / "hf",
        description="shipped stories260K (llama2.c, 260K params, vocab 512, GQA 8/4, ctx 512)",
    ),
    "llama-110m": BenchModel(
        name="llama-110m",
        path=GENERATED / "llama-110m",
        description="random ~110M Llama (768 hidden, 12 layers, 12/12 heads, FFN 2048, vocab 32000, tied)",
        create=lambda d: create_random_llama(d, LLAMA_110M_CONFIG),
    ),
}


def ensure(name: str) -> Path:
    """The checkpoint directory of model ``name``, created first if it is generated and missing."""
    model = MODELS[name]
    if model.create is not None and not (model.path / _DONE_MARKER).exists():
        print(f"[bench] creating {name} in {model.path} (once) ...", flush=True)
        model.create(model.path)
    return model.path


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


if __name__ == "__main__":  # python bench/models.py NAME...: create generated models now
    import sys

    for arg in sys.argv[1:] or list(MODELS):
        print(arg, ensure(arg))
