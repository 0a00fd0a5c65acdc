"""Tensors a checkpoint holds that are no weights follow transformers, not a load failure:
the ``rotary_emb.inv_freq`` buffers older transformers versions saved with the weights are
skipped (``--explain`` names each), and with ``model.safetensors.index.json`` the index
decides which shard's copy of a tensor is read. Anything else unaccounted for stays an error.

The checkpoints are a tiny Llama saved by transformers' ``save_pretrained``; the buffers are
the model's own ``rotary_emb.inv_freq`` under the per-layer names transformers 4.3x wrote
(``model.layers.{i}.self_attn.rotary_emb.inv_freq``, a persistent buffer then).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import zllm
from tests.cli.conftest import zllm as run_zllm
from tests.conftest import copy_tokenizer, write_config
from tests.parity.hf_models import PROMPT
from zllm.spec.errors import ZllmError

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved by transformers; returns (model, dir, its tensors)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    path = tmp_path_factory.mktemp("llama") / "hf"
    model.save_pretrained(path)
    copy_tokenizer(path)
    return model, path, load_file(path / "model.safetensors")


def _greedy(engine) -> list[int]:
    return engine.generate({"prompt_token_ids": PROMPT, "max_tokens": 16, "stop_token_ids": []})["token_ids"]


def _with_inv_freq(model, src, tensors, dst):
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    inv_freq = model.model.rotary_emb.inv_freq
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone()
               for i in range(CONFIG["num_hidden_layers"])}
    save_file({**tensors, **buffers}, dst / "model.safetensors", metadata={"format": "pt"})
    return sorted(buffers)


def test_inv_freq_buffers_are_skipped_and_explained(saved, tmp_path):
    model, path, tensors = saved
    buffers = _with_inv_freq(model, path, tensors, tmp_path / "old")
    reference = _greedy(zllm.Engine.from_config(write_config(tmp_path, path)))
    engine = zllm.Engine.from_config(write_config(tmp_path, tmp_path / "old"))
    assert sorted(engine.loaded.checkpoint.skipped_tensors) == buffers
    assert buffers[0] not in engine.loaded.checkpoint.tensor_names()
    assert _greedy(engine) == reference

    proc = run_zllm("run", "--config", write_config(tmp_path, tmp_path / "old"), "--explain", "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stderr
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("skipped tensor: ")]
    assert [line.split()[2] for line in skipped] == buffers
    assert all("recomputed from the config" in line for line in skipped)


def test_a_tensor_no_model_uses_is_still_an_error(saved, tmp_path):
    _, path, tensors = saved
    (tmp_path / "extra").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "extra" / name).write_bytes((path / name).read_bytes())
    save_file({**tensors, "model.layers.0.self_attn.rotary_emb.scale": torch.ones(4)},
              tmp_path / "extra" / "model.safetensors")
    with pytest.raises(ZllmError, match=r"model.layers.0.self_attn.rotary_emb.scale.*unused"):
        zllm.Engine.from_config(write_config(tmp_path, tmp_path / "extra"))


def test_the_index_decides_which_shard_copy_is_read(saved, tmp_path):
    """A shard holding a stale copy of a tensor the index maps to another shard: transformers
    reads the mapped one; so does zllm, and it says which copy it skipped."""
    _, path, tensors = saved
    d = tmp_path / "sharded"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((path / name).read_bytes())
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    stale = second[0]
    save_file({**{n: tensors[n] for n in first}, stale: torch.zeros_like(tensors[stale])},
              d / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in second}, d / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    engine = zllm.Engine.from_config(write_config(tmp_path, d))
    assert engine.loaded.checkpoint.skipped_tensors == {
        f"{stale} (model-00001-of-00002.safetensors)": "model.safetensors.index.json maps it to "
                                                       "model-00002-of-00002.safetensors"}
    assert _greedy(engine) == _greedy(zllm.Engine.from_config(write_config(tmp_path, path)))
