"""A family distribution hands the core its GGUF architecture maps as data: a third-party
family adds a GGUF architecture with no core change, and maps that clash are refused."""

from __future__ import annotations

from importlib import metadata

import gguf
import numpy as np
import pytest

from zllm.engine.loader import resolve_family
from zllm.plugins.host import PluginHost
from zllm.spec.errors import PluginError, UnknownArchitectureError
from zllm.weights import open_checkpoint

FAMILY_SOURCE = '''
from zllm.plugin_api import ROPE_HALF_ROTATION, ConfigKey, FamilyInfo, GGUFArchMap, hookimpl

ZLLM_PLUGIN_API = "1.1"

TINY = GGUFArchMap(
    model_type={model_type!r},
    constants={{"hidden_act": "silu"}},
    keys=(
        ConfigKey("hidden_size", "embedding_length"),
        ConfigKey("num_hidden_layers", "block_count"),
        ConfigKey("num_key_value_heads", "attention.head_count_kv", 2),
    ),
    global_tensors={{"tok": "model.embed_tokens", "out_norm": "model.norm"}},
    block_tensors={{"wq": "self_attn.q_proj"}},
    bias_flags={{}},
    rope_layout=ROPE_HALF_ROTATION,
)


@hookimpl
def zllm_model_families():
    return [FamilyInfo(name="tiny", model_types=("tiny",), factory="unused:Family",
                       gguf_architectures={{{arch!r}: TINY}})]
'''


def _tiny_gguf(path, arch: str = "tiny-gguf"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.embedding_length", 8)
    w.add_uint32(f"{arch}.block_count", 1)
    rng = np.random.default_rng(0)
    for name, shape in (("tok.weight", (5, 8)), ("out_norm.weight", (8,)), ("blk.0.wq.weight", (8, 8))):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_eps() -> list[metadata.EntryPoint]:
    return [ep for ep in metadata.entry_points(group="zllm") if ep.name == "llama"]


def test_a_gguf_architecture_a_third_party_family_maps_opens_through_its_map(plugins, tmp_path):
    ep = plugins.dist("tiny", FAMILY_SOURCE.format(model_type="tiny", arch="tiny-gguf"))
    host = PluginHost(entry_points=[ep, *_llama_eps()])

    ckpt = open_checkpoint(_tiny_gguf(tmp_path / "tiny.gguf"), gguf_maps=host.gguf_maps)

    assert ckpt.config == {"model_type": "tiny", "hidden_act": "silu", "hidden_size": 8, "num_hidden_layers": 1,
                           "num_key_value_heads": 2, "tie_word_embeddings": True}
    assert sorted(ckpt.tensor_names()) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                           "model.norm.weight"]
    assert resolve_family(host, ckpt).name == "tiny"
    assert sorted(host.gguf_maps) == ["llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "tiny-gguf"]


def test_without_the_family_the_architecture_is_unknown_and_the_mapped_ones_are_listed(tmp_path):
    host = PluginHost(entry_points=_llama_eps())

    ckpt = open_checkpoint(_tiny_gguf(tmp_path / "tiny.gguf"), gguf_maps=host.gguf_maps)

    with pytest.raises(UnknownArchitectureError, match="no GGUF map for architecture 'tiny-gguf'; mapped "
                                                       "architectures: llama, qwen2, qwen2moe, qwen3, qwen3moe"):
        _ = ckpt.config


def test_the_core_alone_maps_no_gguf_architecture(tmp_path):
    ckpt = open_checkpoint(_tiny_gguf(tmp_path / "tiny.gguf"))

    assert ckpt.metadata["general.architecture"] == "tiny-gguf"  # the header reads without a map
    with pytest.raises(UnknownArchitectureError, match="mapped architectures: none"):
        _ = ckpt.config


def test_two_families_mapping_one_architecture_is_an_error_naming_both(plugins):
    ep = plugins.dist("tiny", FAMILY_SOURCE.format(model_type="tiny", arch="llama"))

    with pytest.raises(PluginError, match="GGUF architecture 'llama' is mapped by families 'llama' and 'tiny'"):
        PluginHost(entry_points=[ep, *_llama_eps()])


def test_a_map_to_a_model_type_the_family_does_not_handle_is_an_error(plugins):
    ep = plugins.dist("tiny", FAMILY_SOURCE.format(model_type="llama", arch="tiny-gguf"))

    with pytest.raises(PluginError, match="family 'tiny' maps GGUF architecture 'tiny-gguf' to model_type 'llama', "
                                          "which it does not handle"):
        PluginHost(entry_points=[ep])
