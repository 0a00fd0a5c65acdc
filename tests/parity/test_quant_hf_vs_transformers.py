"""Quantized HF checkpoints end to end: a tiny Llama saved by transformers, quantized into each
format as its quantizer lays it out (``tests/quant_checkpoints.py``), run by zllm on the CPU
backend with the weights kept quantized.

Oracle: transformers in f32 on the dequantized weights (the f32 reference of each format,
checked bit for bit against the defining libraries in ``test_quant_hf_oracle.py``): logits
within 1e-4, greedy tokens identical. Where transformers itself loads the quantized directory
on a CPU (it dequantizes: transformers ``fp8`` with ``weight_scale_inv``, compressed-tensors
``float-quantized``, symmetric ``pack-quantized`` int8 and, with ``run_compressed=False``,
``int-quantized`` W8A8, which zllm runs weight-only with f32 activations), zllm is compared with
that too. transformers cannot load the others here: GPTQ needs optimum, AWQ gptqmodel, modelopt
(FP8, NVFP4) is no transformers method, compressed-tensors int4 with zero points fails on its
packed zero-point shape, NVFP4/MXFP4 decompress to bf16 and refuse an f32 model; AutoFP8-style
``weight_scale`` files under ``quant_method: fp8`` load without those scales applied
(transformers reads ``weight_scale_inv``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import zllm
from tests import quant_checkpoints as qc
from tests.conftest import copy_tokenizer, write_config
from tests.parity.hf_models import PROMPT, hf_greedy, hf_logits
from zllm.weights.formats import QuantizedTensor

WRITERS = {
    "fp8-block": lambda src, dst: qc.write_fp8(src, dst, (32, 32)),
    "fp8-tensor": lambda src, dst: qc.write_fp8(src, dst, None),
    "fp8-autofp8": lambda src, dst: qc.write_fp8(src, dst, None, naming="autofp8"),
    "gptq-int4": lambda src, dst: qc.write_gptq(src, dst, 4, 32),
    "gptq-int4-v2-desc-act": lambda src, dst: qc.write_gptq(src, dst, 4, 32, "gptq_v2", desc_act=True),
    "gptq-int8": lambda src, dst: qc.write_gptq(src, dst, 8, 32),
    "awq-int4": lambda src, dst: qc.write_awq(src, dst, 32),
    "modelopt-nvfp4": qc.write_modelopt_nvfp4,
    "modelopt-fp8": qc.write_modelopt_fp8,
    "ct-w8a8": lambda src, dst: qc.write_compressed_tensors(src, dst, "w8a8"),
    "ct-w8a8-static": lambda src, dst: qc.write_compressed_tensors(src, dst, "w8a8-static"),
    "ct-w4a16": lambda src, dst: qc.write_compressed_tensors(src, dst, "w4a16"),
    "ct-w8a16": lambda src, dst: qc.write_compressed_tensors(src, dst, "w8a16"),
    "ct-fp8-block": lambda src, dst: qc.write_compressed_tensors(src, dst, "fp8-block"),
    "ct-nvfp4": lambda src, dst: qc.write_compressed_tensors(src, dst, "nvfp4"),
    "ct-mxfp4": lambda src, dst: qc.write_compressed_tensors(src, dst, "mxfp4"),
}
FORMAT_OF = {"fp8-block": "fp8_e4m3", "fp8-tensor": "fp8_e4m3", "fp8-autofp8": "fp8_e4m3", "gptq-int4": "int4_g",
             "gptq-int4-v2-desc-act": "int4_g", "gptq-int8": "int8_g", "awq-int4": "int4_g",
             "modelopt-nvfp4": "nvfp4", "ct-w4a16": "int4_g", "ct-w8a16": "int8_g", "ct-fp8-block": "fp8_e4m3",
             "ct-nvfp4": "nvfp4", "ct-mxfp4": "mxfp4", "modelopt-fp8": "fp8_e4m3", "ct-w8a8": "int8_g",
             "ct-w8a8-static": "int8_g"}
# case -> from_pretrained arguments. W8A8: transformers' default keeps the layers compressed and
# quantizes their activations to int8 (the W8A8 semantics, off from weight-only by ~0.7 in these
# logits); run_compressed=False decompresses the weights and runs f32 activations, as zllm does.
_DECOMPRESSED = {"quantization_config": transformers.CompressedTensorsConfig(run_compressed=False)}
TRANSFORMERS_LOADS: dict[str, dict] = {"fp8-block": {}, "fp8-tensor": {}, "ct-w8a16": {}, "ct-fp8-block": {},
                                       "ct-w8a8": _DECOMPRESSED, "ct-w8a8-static": _DECOMPRESSED}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """A tiny Llama (K = 64 and 96, so int groups of 32 and FP8 blocks of 32 fit) saved by transformers."""
    path = tmp_path_factory.mktemp("quant-dense") / "dense"
    torch.manual_seed(14)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # random init is tiny: widen it so attention is not uniform
    model.save_pretrained(path)
    copy_tokenizer(path)
    return path


@pytest.mark.parametrize("case", sorted(WRITERS))
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path, dense, case):
    quantized, reference = tmp_path / case, tmp_path / f"{case}-dequantized"
    qc.write_dense(dense, reference, WRITERS[case](dense, quantized))
    oracle = transformers.LlamaForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()

    engine = zllm.Engine.from_config(write_config(tmp_path, quantized))
    ours = engine.prompt_logits(PROMPT)
    torch.testing.assert_close(ours, hf_logits(oracle, PROMPT), atol=1e-4, rtol=0)
    out = engine.generate({"prompt_token_ids": PROMPT, "max_tokens": 24, "stop_token_ids": []})
    n = len(out["token_ids"])
    assert out["token_ids"] == hf_greedy(oracle, 24)[:n]
    assert n == 24 or out["finish_reason"] == "stop"


@pytest.mark.parametrize("case", sorted(TRANSFORMERS_LOADS))
def test_quantized_checkpoint_matches_transformers_loading_the_same_directory(tmp_path, dense, case):
    quantized = tmp_path / case
    WRITERS[case](dense, quantized)
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32,
                                                           **TRANSFORMERS_LOADS[case]).eval()
    engine = zllm.Engine.from_config(write_config(tmp_path, quantized))
    torch.testing.assert_close(engine.prompt_logits(PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_quantized_weights_reach_the_kernels_quantized(tmp_path, dense):
    from zllm.weights import open_checkpoint

    for case in ("gptq-int4", "ct-nvfp4"):
        WRITERS[case](dense, tmp_path / case)
        ckpt = open_checkpoint(tmp_path / case)
        w = ckpt.tensor("model.layers.0.mlp.down_proj.weight")
        assert w.fmt == FORMAT_OF[case] and w.shape == (64, 96)
        assert w.nbytes < 64 * 96  # under a byte per weight: never expanded
        assert "model.layers.0.mlp.down_proj.qweight" not in ckpt.tensor_names()


@pytest.mark.parametrize("case", ["ct-nvfp4", "gptq-int4"])
def test_quantized_moe_experts_stay_quantized_and_match_transformers(tmp_path, case):
    # Qwen2-MoE: per-expert checkpoint tensors folded one by one, then stacked by the family
    # into [E, N, K] quantized stacks that the moe kernel slices per expert.
    dense = tmp_path / "dense"
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(15)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(dense)
    copy_tokenizer(dense)
    quantized, reference = tmp_path / case, tmp_path / f"{case}-dequantized"
    qc.write_dense(dense, reference, WRITERS[case](dense, quantized))
    oracle = transformers.Qwen2MoeForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    engine = zllm.Engine.from_config(write_config(tmp_path, quantized))
    torch.testing.assert_close(engine.prompt_logits(PROMPT), hf_logits(oracle, PROMPT), atol=1e-4, rtol=0)


def test_a_nan_scale_stops_the_engine_before_the_first_token_naming_file_and_tensor(tmp_path, dense):
    from safetensors.torch import load_file, save_file

    from zllm.spec.errors import TensorError

    quantized = tmp_path / "fp8"
    qc.write_fp8(dense, quantized, (32, 32))
    file = quantized / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"][1, 0] = float("nan")
    save_file(tensors, str(file))
    with pytest.raises(TensorError) as err:
        zllm.Engine.from_config(write_config(tmp_path, quantized))
    assert err.value.tensor == "model.layers.1.mlp.up_proj.weight_scale_inv"
    assert str(file) in str(err.value) and "NaN scale at index [1, 0]" in str(err.value)


def _deepseek_fp8_against_transformers(tmp_path: Path, capsys, v_head_dim: int) -> tuple[object, list[str]]:
    """A tiny DeepSeek-V3 in its FP8 layout on every projection, run by zllm against transformers on
    the dequantized weights (prefill logits, greedy decode); returns layer 0's loaded ``kv_b_proj``
    and the ``changed at load`` lines of ``--explain``. kv_a_proj_with_mqa has 40 rows (32 + 8), so
    its last 32-row scale block is partial, as the real model's 576-row projection is."""
    dense = tmp_path / "dense"
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=v_head_dim, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, tie_word_embeddings=False,
    )
    torch.manual_seed(16)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(dense)
    copy_tokenizer(dense)
    modules = (*qc.QUANTIZED, "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    quantized, reference = tmp_path / "fp8", tmp_path / "fp8-dequantized"
    qc.write_dense(dense, reference, qc.write_fp8(dense, quantized, (32, 32), modules=modules))
    from zllm.cli.run import _explain
    from zllm.weights import open_checkpoint

    kv_a = open_checkpoint(quantized).tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert kv_a.fmt == "fp8_e4m3" and kv_a.shape == (40, 64) and kv_a.parts["scale"].shape == (2, 2)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    engine = zllm.Engine.from_config(write_config(tmp_path, quantized))
    torch.testing.assert_close(engine.prompt_logits(PROMPT), hf_logits(oracle, PROMPT), atol=1e-4, rtol=0)
    out = engine.generate({"prompt_token_ids": PROMPT, "max_tokens": 16, "stop_token_ids": []})
    assert out["token_ids"] == hf_greedy(oracle, 16)[: len(out["token_ids"])]  # decode: the absorbed form
    _explain(engine)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("changed at load: ")]
    return engine.loaded.model.layers[0].kv_b, notes


def test_deepseek_v3_fp8_blocks_with_a_partial_row_block_match_transformers(tmp_path, capsys):
    # kv_b_proj's heads are Dn + Dv = 32 rows, on its 32-row scale blocks: the MLA kernel splits
    # it per head and it stays FP8.
    kv_b, notes = _deepseek_fp8_against_transformers(tmp_path, capsys, v_head_dim=16)
    assert isinstance(kv_b, QuantizedTensor) and kv_b.fmt == "fp8_e4m3" and notes == []


def test_deepseek_kv_b_proj_whose_heads_cross_scale_blocks_is_dequantized_at_load_and_explained(tmp_path, capsys):
    # Dn + Dv = 24 rows a head across 32-row scale blocks: dequantized at load (as vLLM does), said so.
    kv_b, notes = _deepseek_fp8_against_transformers(tmp_path, capsys, v_head_dim=8)
    assert isinstance(kv_b, torch.Tensor) and kv_b.dtype == torch.float32
    assert notes == [
        f"changed at load: model.layers.{i}.self_attn.kv_b_proj.weight (fp8_e4m3 scale blocks of 32 rows "
        "do not align with a head's 24 rows: dequantized to f32 at load)" for i in range(2)
    ]


def test_explain_names_the_quantization_the_kernels_and_the_unused_activation_scales(tmp_path, dense):
    from tests.cli.conftest import zllm as run_zllm

    quantized = tmp_path / "fp8-tensor"
    WRITERS["fp8-tensor"](dense, quantized)
    proc = run_zllm("run", "--config", write_config(tmp_path, quantized), "--explain", "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "quantization: fp8: 14 weights as fp8_e4m3; the rest dense (kept quantized)" in lines
    assert any(line.strip().startswith("linear[fp8_e4m3]") for line in lines)
    skipped = [line for line in lines if line.startswith("skipped tensor: ")]
    assert len(skipped) == 14 and all(".activation_scale (static activation scale" in s for s in skipped)


def test_w8a8_explain_says_the_activations_stay_f32_not_int8(tmp_path, dense, capsys):
    from zllm.cli.run import _explain

    quantized = tmp_path / "ct-w8a8"
    WRITERS["ct-w8a8"](dense, quantized)
    _explain(zllm.Engine.from_config(write_config(tmp_path, quantized)))
    lines = capsys.readouterr().err.splitlines()
    assert "quantization: compressed-tensors: 14 weights as int8_g; the rest dense (kept quantized)" in lines
    assert [line for line in lines if line.startswith("quantization note: ")] == [
        "quantization note: activations kept in f32, not quantized to int8 per token (dynamic) as the "
        "checkpoint's config says: its weights run weight-only (dequantized-weight semantics, not the "
        "quantized-activation matmul)"]
