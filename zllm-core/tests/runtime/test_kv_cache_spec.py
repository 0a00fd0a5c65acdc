"""The family's KV cache declaration: the paged cache allocates what each layer declares (GQA's
K and V, an MLA latent row, nothing), its bytes are computed in one place, the window frees
blocks only when every layer slides, and an automatically sized cache follows the memory."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zllm.domain.family import KVCacheShape, model_kv_spec
from zllm.domain.kv_cache import KVCacheSpec, KVLayerSpec, KVTensor
from zllm.engine.loader import AUTO_KV_MEMORY_FRACTION, auto_num_blocks
from zllm.runtime.kv_cache import PagedKVCache, SeqKV
from zllm.spec.errors import ConfigError, PluginError

GQA = KVLayerSpec.gqa(num_kv_heads=2, head_dim=8)
# DeepSeek-V2-Lite's MLA row: kv_lora_rank 512 + qk_rope_head_dim 64, one shared "head", no V.
MLA = KVLayerSpec((KVTensor("latent", 1, 512 + 64),))


def test_gqa_layers_get_k_and_v_of_kv_heads_by_head_dim():
    kv = PagedKVCache(KVCacheSpec((GQA,) * 3, 8 ** -0.5), num_blocks=5, block_size=4)

    assert len(kv.layers) == 3
    assert all([tuple(t.shape) for t in layer] == [(5, 4, 2, 8)] * 2 for layer in kv.layers)
    assert kv.nbytes == sum(t.nbytes for layer in kv.layers for t in layer) == 3 * 2 * 5 * 4 * 2 * 8 * 4


def test_an_mla_layer_caches_one_latent_row_and_a_layer_may_cache_nothing():
    spec = KVCacheSpec((MLA, KVLayerSpec(()), GQA), attention_scale=0.1)

    kv = PagedKVCache(spec, num_blocks=3, block_size=16, dtype=torch.bfloat16)

    assert [[tuple(t.shape) for t in layer] for layer in kv.layers] == [[(3, 16, 1, 576)], [], [(3, 16, 2, 8)] * 2]
    assert spec.token_bytes(2) == (576 + 2 * 2 * 8) * 2
    assert kv.nbytes == sum(t.nbytes for layer in kv.layers for t in layer) == 3 * spec.block_bytes(16, 2)


@given(layers=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 64), st.booleans()), min_size=1, max_size=4),
       block_size=st.integers(1, 32), itemsize=st.sampled_from([1, 2, 4]))
def test_block_bytes_is_every_cached_element_of_a_block(layers, block_size, itemsize):
    spec = KVCacheSpec(tuple(KVLayerSpec.gqa(h, d) if gqa else KVLayerSpec((KVTensor("latent", h, d),))
                             for h, d, gqa in layers), attention_scale=1.0)

    expected = sum((2 if gqa else 1) * h * d for h, d, gqa in layers) * block_size * itemsize
    assert spec.block_bytes(block_size, itemsize) == expected


def test_blocks_are_freed_by_the_window_only_when_every_layer_slides():
    all_sliding = KVCacheSpec((KVLayerSpec.gqa(1, 4, 4), KVLayerSpec.gqa(1, 4, 8)), 0.5)
    mixed = KVCacheSpec((KVLayerSpec.gqa(1, 4, 4), KVLayerSpec.gqa(1, 4)), 0.5)
    assert all_sliding.evictable_window == 8 and mixed.evictable_window is None

    kv = PagedKVCache(all_sliding, num_blocks=8, block_size=4)
    seq = SeqKV()
    kv.append(seq, 12)
    kv.append(seq, 1)  # the next query at 12 reads keys 5..12: block 0 (keys 0..3) is out of every window
    assert seq.blocks[0] == -1 and seq.num_evicted == 1

    kept = PagedKVCache(mixed, num_blocks=8, block_size=4)
    seq = SeqKV()
    kept.append(seq, 12)
    kept.append(seq, 1)
    assert -1 not in seq.blocks


def test_the_attention_scale_is_the_familys_not_the_cached_width():
    # An MLA cache row is 576 wide; DeepSeek scales scores by 1/sqrt(qk_nope + qk_rope) = 1/sqrt(192).
    spec = KVCacheSpec((MLA,), attention_scale=192 ** -0.5)
    assert spec.attention_scale == pytest.approx(0.0721687836)


@pytest.mark.parametrize("build, message", [
    (lambda: KVTensor("k", 0, 8), "num_heads must be an int > 0"),
    (lambda: KVLayerSpec((KVTensor("k", 1, 8), KVTensor("k", 1, 8))), "two tensors of one name"),
    (lambda: KVLayerSpec.gqa(1, 8, sliding_window=0), "sliding_window must be an int > 0"),
    (lambda: KVCacheSpec((), 1.0), "at least one layer"),
    (lambda: KVCacheSpec((GQA,), float("nan")), "finite number > 0"),
])
def test_an_inconsistent_cache_declaration_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_model_publishing_the_old_kv_shape_still_runs_with_a_deprecation_warning():
    class OldModel:
        kv_shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=16, sliding_window=32)

    with pytest.warns(DeprecationWarning, match="publishes kv_shape"):
        spec = model_kv_spec(OldModel())

    assert spec == KVCacheSpec((KVLayerSpec.gqa(2, 16, 32),) * 2, 16 ** -0.5)


def test_a_model_publishing_no_cache_declaration_is_a_plugin_error():
    class NoCache:
        pass

    with warnings.catch_warnings(), pytest.raises(PluginError, match="declares no KV cache"):
        warnings.simplefilter("error")
        model_kv_spec(NoCache())


# ---------------------------------------------------------------------------- automatic sizing

SPEC = KVCacheSpec((GQA,) * 4, 8 ** -0.5)  # 4 layers * 2 * 2 heads * 8 = 128 elements per token
BLOCK = SPEC.block_bytes(16, 4)  # 8 KiB


def _auto(available: int, weights: int = 0, context: int = 256, seqs: int = 4) -> int:
    return auto_num_blocks(SPEC, block_size=16, itemsize=4, context_length=context, max_seqs=seqs,
                           available_bytes=available, weight_bytes=weights, device="cpu")


def test_plenty_of_memory_sizes_the_cache_for_every_sequence_at_full_context():
    assert BLOCK == 8192
    assert _auto(available=1 << 40) == 16 * 4  # ceil(256 / 16) blocks for each of 4 sequences


def test_the_cache_takes_the_documented_share_of_memory_less_the_weights():
    available, weights = 1_000_000, 300_000
    budget = int(available * AUTO_KV_MEMORY_FRACTION) - weights

    assert _auto(available, weights) == budget // BLOCK == 61


@given(available=st.integers(0, 1 << 32), weights=st.integers(0, 1 << 31), context=st.integers(1, 4096),
       seqs=st.integers(1, 16))
def test_the_automatic_size_never_exceeds_memory_nor_what_the_sequences_can_use(available, weights, context, seqs):
    per_seq = -(-context // 16)
    try:
        blocks = _auto(available, weights, context, seqs)
    except ConfigError:
        assert (int(available * AUTO_KV_MEMORY_FRACTION) - weights) // BLOCK < per_seq
        return
    assert per_seq <= blocks <= per_seq * seqs
    assert blocks * BLOCK + weights <= available * AUTO_KV_MEMORY_FRACTION


def test_memory_too_small_for_one_sequence_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"runtime.kv_cache.num_blocks: null sizes the KV cache from memory, but one "
                                          r"256-token sequence needs 0.1 MiB .* set runtime.context_length lower"):
        _auto(available=100_000, weights=0)
