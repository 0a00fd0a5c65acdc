"""Fixtures for the weights-layer tests (helpers and paths live in weights_helpers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from weights_helpers import TINY_RANDOM_GGUF, open_checkpoint


@pytest.fixture(scope="session")
def sharded_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A tiny random LlamaForCausalLM saved by transformers in several safetensors shards.

    Returns the directory and the model's state dict (what the shards must hold).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(out, max_shard_size="20KB", safe_serialization=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out, state


@pytest.fixture(scope="session")
def tiny_random():
    """The opened llama-2-tiny-random GGUF (GGUFReader takes ~2 s over its 32,000-token vocab)."""
    return open_checkpoint(TINY_RANDOM_GGUF)
