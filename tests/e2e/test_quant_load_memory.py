"""Loading a quantized HF checkpoint makes no f32 copy of its weights (issue #14 §6, DESIGN
principle 7). The peak RSS growth of a fresh process over its post-import baseline stays within
1.1 x the checkpoint's stored bytes plus the KV cache through the load (the issue's bound), and
within that plus the CPU kernels' fixed working set through a prefill and two decode steps
(the first forward touches every weight: a decode-on-first-use copy would show there). The
checkpoint (FP8 with DeepSeek-V3's 128 x 128 scale blocks, ~29 MB stored) is big enough that an
f32 copy of its linear weights (~100 MB) could not hide in either margin.

The working set: ``linear`` decodes a quantized weight one f32 tile of about ``TILE_BYTES``
(4 MiB) at a time, with decoder temporaries of the same order, and BLAS keeps buffers for new
shapes; 16 MiB whatever the model's size (measured: 8 MiB transient, 6 MiB kept).

Measured in a subprocess (``VmHWM`` after ``clear_refs``, the way ``bench/worker.py`` does)
so nothing the test process already holds counts; the baseline is taken after the same
engine has loaded and run a tiny checkpoint of the same family and format, so the imports,
the native library and the kernels' first-use state are in it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests import quant_checkpoints as qc
from tests.conftest import copy_tokenizer
from zllm_backend_cpu.kernels.linear import TILE_BYTES

KV_BLOCKS, KV_BLOCK_SIZE = 4, 16
WORKING_SET = 4 * TILE_BYTES

RUNTIME = {"kv_cache": {"block_size": KV_BLOCK_SIZE, "num_blocks": KV_BLOCKS, "dtype": "f32"},
           "max_num_seqs": 1, "context_length": KV_BLOCKS * KV_BLOCK_SIZE, "prefix_cache_seqs": 0}

_MEASURE = r"""
import gc, json, sys
import zllm
from zllm.spec.config import config_from_dict

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def load(path):
    config = {"schema_version": 1, "model": {"path": path, "dtype": "auto"}, "backend": {"name": "cpu", "threads": 1},
              "runtime": json.loads(sys.argv[3])}
    return zllm.Engine.from_config(config_from_dict(config))

request = {"prompt_token_ids": list(range(3, 35)), "max_tokens": 3, "ignore_eos": True}
engine = load(sys.argv[1])
engine.generate(request)
del engine
gc.collect()
base = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
engine = load(sys.argv[2])
loaded = (status_kib("VmHWM") - base) * 1024
engine.generate(request)
print("RESULT " + json.dumps({"load": loaded, "run": (status_kib("VmHWM") - base) * 1024}))
"""


def _fp8_checkpoint(root: Path, name: str, hidden: int, ffn: int, layers: int) -> Path:
    dense, quantized = root / f"{name}-dense", root / name
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(6)
    transformers.LlamaForCausalLM(cfg).save_pretrained(dense)
    copy_tokenizer(dense)
    qc.write_fp8(dense, quantized, (128, 128))
    return quantized


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_loading_an_fp8_checkpoint_grows_rss_by_its_stored_bytes_not_an_f32_copy(tmp_path):
    small = _fp8_checkpoint(tmp_path, "small", 128, 256, 1)
    big = _fp8_checkpoint(tmp_path, "big", 1024, 2816, 2)
    stored = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    linear = 2 * (4 * 1024 * 1024 + 3 * 1024 * 2816)  # weights kept as FP8, one byte each
    kv = 2 * KV_BLOCKS * KV_BLOCK_SIZE * 2 * 1024 * 4  # K and V, 2 layers, 1024 wide, f32
    assert 3 * linear > 0.1 * stored + kv + WORKING_SET  # an f32 copy (4 bytes a weight) could not fit

    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(small), str(big), json.dumps(RUNTIME)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert growth["load"] <= 1.1 * stored + kv, (growth, stored, kv)
    assert growth["run"] <= 1.1 * stored + kv + WORKING_SET, (growth, stored, kv)
