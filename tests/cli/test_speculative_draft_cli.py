"""``zllm run`` with a draft model: stories260K drafted by its own Q8_0 GGUF file prints the
reference story and its acceptance; a draft that cannot serve the target is one line naming
``speculative.draft.model.path``."""

from __future__ import annotations

import re

import torch
from ruamel.yaml import YAML

from tests.cli.conftest import one_line_error, zllm
from tests.conftest import CONFIGS, MODEL_DIR, REFERENCE_TEXT, copy_tokenizer, write_config


def test_run_with_a_gguf_draft_of_an_hf_target_prints_the_reference_story(tmp_path):
    shipped = YAML().load(CONFIGS / "stories260k-hf.yaml")
    shipped["model"]["path"] = str(MODEL_DIR / "hf")
    shipped["runtime"] = {"batch_invariant": True}
    shipped["speculative"] = {"method": "draft", "num_tokens": 4,
                              "draft": {"model": {"path": str(MODEL_DIR / "gguf" / "stories260K-q8_0.gguf")}}}
    cfg = tmp_path / "spec.yaml"
    with cfg.open("w") as f:
        YAML().dump(shipped, f)
    proc = zllm("run", "--config", cfg, "--explain")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(REFERENCE_TEXT)
    assert f"  draft model: {MODEL_DIR / 'gguf' / 'stories260K-q8_0.gguf'}" in proc.stderr, proc.stderr
    accepted = re.search(r"speculation: draft K=4 (\d+)% of proposals accepted", proc.stderr)
    assert accepted and int(accepted.group(1)) > 50, proc.stderr  # the same model, quantized, mostly agrees


def test_a_draft_with_a_shorter_context_is_one_line_naming_its_key(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    draft = tmp_path / "draft"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
                     ).save_pretrained(draft, safe_serialization=True)
    copy_tokenizer(draft)
    cfg = write_config(tmp_path, MODEL_DIR / "hf",
                       speculative={"method": "draft", "draft": {"model": {"path": str(draft)}}})
    proc = zllm("run", "--config", cfg)
    assert proc.returncode == 2
    line = one_line_error(proc)
    assert line.startswith("error: speculative.draft.model.path:") and "128 tokens" in line, proc.stderr
