"""Every name the CPU kernels take from zllm, in one place.

Kernels import from here only, never from ``zllm`` directly, so that switching to the
public plugin module (``zllm.plugin_api``) is a change of these imports alone.
"""

from __future__ import annotations

from zllm.capabilities import Capability
from zllm.capabilities.ops import AttentionMetadata, SamplingRow
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor, format_of

__all__ = ["AttentionMetadata", "BLOCK_LAYOUTS", "Capability", "QuantizedTensor", "SamplingRow", "format_of"]
