"""bench/gguf_export.py: its own GGUF writer (used when llama.cpp's converter is unavailable)
stores a checkpoint zllm reads as the same model, and bytes_per_token follows its rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from gguf_export import bytes_per_token, write_llama_gguf  # noqa: E402
from models import _llama_config, create_random_llama  # noqa: E402


def _engine(path: Path):
    import zllm

    return zllm.Engine.from_config({
        "schema_version": 1, "model": {"path": str(path), "dtype": "auto"}, "backend": {"name": "cpu", "threads": 1},
        "runtime": {"kv_cache": {"block_size": 16, "num_blocks": 4}, "max_num_seqs": 1, "prefix_cache_seqs": 0,
                    "context_length": 64},
    })


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    # GQA (4 query heads over 2 KV heads) and an untied output, so the RoPE row permutation of
    # both attn_q and attn_k and the separate output tensor are all exercised.
    d = tmp_path_factory.mktemp("tiny") / "hf"
    create_random_llama(d, _llama_config(64, 2, 4, 2, 128, tied=False))
    return d


@pytest.mark.slow
def test_gguf_writer_file_has_the_hf_checkpoints_logits(hf_dir: Path, tmp_path: Path) -> None:
    gguf_file = tmp_path / "tiny-F32.gguf"
    write_llama_gguf(hf_dir, gguf_file, "f32")
    ids = [1, 500, 31999, 7, 1234, 42]
    want = _engine(hf_dir).prompt_logits(ids)
    got = _engine(gguf_file).prompt_logits(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_bytes_per_token_reads_one_embedding_row_and_the_whole_output(hf_dir: Path, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-Q8_0.gguf"
    write_llama_gguf(hf_dir, path, "q8_0")
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    embed_row = tensors["token_embd.weight"] // 32000
    assert embed_row == 64 // 32 * 34  # one Q8_0 row: 2 blocks of 34 bytes
    got = bytes_per_token(path)
    assert got["weight_bytes"] == sum(tensors.values())
    assert got["bytes_per_token"] == sum(tensors.values()) - tensors["token_embd.weight"] + embed_row
    assert "output.weight" in tensors  # untied: read in full, counted once


@pytest.mark.slow
def test_dense_ends_keep_embeddings_and_output_bf16_and_quantize_the_rest(hf_dir: Path, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-Q4_0-BF16-ENDS.gguf"
    write_llama_gguf(hf_dir, path, "q4_0", dense_ends="bf16")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types.pop("token_embd.weight") == types.pop("output.weight") == gguf.GGMLQuantizationType.BF16
    assert {types[n] for n in types if "norm" not in n} == {gguf.GGMLQuantizationType.Q4_0}
    ids = [1, 500, 31999, 7]
    want = _engine(hf_dir).prompt_logits(ids)
    got = _engine(path).prompt_logits(ids)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9  # Q4_0 rounding
