"""What the transformers parity tests share: a tiny random model widened and saved by
``save_pretrained`` with the stories260K tokenizer, and transformers' own logits and greedy
tokens for it (the reference every family is compared against)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import copy_tokenizer

#: A prompt in the stories260K vocabulary (512 tokens).
PROMPT = [1, 410, 469, 347, 30, 99, 280, 17, 401, 5, 77, 300, 12, 64, 201]


def save_widened(path: Path, model_cls, config, seed: int):
    """``model_cls(config)`` seeded with ``seed``, its weights times 4 (random init is so small
    that attention and routing would be near uniform), saved to ``path`` with the stories260K
    tokenizer; returns the model in eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    copy_tokenizer(path)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' f32 logits ``[P, V]`` at every position of ``ids``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, n: int = 32) -> list[int]:
    """transformers' ``n`` greedy tokens after :data:`PROMPT` (EOS not stopping them)."""
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()
