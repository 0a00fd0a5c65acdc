"""``zllm run`` with speculative decoding: the same story, the method and its acceptance on
stderr, ``--explain`` names the method, and a bad setting is one line naming its key."""

from __future__ import annotations

import re

from ruamel.yaml import YAML

from tests.cli.conftest import one_line_error, zllm
from tests.conftest import CONFIGS, MODEL_DIR, REFERENCE_TEXT, write_config


def test_run_with_ngram_speculation_prints_the_reference_story_and_its_acceptance(tmp_path):
    shipped = YAML().load(CONFIGS / "stories260k-hf.yaml")
    shipped["model"]["path"] = str(MODEL_DIR / "hf")
    # Batch-invariant kernels: verify rows compute exactly what one-row decode steps compute.
    shipped["runtime"] = {"batch_invariant": True}
    shipped["speculative"] = {"method": "ngram", "num_tokens": 3}
    cfg = tmp_path / "spec.yaml"
    with cfg.open("w") as f:
        YAML().dump(shipped, f)
    proc = zllm("run", "--config", cfg, "--explain")
    del shipped["speculative"]
    with cfg.open("w") as f:
        YAML().dump(shipped, f)
    plain = zllm("run", "--config", cfg)
    assert proc.returncode == plain.returncode == 0, proc.stderr
    assert proc.stdout == plain.stdout and proc.stdout.startswith(REFERENCE_TEXT)
    assert re.search(r"speculation: ngram K=3 \d+% of proposals accepted", proc.stderr), proc.stderr
    assert "speculative decoding: ngram, up to 3 proposed tokens per step (adapted per sequence" in proc.stderr


def test_a_bad_speculative_setting_is_one_line_naming_its_key(tmp_path):
    cfg = write_config(tmp_path, MODEL_DIR / "hf", speculative={"method": "ngram", "num_tokens": 0})
    proc = zllm("run", "--config", cfg)
    assert proc.returncode == 2
    assert one_line_error(proc).startswith("error: speculative.num_tokens:"), proc.stderr
