"""The benchmark's MoE models: a generated checkpoint converts with llama.cpp's converter (its
GPT-2 tokenizer is one the converter recognises), bytes_per_token counts only the selected
experts, and the KV bytes per token of an MLA model are one latent row per layer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.parity.test_moe_gguf_llama_cpp import convert

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from gguf_export import bytes_per_token  # noqa: E402
from models import DEEPSEEK_V2_LITE_CONFIG, QWEN3_MOE_1B_CONFIG, create_random_moe  # noqa: E402
from run import experts_touched, kv_bytes_per_token  # noqa: E402

TINY_QWEN3_MOE = {**QWEN3_MOE_1B_CONFIG, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
                  "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256}


@pytest.mark.slow
def test_bytes_per_token_reads_the_selected_experts_only(tmp_path: Path) -> None:
    import gguf

    hf_dir = tmp_path / "hf"
    create_random_moe(hf_dir, TINY_QWEN3_MOE)
    path = convert(hf_dir, tmp_path / "tiny-Q8_0.gguf", "q8_0")
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    routed = sum(n for name, n in tensors.items() if "_exps." in name)
    assert routed and routed % 8 == 0
    embed = tensors["token_embd.weight"]
    got = bytes_per_token(path)
    assert got["weight_bytes"] == sum(tensors.values())
    assert got["bytes_per_token"] == sum(tensors.values()) - embed + embed // 50257 - routed + routed * 2 // 8
    assert (got["experts"], got["experts_per_token"], got["routed_expert_bytes"]) == (8, 2, routed)


def test_mla_kv_bytes_are_one_latent_row_per_layer_beside_k_and_v_per_head() -> None:
    latent, per_head = kv_bytes_per_token(DEEPSEEK_V2_LITE_CONFIG)
    assert latent == 27 * (256 + 32) * 4
    assert per_head == 27 * 8 * (64 + 32 + 64) * 4
    gqa, none = kv_bytes_per_token(QWEN3_MOE_1B_CONFIG)
    assert (gqa, none) == (2 * 16 * 4 * 64 * 4, None)


def test_a_batch_touches_experts_as_independent_uniform_draws() -> None:
    assert experts_touched(64, 8, 1) == pytest.approx(8 / 64)
    assert experts_touched(64, 8, 16) == pytest.approx(1 - (56 / 64) ** 16)
