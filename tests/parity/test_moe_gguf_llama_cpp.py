"""MoE GGUF files written by llama.cpp's own converter read as the checkpoints they came from.

Tiny Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 models are saved by transformers
(``save_pretrained``: per-expert tensors, the hub layout) with a byte-level BPE tokenizer
built from llama.cpp's ``ggml-vocab-gpt-2.gguf`` (the converter refuses tokenizers whose
pre-tokenizer it does not recognise), then converted by ``convert_hf_to_gguf.py`` from
``tests/llama_cpp_converter`` (see its README) — Mixtral as architecture ``llama`` with
expert tensors, ``qwen2moe``, ``qwen3moe``, ``deepseek2`` (V2 and V3; the V3 config gets the
``"scoring_func": "sigmoid"`` transformers does not save, or the file would say softmax) —
exactly as llama.cpp users convert models.

- ``--outtype f32``: the first 32 greedy tokens equal transformers' and the last-position
  logits agree within 1e-4 relative to the row's largest logit.
- ``--outtype q8_0``: experts ``[E, N, K]`` stay Q8_0 (3-D quantized tensors of the file)
  and the greedy tokens and prompt logits agree with the f32 references (every op forced to
  its reference) on the weights the ``gguf`` package decodes from the same file: logits within
  5e-3 of each position's largest (the Q8_0 kernels round activations to int16 per block; a
  wrong expert, layout or routing rule is off by O(1)).

Routing the files say nothing about follows llama.cpp's graphs: Mixtral and Qwen3-MoE
renormalise the top-k weights, Qwen2-MoE does not, so the Qwen checkpoints set
``norm_topk_prob`` accordingly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import zllm
from tests.conftest import REPO, write_config
from tests.gguf_files import with_metadata
from tests.gpt2_bpe import write_gpt2_tokenizer
from tests.parity.hf_models import PROMPT, hf_greedy, hf_logits
from zllm.plugins.host import PluginHost
from zllm.spec.errors import ZllmError
from zllm.weights import open_checkpoint
from zllm.weights.formats import QuantizedTensor

pytestmark = pytest.mark.slow  # a converter run per model and format (a few seconds each)

CONVERTER = REPO / "tests" / "llama_cpp_converter" / "convert_hf_to_gguf.py"
VOCAB = 50257  # ggml-vocab-gpt-2.gguf
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=50256, eos_token_id=50256, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
QWEN = dict(moe_intermediate_size=32, num_experts_per_tok=2)
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5)

# case -> (model_type, GGUF architecture, config overrides, zllm family)
CASES = {
    "mixtral": ("mixtral", "llama", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
                "mixtral"),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", dict(QWEN, num_experts=8, shared_expert_intermediate_size=64,
                                                norm_topk_prob=False), "qwen2_moe"),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", dict(QWEN, num_experts=8, norm_topk_prob=True, head_dim=32), "qwen3_moe"),
    "deepseek_v2": ("deepseek_v2", "deepseek2", DEEPSEEK, "deepseek"),
    # sigmoid scores, group-limited selection on score + correction bias, renormalised
    "deepseek_v3": ("deepseek_v3", "deepseek2", dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2,
                                                     norm_topk_prob=True, routed_scaling_factor=2.5), "deepseek"),
}


def _save(root: Path, case: str):
    """The case's model, seeded, widened x4 (as every parity test: random init is near
    uniform), saved with ``save_pretrained`` and the GPT-2 tokenizer."""
    model_type, _, overrides, _ = CASES[case]
    torch.manual_seed(sum(map(ord, case)))
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it steer the choice
                buf.copy_(torch.randn(buf.shape) * 0.1)
    path = root / case
    model.save_pretrained(path)
    if model_type == "deepseek_v3":
        # transformers does not save scoring_func; without it the converter writes softmax gating.
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "scoring_func": "sigmoid"}))
    write_gpt2_tokenizer(path)
    return model, path


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on ``hf_dir``; the file it wrote."""
    proc = subprocess.run([sys.executable, str(CONVERTER), str(hf_dir), "--outtype", outtype, "--outfile", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """``(case, transformers model, HF dir, {outtype: GGUF path})`` for one case."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    model, path = _save(root, case)
    files = {t: convert(path, root / f"{case}-{t}.gguf", t) for t in ("f32", "q8_0")}
    return case, model, path, files


def _engine(tmp: Path, model_path: Path, **sections) -> zllm.Engine:
    tmp.mkdir()
    return zllm.Engine.from_config(write_config(tmp, model_path, **sections))


def _greedy(engine) -> list[int]:
    return engine.generate({"prompt_token_ids": PROMPT, "max_tokens": 32, "stop_token_ids": [],
                            "ignore_eos": True})["token_ids"]


def test_converter_writes_the_architecture_and_stacked_experts(converted):
    case, _, _, files = converted
    reader = gguf.GGUFReader(files["q8_0"])
    assert reader.fields["general.architecture"].contents() == CASES[case][1]
    experts = {t.name: t for t in reader.tensors if "_exps." in t.name}
    assert experts and all(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in experts.values())
    assert all(len(t.shape) == 3 for t in experts.values())


def test_f32_file_gives_transformers_greedy_tokens(converted, tmp_path):
    case, model, _, files = converted
    engine = _engine(tmp_path / "e", files["f32"])
    assert engine.loaded.family_info.name == CASES[case][3]
    assert any(e.capability == "moe[f32]" for e in engine.loaded.ops.explain())
    ours, theirs = engine.prompt_logits(PROMPT)[-1], hf_logits(model, PROMPT)[-1]
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(theirs.abs().max())
    assert _greedy(engine) == hf_greedy(model)


def _dequantized_checkpoint(gguf_path: Path, hf_dir: Path, out_dir: Path) -> Path:
    """The file's weights decoded by ``gguf.quants.dequantize`` into an f32 safetensors
    checkpoint under the names and config zllm reads the file with."""
    ckpt = open_checkpoint(gguf_path, gguf_maps=PluginHost().gguf_maps)
    tensors = {}
    for name in ckpt.tensor_names():
        t = ckpt.tensor(name)
        if isinstance(t, QuantizedTensor):
            qtype = gguf.GGMLQuantizationType[t.fmt.upper()]
            t = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data.numpy(), qtype)))
        tensors[name] = t.float().contiguous()
    out_dir.mkdir()
    save_file(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(ckpt.config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((hf_dir / name).read_bytes())
    return out_dir


def test_q8_0_file_keeps_experts_quantized_and_matches_the_reference_on_decoded_weights(converted, tmp_path):
    case, _, hf_dir, files = converted
    quantized = _engine(tmp_path / "q", files["q8_0"])
    assert any(e.capability == "moe[q8_0]" for e in quantized.loaded.ops.explain())
    decoded = _dequantized_checkpoint(files["q8_0"], hf_dir, tmp_path / "decoded")
    ops = sorted({e.capability.split("[")[0] for e in quantized.loaded.ops.explain()})
    oracle = _engine(tmp_path / "o", decoded, backend={"force_reference": ops})
    ours, reference = quantized.prompt_logits(PROMPT), oracle.prompt_logits(PROMPT)
    # The Q8_0 kernels round activations to int16 per 32-weight block (gemv.py), the
    # reference does not: relative to each position's largest logit.
    scale = reference.abs().amax(dim=-1, keepdim=True)
    assert float(((ours - reference).abs() / scale).max()) <= 5e-3
    assert _greedy(quantized) == _greedy(oracle)


def test_expert_count_contradicting_the_expert_tensors_is_one_error_naming_a_tensor(converted, tmp_path):
    case, _, _, files = converted
    arch = CASES[case][1]
    count = gguf.GGUFReader(files["f32"]).fields[f"{arch}.expert_count"].contents()
    bad = with_metadata(files["f32"], tmp_path / "bad.gguf", {f"{arch}.expert_count": 2 * count})
    with pytest.raises(ZllmError, match=r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.") as e:
        _engine(tmp_path / "e", bad)
    assert str(2 * count) in str(e.value) and "\n" not in str(e.value)
