"""The model-family contract: what a family publishes and what its factory class provides.

A family turns an HF-style config dict (``config.json``, or the weights layer's translation
of GGUF metadata) into a frozen spec, states the capabilities and tensors that spec needs,
and builds a model whose ``forward`` the runtime drives. Families never name a backend or a
file format.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import attrs
import torch

from zllm.capabilities import Capability
from zllm.capabilities.ops import AttentionMetadata
from zllm.spec.tensor_spec import TensorSpec


@attrs.frozen
class FamilyInfo:
    """A model family as published by the ``zllm_model_families`` hook.

    Attributes:
        name: family name (``llama``).
        model_types: HF ``model_type`` values it handles (GGUF architectures are mapped to
            these by the weights layer).
        factory: lazy ``"module:Class"`` reference to a :class:`ModelFamily` class.
        description: one line for ``zllm plugins``.
    """

    name: str
    model_types: tuple[str, ...]
    factory: str
    description: str = ""

    def load(self) -> ModelFamily:
        """Import and instantiate the family class."""
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)()


@attrs.frozen
class KVCacheShape:
    """Per-layer KV cache geometry a model needs: ``num_layers`` x ``[NB, BS, num_kv_heads, head_dim]``.

    ``sliding_window``: set when *every* layer attends only to the last ``sliding_window``
    tokens (e.g. mistral), so the KV cache may free blocks that fell out of the window;
    None when some layer sees the whole context (then every block is kept).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


class Model(Protocol):
    """A built model. ``forward`` runs one batch of a Prefill or a Decode Round."""

    vocab_size: int
    context_length: int
    kv_shape: KVCacheShape

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of selected tokens.

        Args:
            token_ids: int64 ``[T]``, all sequences' new tokens flattened.
            positions: int64 ``[T]``, absolute position of each token in its sequence.
            meta: where the tokens live in the paged KV cache.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[NB, BS, Hkv, D]``.
            logits_indices: int64 ``[S']``, which of the ``T`` rows need logits.

        Returns:
            f32 ``[S', V]``.
        """
        ...


class ModelFamily(Protocol):
    """What a family's factory class provides (see :class:`FamilyInfo`)."""

    name: str

    def parse_config(self, config: dict[str, Any], source: str) -> Any:
        """Frozen spec from an HF-style config dict; raises CheckpointError naming ``source``."""
        ...

    def required_capabilities(self, spec: Any, weight_formats: dict[str, str]) -> frozenset[Capability]:
        """Capabilities this spec needs given each tensor's format (canonical name -> format)."""
        ...

    def format_capabilities(self, fmt: str) -> frozenset[Capability]:
        """Capabilities any model of this family needs when every weight is stored in ``fmt``.

        ``fmt`` is a weight format name (``f32``, ``q8_0`` ...). Needs no config: it is what
        ``zllm compat`` checks each backend against, so it must come from the same code as
        :meth:`required_capabilities`.
        """
        ...

    def tensor_specs(self, spec: Any) -> dict[str, TensorSpec]:
        """Every tensor the model reads, by canonical (HF) name."""
        ...

    def build(self, spec: Any, weights: dict[str, Any], ops: Any) -> Model:
        """Bind loaded weights and bound kernels into a runnable model."""
        ...
