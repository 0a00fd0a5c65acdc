"""Everything a zllm plugin may import from zllm — and nothing else.

Backends and model families import this module only (an import-linter contract enforces
it), so the core can reorganise its internals without breaking plugins. Declare the API
you target in your plugin module::

    ZLLM_PLUGIN_API = "1.3"

and implement hooks from :mod:`zllm.plugins.hookspecs` decorated with :data:`hookimpl`.
"""

from zllm.capabilities import Capability
from zllm.capabilities.backend import Backend, BackendInfo
from zllm.capabilities.ops import AttentionMetadata, SamplingRow
from zllm.capabilities.parallel import SINGLE, ParallelContext, check_stage_windows, check_tensor_parallel
from zllm.domain.family import FamilyInfo, KVCacheShape
from zllm.domain.hf_config import config_flag, config_int
from zllm.domain.kv_cache import KVCacheSpec, KVLayerSpec, KVTensor
from zllm.domain.mla import MlaConfig, mla_config_from_hf
from zllm.domain.moe import (
    RouterConfig,
    RouterOutput,
    SharedExperts,
    is_moe_layer,
    router_config_from_hf,
    select_experts,
)
from zllm.domain.ops import CORE_CAPABILITIES
from zllm.domain.quant import dequantize
from zllm.domain.rope import (
    ROPE_TYPES,
    RopeParams,
    RopeTable,
    default_inv_freq,
    rope_cos_sin,
    rope_inv_freq,
    rope_params_from_config,
)
from zllm.kernels.registry import KernelRegistry
from zllm.plugins.hookspecs import PLUGIN_API_VERSION, hookimpl
from zllm.spec.errors import CheckpointError, ConfigError
from zllm.spec.tensor_spec import Shard, TensorSpec
from zllm.weights.formats import (
    BLOCK_LAYOUTS,
    DTYPE_OF_FORMAT,
    FORMATS,
    QuantizedTensor,
    WeightFormat,
    concat_projections,
    concat_rows,
    format_of,
    stack_weights,
)
from zllm.weights.gguf_maps import REQUIRED, ROPE_ADJACENT_PAIR, ROPE_HALF_ROTATION, ConfigKey, GGUFArchMap

__all__ = [
    "AttentionMetadata",
    "BLOCK_LAYOUTS",
    "Backend",
    "BackendInfo",
    "CORE_CAPABILITIES",
    "Capability",
    "CheckpointError",
    "ConfigError",
    "ConfigKey",
    "DTYPE_OF_FORMAT",
    "FORMATS",
    "FamilyInfo",
    "GGUFArchMap",
    "KVCacheShape",
    "KVCacheSpec",
    "KVLayerSpec",
    "KVTensor",
    "KernelRegistry",
    "MlaConfig",
    "PLUGIN_API_VERSION",
    "QuantizedTensor",
    "REQUIRED",
    "ROPE_ADJACENT_PAIR",
    "ROPE_HALF_ROTATION",
    "ROPE_TYPES",
    "RopeParams",
    "RouterConfig",
    "RouterOutput",
    "SamplingRow",
    "SharedExperts",
    "TensorSpec",
    "ParallelContext",
    "SINGLE",
    "Shard",
    "WeightFormat",
    "check_stage_windows",
    "check_tensor_parallel",
    "default_inv_freq",
    "dequantize",
    "format_of",
    "hookimpl",
    "is_moe_layer",
    "mla_config_from_hf",
    "RopeTable",
    "rope_cos_sin",
    "rope_inv_freq",
    "rope_params_from_config",
    "router_config_from_hf",
    "select_experts",
    "concat_projections",
    "concat_rows",
    "config_flag",
    "config_int",
    "stack_weights",
]
