"""GGUF checkpoints: config from metadata, HF names, the Q/K RoPE layout, formats, damaged files.

The stories260k HF and GGUF files hold the same weights, so the HF checkpoint is the
reference for every mapped name, config value and tensor (Q/K in llama.cpp's adjacent-pair
row order, which the GGUF checkpoint keeps and reports as ``rope_interleaved``).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from weights_helpers import (
    F32,
    STORIES_GGUF_F16,
    STORIES_GGUF_F32,
    STORIES_GGUF_Q8_0,
    STORIES_HF,
    STR,
    U32,
    assert_backed_by,
    needs_proc,
    open_checkpoint,
    tiny_llama_kv,
    tiny_llama_tensors,
    write_gguf,
)  # fmt: skip

from zllm.spec.errors import CheckpointError, TensorError, UnknownArchitectureError
from zllm.weights import QuantizedTensor

CONFIG_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "tie_word_embeddings",
    "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
)  # fmt: skip


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim: HF half-rotation rows → GGUF rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def as_stored_in_gguf(name: str, hf_weight: torch.Tensor) -> torch.Tensor:
    """An HF stories260K weight in the GGUF file's row order (Q/K permuted; 8 heads, 4 KV heads)."""
    heads = {"self_attn.q_proj.weight": (8, 8), "self_attn.k_proj.weight": (8, 4)}
    for suffix, (n_head, n_head_kv) in heads.items():
        if name.endswith(suffix):
            return torch.from_numpy(llama_cpp_permute(hf_weight.numpy(), n_head, n_head_kv))
    return hf_weight


def test_stories_gguf_config_matches_hf():
    hf = open_checkpoint(STORIES_HF).config
    cfg = open_checkpoint(STORIES_GGUF_F32).config
    assert {k: cfg[k] for k in CONFIG_KEYS} == {k: hf[k] for k in CONFIG_KEYS}
    assert cfg["rope_interleaved"] is True and "rope_interleaved" not in hf
    assert (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ) == (64, 5, 8, 4)
    assert (
        cfg["intermediate_size"], cfg["rms_norm_eps"], cfg["rope_theta"], cfg["vocab_size"]
    ) == (172, 1e-5, 10000.0, 512)
    assert cfg["tie_word_embeddings"] is True


def test_stories_gguf_identity():
    ckpt = open_checkpoint(STORIES_GGUF_F32)
    assert ckpt.format == "gguf" and ckpt.architecture == "llama" and ckpt.files == [STORIES_GGUF_F32]
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert ckpt.metadata["general.name"] == "stories260K" and len(ckpt.metadata["tokenizer.ggml.tokens"]) == 512
    assert not any(k.startswith("GGUF.") for k in ckpt.metadata)


def test_stories_gguf_f32_equals_hf_exactly():
    hf, g = open_checkpoint(STORIES_HF), open_checkpoint(STORIES_GGUF_F32)
    assert g.tensor_names() == sorted(g.tensor_names(), key=g.tensor_names().index)  # file order, stable
    assert set(g.tensor_names()) == set(hf.tensor_names())
    for name in hf.tensor_names():
        assert g.tensor_shape_format(name) == hf.tensor_shape_format(name), name
        assert torch.equal(g.tensor(name), as_stored_in_gguf(name, hf.tensor(name))), name


def test_stories_gguf_f16_equals_hf_rounded_to_f16():
    hf, g = open_checkpoint(STORIES_HF), open_checkpoint(STORIES_GGUF_F16)
    for name in hf.tensor_names():
        w, ref = g.tensor(name), as_stored_in_gguf(name, hf.tensor(name))
        if w.dtype == torch.float16:
            assert torch.equal(w, ref.to(torch.float16)), name
        else:  # norms stay f32 in llama.cpp's f16 files
            assert torch.equal(w, ref), name


def test_qk_permutation_is_needed():
    """Guard against a vacuous comparison: the stored GGUF rows differ from HF's."""
    g = gguf.GGUFReader(STORIES_GGUF_F32)
    stored = {t.name: t.data for t in g.tensors}
    hf = open_checkpoint(STORIES_HF)
    q = hf.tensor("model.layers.0.self_attn.q_proj.weight").numpy()
    k = hf.tensor("model.layers.0.self_attn.k_proj.weight").numpy()
    assert not np.array_equal(stored["blk.0.attn_q.weight"], q)
    assert np.array_equal(stored["blk.0.attn_q.weight"], llama_cpp_permute(q, 8, 8))
    assert np.array_equal(stored["blk.0.attn_k.weight"], llama_cpp_permute(k, 8, 4))


def test_stories_q8_0_stays_quantized_with_the_readers_bytes():
    ckpt = open_checkpoint(STORIES_GGUF_Q8_0)
    hf = open_checkpoint(STORIES_HF)
    reader = {t.name: t for t in gguf.GGUFReader(STORIES_GGUF_Q8_0).tensors}
    embed = ckpt.tensor("model.embed_tokens.weight")
    assert isinstance(embed, QuantizedTensor) and embed.fmt == "q8_0" and embed.shape == (512, 64)
    assert torch.equal(embed.data, torch.from_numpy(np.array(reader["token_embd.weight"].data)))
    quantized = 0
    for name in ckpt.tensor_names():
        shape, fmt = ckpt.tensor_shape_format(name)
        w = ckpt.tensor(name)
        if fmt != "q8_0":
            assert isinstance(w, torch.Tensor) and w.dtype in (torch.float16, torch.float32)
            continue
        quantized += 1
        assert isinstance(w, QuantizedTensor) and w.fmt == "q8_0" and w.shape == shape
        # Dequantize with the gguf package and compare with the f32 HF weights: a wrong row
        # order would be far off; Q8_0 rounding is at most half a step of max|block| / 127.
        deq = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType.Q8_0))
        ref = as_stored_in_gguf(name, hf.tensor(name))
        assert deq.shape == ref.shape
        assert torch.allclose(deq, ref, atol=float(ref.abs().max()) / 127), name
    assert quantized == 1 + 5 * 6  # embedding + q, k, v, o, gate, up per layer


def test_q8_0_qk_rows_are_the_readers_rows_as_stored():
    ckpt = open_checkpoint(STORIES_GGUF_Q8_0)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(STORIES_GGUF_Q8_0).tensors}
    k = ckpt.tensor("model.layers.2.self_attn.k_proj.weight")
    assert torch.equal(k.data, torch.from_numpy(stored["blk.2.attn_k.weight"]))


@needs_proc
def test_gguf_tensors_are_views_of_the_file_mapping():
    ckpt = open_checkpoint(STORIES_GGUF_Q8_0)
    assert_backed_by(ckpt.tensor("model.embed_tokens.weight").data, STORIES_GGUF_Q8_0)
    assert_backed_by(ckpt.tensor("model.layers.0.mlp.down_proj.weight"), STORIES_GGUF_Q8_0)
    assert_backed_by(ckpt.tensor("model.layers.0.self_attn.q_proj.weight").data, STORIES_GGUF_Q8_0)
    assert_backed_by(
        open_checkpoint(STORIES_GGUF_F32).tensor("model.layers.1.self_attn.k_proj.weight"), STORIES_GGUF_F32
    )
    assert_backed_by(ckpt.tensor("model.norm.weight"), STORIES_GGUF_Q8_0)


def test_llama_2_tiny_random_opens(tiny_random):
    ckpt = tiny_random
    cfg = ckpt.config
    assert cfg["vocab_size"] == 32000 and cfg["tie_word_embeddings"] is False
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 2, 2, 4)
    assert cfg["rope_theta"] == 10000.0  # no rope.freq_base key: llama.cpp's default
    assert ckpt.tensor_shape_format("model.embed_tokens.weight") == ((32000, 8), "f16")
    assert ckpt.tensor_shape_format("lm_head.weight") == ((32000, 8), "f16")
    assert ckpt.tensor_shape_format("model.layers.0.mlp.down_proj.weight") == ((8, 32), "f16")
    assert len(ckpt.tensor_names()) == 12
    assert ckpt.tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float16


def test_metadata_defaults_follow_llama_cpp(tmp_path):
    tensors = tiny_llama_tensors(np.random.default_rng(0), vocab=16, kv_heads=4)
    path = write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_kv(), tensors)
    cfg = open_checkpoint(path).config
    assert cfg["num_key_value_heads"] == 4  # head_count_kv absent → head_count
    assert cfg["head_dim"] == 8  # key_length absent → hidden / heads
    assert cfg["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["vocab_size"] == 16  # no tokens, no vocab_size key → embedding rows
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is False
    assert "eos_token_id" not in cfg and open_checkpoint(path).generation_config == {}


@pytest.mark.parametrize("arch, interleaved", [("llama", True), ("qwen2", False)])
def test_qk_rows_are_handed_out_as_stored_and_the_config_names_the_layout(tmp_path, arch, interleaved):
    rng = np.random.default_rng(1)
    stored = tiny_llama_tensors(rng, kv_heads=2)
    if arch == "qwen2":
        stored |= {
            f"blk.0.attn_{p}.bias": rng.standard_normal(stored[f"blk.0.attn_{p}.weight"].shape[0]).astype(np.float32)
            for p in "qkv"
        }
    kv = {
        k.replace("llama.", f"{arch}.", 1): v
        for k, v in tiny_llama_kv(llama__attention__head_count_kv=(2, U32)).items()
    }
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", arch, kv, stored))
    assert ckpt.config.get("rope_interleaved", False) is interleaved
    for hf_name, gguf_name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
        assert np.array_equal(
            ckpt.tensor(f"model.layers.0.self_attn.{hf_name}.weight").numpy(), stored[f"blk.0.{gguf_name}.weight"]
        )


def test_bf16_and_q4_0_tensors(tmp_path):
    rng = np.random.default_rng(2)
    tensors = tiny_llama_tensors(rng)
    up = tensors["blk.0.ffn_up.weight"]
    down = tensors["blk.0.ffn_down.weight"]
    stored = dict(tensors)
    stored["blk.0.ffn_up.weight"] = (
        gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0
    )
    stored["blk.0.ffn_down.weight"] = (
        gguf.quants.quantize(down, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    )
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_kv(), stored))
    w_up = ckpt.tensor("model.layers.0.mlp.up_proj.weight")
    assert isinstance(w_up, QuantizedTensor) and w_up.fmt == "q4_0" and w_up.shape == (64, 32)
    assert w_up.data.shape == (64, 32 // 32 * 18)
    w_down = ckpt.tensor("model.layers.0.mlp.down_proj.weight")
    assert ckpt.tensor_shape_format("model.layers.0.mlp.down_proj.weight") == ((32, 64), "bf16")
    assert w_down.dtype == torch.bfloat16 and w_down.shape == (32, 64)
    assert torch.equal(w_down, torch.from_numpy(down).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q5_0,
                                   gguf.GGMLQuantizationType.Q5_1])
def test_q4_1_q5_0_q5_1_tensors_are_read_as_their_stored_blocks(tmp_path, qtype):
    tensors = tiny_llama_tensors(np.random.default_rng(4))
    blocks = gguf.quants.quantize(tensors["blk.0.ffn_up.weight"], qtype)  # uint8 [64, 32 // 32 * type_size]
    stored = {**tensors, "blk.0.ffn_up.weight": (blocks, qtype)}
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_kv(), stored))
    name = "model.layers.0.mlp.up_proj.weight"
    fmt = qtype.name.lower()
    assert ckpt.tensor_shape_format(name) == ((64, 32), fmt)
    w = ckpt.tensor(name)
    assert isinstance(w, QuantizedTensor) and w.fmt == fmt and w.shape == (64, 32)
    assert np.array_equal(w.data.numpy(), blocks)


def test_mxfp4_blocks_are_repacked_into_the_mxfp4_layout_and_decode_as_gguf_py(tmp_path):
    from zllm.domain.quant import dequantize

    tensors = tiny_llama_tensors(np.random.default_rng(5))
    blocks = gguf.quants.quantize(tensors["blk.0.ffn_up.weight"], gguf.GGMLQuantizationType.MXFP4)  # [64, 17]
    stored = {**tensors, "blk.0.ffn_up.weight": (blocks, gguf.GGMLQuantizationType.MXFP4)}
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_kv(), stored))
    name = "model.layers.0.mlp.up_proj.weight"
    assert ckpt.tensor_shape_format(name) == ((64, 32), "mxfp4")
    w = ckpt.tensor(name)
    assert isinstance(w, QuantizedTensor)
    assert w.parts["qweight"].shape == (64, 16) and w.parts["scales"].shape == (64, 1)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(dequantize(w), torch.from_numpy(expected))


def test_unsupported_gguf_type_names_tensor_type_and_supported(tmp_path):
    tensors = tiny_llama_tensors(np.random.default_rng(3))
    stored = dict(tensors)
    raw = np.zeros((64, 136), dtype=np.uint8)  # IQ4_XS: 256 weights in 136 bytes; 64 x 256
    stored["blk.0.ffn_gate.weight"] = (raw, gguf.GGMLQuantizationType.IQ4_XS)
    stored["blk.0.ffn_up.weight"] = (raw.copy(), gguf.GGMLQuantizationType.IQ4_XS)
    stored["blk.0.ffn_down.weight"] = np.zeros((256, 64), np.float32)
    ckpt = open_checkpoint(
        write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_kv(llama__feed_forward_length=(256, U32)), stored)
    )
    name = "model.layers.0.mlp.gate_proj.weight"
    assert ckpt.tensor_shape(name) == (64, 256)
    with pytest.raises(
        TensorError,
        match=r"stored as GGUF type IQ4_XS .*supported types: "
        r"F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4",
    ) as e:
        ckpt.tensor(name)
    assert e.value.tensor == name and e.value.file == str(tmp_path / "m.gguf")


def test_missing_required_key(tmp_path):
    kv = tiny_llama_kv(llama__attention__layer_norm_rms_epsilon=None)
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", kv, tiny_llama_tensors(np.random.default_rng(4))))
    with pytest.raises(CheckpointError, match="missing required metadata key 'llama.attention.layer_norm_rms_epsilon'"):
        _ = ckpt.config


def test_unknown_architecture_still_gives_metadata(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf", "mamba", {"mamba.block_count": (1, U32)},
        {"token_embd.weight": np.zeros((4, 4), np.float32)},
    )
    ckpt = open_checkpoint(path)
    assert ckpt.architecture == "mamba" and ckpt.metadata["mamba.block_count"] == 1
    with pytest.raises(
        UnknownArchitectureError, match="no GGUF map for architecture 'mamba'; mapped architectures: llama"
    ):
        ckpt.tensor_names()


def test_unmapped_tensor_is_named(tmp_path):
    tensors = tiny_llama_tensors(np.random.default_rng(5))
    tensors["pos_embd.weight"] = np.ones(4, np.float32)
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_kv(), tensors))
    with pytest.raises(TensorError, match="no HF name in the 'llama' tensor map") as e:
        ckpt.tensor_names()
    assert e.value.tensor == "pos_embd.weight"


def test_unmapped_rope_scaling_is_refused_naming_the_supported_ones(tmp_path):
    kv = tiny_llama_kv(llama__rope__scaling__type=("longrope", STR), llama__rope__scaling__factor=(4.0, F32))
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", kv, tiny_llama_tensors(np.random.default_rng(6))))
    with pytest.raises(CheckpointError, match="RoPE scaling 'longrope'.*supported: none, linear, yarn"):
        _ = ckpt.config


def test_yarn_scaling_and_rope_freqs_become_hf_config(tmp_path):
    kv = tiny_llama_kv(llama__rope__scaling__type=("yarn", STR), llama__rope__scaling__factor=(4.0, F32),
                       llama__rope__scaling__original_context_length=(64, U32))
    tensors = tiny_llama_tensors(np.random.default_rng(6))
    tensors["rope_freqs.weight"] = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", kv, tensors))
    assert ckpt.config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert ckpt.config["rope_freq_factors"] == [1.0, 2.0, 4.0, 8.0]
    assert "rope_freqs.weight" not in ckpt.tensor_names()


@pytest.mark.parametrize("keep_bytes", [100, 2000, 600_000])
def test_truncated_gguf_names_the_file(tmp_path, keep_bytes):
    path = tmp_path / "cut.gguf"
    path.write_bytes(STORIES_GGUF_F32.read_bytes()[:keep_bytes])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert e.value.file == str(path)


def test_non_gguf_file_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((STORIES_HF / "model.safetensors").read_bytes()[:64])
    with pytest.raises(CheckpointError, match="not a GGUF file") as e:
        open_checkpoint(path)
    assert e.value.file == str(path)
    with pytest.raises(CheckpointError, match="a gguf checkpoint is a single .gguf file"):
        open_checkpoint(tmp_path, "gguf")
    with pytest.raises(CheckpointError, match="an hf checkpoint is a directory"):
        open_checkpoint(STORIES_GGUF_F32, "hf")


def test_gguf_load_tokenizer():
    tokenizer = open_checkpoint(STORIES_GGUF_Q8_0).load_tokenizer()
    assert tokenizer.encode("Zoo") == [1, 410, 469, 347]  # shared/models/README.md


def test_gguf_without_vocabulary_has_no_tokenizer(tmp_path):
    ckpt = open_checkpoint(
        write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_kv(), tiny_llama_tensors(np.random.default_rng(7)))
    )
    with pytest.raises(CheckpointError, match="no tokenizer"):
        ckpt.load_tokenizer()
