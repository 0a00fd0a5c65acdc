"""A tiny random gpt-oss checkpoint as a user finds one: saved by transformers
(``GptOssForCausalLM.save_pretrained``, fused ``gate_up_proj``), with a byte-level BPE
tokenizer and a hand-written harmony-style chat template.

No gpt-oss tokenizer is available offline (``openai-harmony`` downloads its vocabulary), so
the checkpoint gets GPT-2's byte-level BPE (vocabulary and merges from llama.cpp's
``ggml-vocab-gpt-2.gguf``, which llama.cpp's converter recognises) plus harmony's special
tokens as added tokens after GPT-2's 50257, and a chat template in harmony's message shape
(``<|start|>{role}<|message|>{content}<|end|>``, the assistant's turn opened with
``<|start|>assistant`` and ended by ``<|return|>``, the model's EOS). Tool calls and
channels beyond ``final`` are the serving layer's, not rendered here.

:func:`save_mxfp4_copy` writes the same model as the released gpt-oss checkpoints are stored:
experts in MXFP4 (``*_blocks`` / ``*_scales``, ``quantization_config: {quant_method: mxfp4}``),
everything else dense.

The random weights are widened (x4, as every parity test: random init is near uniform), the
sinks drawn around 1 (init leaves them ~0.02, a sink that barely matters), and the experts'
``gate_up_proj`` x3 more, so that gpt-oss's clamp (``swiglu_limit`` 7, which GGUF cannot
store: llama.cpp fixes it) cuts a good share of the pre-activations.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken

from tests.gpt2_bpe import GPT2_VOCAB_SIZE, gpt2_tokenizer
from zllm.conformance.quantizers import quantize_mxfp4

#: harmony's special tokens, added after GPT-2's vocabulary in this order.
HARMONY_SPECIALS = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>",
                    "<|constrain|>")
VOCAB = GPT2_VOCAB_SIZE + len(HARMONY_SPECIALS)
RETURN_ID = GPT2_VOCAB_SIZE + HARMONY_SPECIALS.index("<|return|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|start|>{{ message['role'] }}"
    "{%- if message['role'] == 'assistant' %}<|channel|>final{% endif -%}"
    "<|message|>{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' %}<|return|>{% else %}<|end|>{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|start|>assistant<|channel|>final<|message|>{% endif -%}"
)
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    max_position_embeddings=256, bos_token_id=None, eos_token_id=RETURN_ID, pad_token_id=0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 150000.0},
)


@functools.cache
def _tokenizer_json() -> str:
    """GPT-2's BPE with harmony's specials added, serialised once per process."""
    tok = gpt2_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIALS])
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<|return|>") == RETURN_ID
    return tok.to_str()


def write_tokenizer(dst: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` (with :data:`CHAT_TEMPLATE`) into ``dst``."""
    (dst / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>", "pad_token": "<|end|>",
         "add_prefix_space": False, "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))


def save_gpt_oss(path: Path, seed: int = 14, biased: bool = False, **overrides: object) -> transformers.PreTrainedModel:
    """Save the tiny gpt-oss model (:data:`CONFIG`, with ``overrides``) to ``path`` in f32 with its
    tokenizer; returns the model. ``biased``: draw every bias (attention, experts; init leaves
    them 0) from N(0, 0.5), so a test sees where each one is added."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("gpt_oss", **{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape) + 1.0)
            elif biased and name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.5)
            else:
                p.mul_(12.0 if name.endswith("gate_up_proj") else 4.0)
    model.save_pretrained(path)
    write_tokenizer(path)
    return model


def save_bf16_copy(src: Path, dst: Path) -> Path:
    """``src`` (f32, from :func:`save_gpt_oss`) as transformers saves the model after
    ``.to(torch.bfloat16)``: every tensor rounded to bf16, ``dtype`` bfloat16 in the config."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return dst


#: What the released gpt-oss checkpoints leave unquantized (their ``modules_to_not_convert``).
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _mxfp4_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert stack in row layout f32 ``[E, R, K]`` as gpt-oss's MXFP4 tensors: blocks U8
    ``[E, R, K/32, 16]`` (32 E2M1 codes per block, low nibble = even column) and E8M0 scales U8
    ``[E, R, K/32]``, each expert quantized by zllm's quantizer from the format's definition
    (:func:`zllm.conformance.quantizers.quantize_mxfp4`)."""
    e, r, k = rows.shape
    experts = [quantize_mxfp4(w) for w in rows]
    blocks = torch.stack([q.parts["qweight"] for q in experts]).reshape(e, r, k // 32, 16)
    return blocks.contiguous(), torch.stack([q.parts["scales"] for q in experts]).contiguous()


def save_mxfp4_copy(src: Path, dst: Path) -> Path:
    """``src`` (f32, from :func:`save_gpt_oss`) with its experts in MXFP4 as the hub's gpt-oss
    files hold them: ``gate_up_proj_blocks [E, 2N, C/32, 16]`` (rows = the fused output columns,
    gate even), ``down_proj_blocks [E, C, N/32, 16]`` and their ``*_scales``; biases, attention,
    router, embeddings and head stay f32."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        dense = tensors.pop(name)  # [E, K, R]: transformers multiplies x @ W
        tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4_blocks(dense.transpose(1, 2).float())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED}
    (dst / "config.json").write_text(json.dumps(config))
    return dst
