"""mixtral, qwen2_moe and qwen3_moe match HF transformers on tiny random checkpoints that
transformers saves (the per-expert tensors ``save_pretrained`` writes, the hub layout), and
on the same weights rewritten in transformers 5's fused expert layout.

Covered: softmax top-k always renormalised (Mixtral), ``norm_topk_prob`` both ways (Qwen),
Qwen2-MoE's sigmoid-gated shared expert, dense layers from ``mlp_only_layers`` and
``decoder_sparse_step``. Tolerances: f32 -> last-position logits within 1e-4 relative (to
the row's largest logit), the
prompt's logits within 1e-4 (abs), and 32 greedy tokens identical to
``generate(do_sample=False)``.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import zllm
from tests.conftest import write_config
from tests.parity.hf_models import PROMPT, hf_greedy, hf_logits, save_widened
from zllm.spec.errors import ZllmError

VOCAB = 512  # the stories260K tokenizer
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_attention_heads=4, num_key_value_heads=2)
QWEN = dict(moe_intermediate_size=32, num_experts_per_tok=2)

# case -> (model_type, config overrides)
CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "qwen2_moe-shared-dense-layer": ("qwen2_moe", dict(QWEN, num_experts=8, shared_expert_intermediate_size=48,
                                                       norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen2_moe-renormalised-sparse-step": ("qwen2_moe", dict(QWEN, num_experts=4, shared_expert_intermediate_size=64,
                                                             norm_topk_prob=True, decoder_sparse_step=2)),
    "qwen3_moe-renormalised": ("qwen3_moe", dict(QWEN, num_experts=8, norm_topk_prob=True)),
    "qwen3_moe-not-renormalised": ("qwen3_moe", dict(QWEN, num_experts=4, num_experts_per_tok=3, norm_topk_prob=False,
                                                     head_dim=32)),
}
CONFIGS = {"mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig}
MODELS = {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
          "qwen3_moe": transformers.Qwen3MoeForCausalLM}


def save_moe(tmp_path, case: str):
    """The case's model, widened x4, saved by ``save_pretrained`` with the stories260K tokenizer."""
    model_type, overrides = CASES[case]
    config = CONFIGS[model_type](**{**BASE, **overrides})
    path = tmp_path / case
    return save_widened(path, MODELS[model_type], config, sum(map(ord, case))), path


def _check(engine, model):
    ours, theirs = engine.prompt_logits(PROMPT), hf_logits(model, PROMPT)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # relative to the row's scale: elementwise, a logit near zero has no meaningful relative error
    assert float((ours[-1] - theirs[-1]).abs().max()) <= 1e-4 * float(theirs[-1].abs().max())
    out = engine.generate({"prompt_token_ids": PROMPT, "max_tokens": 32, "stop_token_ids": []})
    assert out["token_ids"] == hf_greedy(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    model, path = save_moe(tmp_path, case)
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    assert engine.loaded.family_info.name == CASES[case][0]
    assert any(e.capability == "moe[f32]" for e in engine.loaded.ops.explain())
    _check(engine, model)


def _fuse_experts(path, n_experts: int) -> None:
    """Rewrite a saved qwen checkpoint in transformers 5's fused layout:
    ``mlp.experts.gate_up_proj [E, 2N, C]`` (gate rows, then up rows) and ``mlp.experts.down_proj [E, C, N]``."""
    tensors = load_file(path / "model.safetensors")
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for layer in layers:
        p = f"{layer}.mlp.experts."
        gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(n_experts)]
        up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in range(n_experts)]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(n_experts)]
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        tensors[p + "down_proj"] = torch.stack(down)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_fused_expert_layout_gives_the_same_model(tmp_path):
    model, path = save_moe(tmp_path, "qwen3_moe-renormalised")
    _fuse_experts(path, 8)
    _check(zllm.Engine.from_config(write_config(tmp_path, path)), model)


def _edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok 9 > num_experts 8"),
    (dict(mlp_only_layers=[0, 5]), r"mlp_only_layers \[0, 5\] names layer 5, but the model has 2 layers"),
    (dict(norm_topk_prob="yes"), r"norm_topk_prob 'yes' is not true or false"),
    (dict(moe_intermediate_size=None), r"lacks required key 'moe_intermediate_size'"),
])
def test_contradictory_moe_config_is_one_line_naming_the_key(tmp_path, changes, message):
    _, path = save_moe(tmp_path, "qwen2_moe-shared-dense-layer")
    _edit_config(path, **changes)
    if changes.get("moe_intermediate_size", 0) is None:
        data = json.loads((path / "config.json").read_text())
        del data["moe_intermediate_size"]
        (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ZllmError, match=message) as e:
        zllm.Engine.from_config(write_config(tmp_path, path))
    assert "\n" not in str(e.value)


def test_a_missing_expert_tensor_is_named_before_weights_are_read(tmp_path):
    _, path = save_moe(tmp_path, "mixtral")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ZllmError, match=r"'model.layers.1.block_sparse_moe.experts.3.w2.weight' missing"):
        zllm.Engine.from_config(write_config(tmp_path, path))
