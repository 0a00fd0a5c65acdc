"""``runtime.kv_cache.num_blocks: null``: the KV cache is sized from the memory the backend
reports before the weights are read, less the weights this rank holds (engine/loader.py)."""

from __future__ import annotations

import math

import psutil
import pytest

import zllm
from tests.conftest import MODEL_DIR, write_config
from zllm.engine.loader import AUTO_KV_MEMORY_FRACTION, auto_num_blocks, available_memory_bytes, model_kv_spec
from zllm.spec.errors import ConfigError

HF_DIR = MODEL_DIR / "hf"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = write_config(tmp_path_factory.mktemp("auto-kv"), HF_DIR,
                       runtime={"kv_cache": {"num_blocks": None, "block_size": 16}, "context_length": 256,
                                "max_num_seqs": 3, "prefix_cache_seqs": 2})
    return zllm.Engine.from_config(cfg)


def test_plenty_of_memory_gives_every_sequence_its_full_context(engine):
    # 3 running + 2 parked sequences of 256 tokens in blocks of 16
    assert engine.loaded.kv_num_blocks == math.ceil(256 / 16) * (3 + 2)
    out = engine.generate({"prompt": "Once upon a time", "max_tokens": 8})
    assert len(out["token_ids"]) == 8


def test_the_weights_come_off_the_budget_before_the_blocks(engine):
    spec = model_kv_spec(engine.loaded.model)
    block = spec.block_bytes(16, 4)
    available = 100 * block
    kwargs = dict(block_size=16, itemsize=4, context_length=64, max_seqs=1000, available_bytes=available,
                  device="cpu")
    free = auto_num_blocks(spec, weight_bytes=0, **kwargs)
    assert free == int(available * AUTO_KV_MEMORY_FRACTION) // block
    assert auto_num_blocks(spec, weight_bytes=10 * block, **kwargs) == free - 10


def test_memory_for_less_than_one_sequence_names_the_key_and_what_to_set(engine):
    spec = model_kv_spec(engine.loaded.model)
    with pytest.raises(ConfigError, match="set runtime.context_length lower or runtime.kv_cache.num_blocks") as info:
        auto_num_blocks(spec, block_size=16, itemsize=4, context_length=4096, max_seqs=1,
                        available_bytes=spec.block_bytes(16, 4) * 10, weight_bytes=0, device="cpu")
    assert info.value.path == "runtime.kv_cache.num_blocks"


def test_ranks_on_one_host_split_its_ram_between_them():
    class HostMemoryBackend:  # a backend with no device query of its own allocates from host RAM
        pass

    shares = [available_memory_bytes(HostMemoryBackend(), "cpu", local_ranks=n) for n in (1, 4)]
    host = psutil.virtual_memory().available
    assert shares[0] == pytest.approx(host, rel=0.25)
    assert shares[1] == pytest.approx(host / 4, rel=0.25)
