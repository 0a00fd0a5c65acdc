"""The model-family contract: what a family publishes and what its factory class provides.

A family turns an HF-style config dict (``config.json``, or the weights layer's translation
of GGUF metadata) into a frozen spec, states the capabilities and tensors that spec needs,
and builds a model whose ``forward`` the runtime drives. Families never name a backend or a
file format.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Protocol

import attrs
import torch

from zllm.capabilities import Capability
from zllm.capabilities.ops import AttentionMetadata
from zllm.capabilities.parallel import SINGLE, ParallelContext
from zllm.domain.kv_cache import KVCacheSpec, KVLayerSpec
from zllm.spec.errors import PluginError
from zllm.spec.tensor_spec import TensorSpec
from zllm.weights.gguf_maps import GGUFArchMap


@attrs.frozen
class FamilyInfo:
    """A model family as published by the ``zllm_model_families`` hook.

    Attributes:
        name: family name (``llama``).
        model_types: HF ``model_type`` values it handles (GGUF architectures are mapped to
            these by the weights layer).
        factory: lazy ``"module:Class"`` reference to a :class:`ModelFamily` class.
        description: one line for ``zllm plugins``.
        gguf_architectures: GGUF ``general.architecture`` -> the
            :class:`~zllm.weights.gguf_maps.GGUFArchMap` that presents such a file in HF
            terms; each map's ``model_type`` must be one of ``model_types``. The plugin host
            collects them for every GGUF file it opens (plugin API 1.1).
    """

    name: str
    model_types: tuple[str, ...]
    factory: str
    description: str = ""
    gguf_architectures: dict[str, GGUFArchMap] = attrs.field(factory=dict)

    def load(self) -> ModelFamily:
        """Import and instantiate the family class."""
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)()


@attrs.frozen
class KVCacheShape:
    """Deprecated (plugin API 1.0): a model of ``num_layers`` GQA layers, K and V
    ``[NB, BS, num_kv_heads, head_dim]`` each, scale ``head_dim ** -0.5``. Publish
    :class:`~zllm.domain.kv_cache.KVCacheSpec` as ``Model.kv_spec`` instead; a model that
    still publishes ``kv_shape`` runs through :meth:`to_spec` (see :func:`model_kv_spec`).

    ``sliding_window``: set when *every* layer attends only to the last ``sliding_window``
    tokens (e.g. mistral); None when some layer sees the whole context.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def to_spec(self) -> KVCacheSpec:
        """The same cache as a :class:`KVCacheSpec`."""
        layer = KVLayerSpec.gqa(self.num_kv_heads, self.head_dim, self.sliding_window)
        return KVCacheSpec((layer,) * self.num_layers, self.head_dim ** -0.5)


def model_kv_spec(model: Any) -> KVCacheSpec:
    """The KV cache a built model declares: its ``kv_spec``, or (plugin API 1.0) its
    ``kv_shape`` converted, with a :class:`DeprecationWarning`.

    Raises:
        PluginError: the model declares neither (names its class).
    """
    spec = getattr(model, "kv_spec", None)
    if isinstance(spec, KVCacheSpec):
        return spec
    shape = getattr(model, "kv_shape", None)
    if isinstance(shape, KVCacheShape):
        warnings.warn(f"{type(model).__module__}:{type(model).__qualname__} publishes kv_shape (KVCacheShape), "
                      "deprecated since plugin API 1.1; publish kv_spec (KVCacheSpec)",
                      DeprecationWarning, stacklevel=2)
        return shape.to_spec()
    raise PluginError(f"model {type(model).__module__}:{type(model).__qualname__} declares no KV cache: it needs a "
                      f"kv_spec attribute (KVCacheSpec)")


class Model(Protocol):
    """A built model. ``forward`` runs one batch of a Prefill or a Decode Round.

    A model that can propose its own continuations for speculative decoding (``speculative:
    {method: mtp}``) also has an ``mtp`` attribute, a :class:`MultiTokenPredictor` (None when
    its checkpoint carries no such layers; see :func:`model_mtp`), and its ``forward`` takes
    ``return_hidden=True``: it then returns ``(logits, hidden)``, ``hidden`` the ``[T, C]``
    vectors its output head maps to logits (every row, not only ``logits_indices``).
    """

    vocab_size: int
    context_length: int
    kv_spec: KVCacheSpec

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of selected tokens.

        Args:
            token_ids: int64 ``[T]``, all sequences' new tokens flattened.
            positions: int64 ``[T]``, absolute position of each token in its sequence.
            meta: where the tokens live in the paged KV cache.
            kv_caches: per layer, one cache tensor ``[NB, BS, Hc, Dc]`` per tensor its
                ``kv_spec`` layer declares, in that order (``(k_cache, v_cache)`` for GQA).
            logits_indices: int64 ``[S']``, which of the ``T`` rows need logits.

        Returns:
            f32 ``[S', V]``.
        """
        ...


class MultiTokenPredictor(Protocol):
    """A model's multi-token-prediction layer (DeepSeek-V3's MTP module, arXiv:2412.19437
    §2.2): from the target's hidden state at position ``i`` and the token at ``i + 1`` it
    predicts the token at ``i + 2``, attending over its own paged KV cache of earlier such
    rows. The runtime drives it (:class:`zllm.runtime.mtp.MtpProposer`).

    Attributes:
        kv_spec: the layers of its own KV cache (as ``Model.kv_spec``).
    """

    kv_spec: KVCacheSpec

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, ...]],
                rows: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden states at ``rows``.

        Args:
            token_ids: int64 ``[T]``, the token after each row's position.
            hidden: ``[T, C]``, the target's hidden state at each position (``Model.forward``
                with ``return_hidden``), or this layer's own output when it is applied again.
            positions, meta, kv_caches: as for ``Model.forward``, over its own cache.
            rows: int64 ``[S']``, which of the ``T`` rows to return.

        Returns:
            ``[S', C]``: input to :meth:`logits`, and the ``hidden`` of the next application.
        """
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """f32 ``[S, V]`` logits of the token each ``[S, C]`` output row predicts."""
        ...


def model_mtp(model: Any) -> MultiTokenPredictor | None:
    """The model's multi-token-prediction layer, or None when it has none (a family without
    MTP, or a checkpoint saved without its nextn layers)."""
    return getattr(model, "mtp", None)


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

    def tensor_specs(self, spec: Any, parallel: ParallelContext = SINGLE) -> dict[str, TensorSpec]:
        """Every tensor the model reads, by canonical (HF) name.

        ``parallel`` (opt-in: a family whose method lacks the argument runs on one rank only,
        and ``parallel.tensor`` > 1 is refused naming it): this rank's place; each spec
        carries the ``shard`` the rank loads. Raises ConfigError (``parallel.tensor``) when
        the model's sizes cannot be split that way."""
        ...

    def build(self, spec: Any, weights: dict[str, Any], ops: Any, parallel: ParallelContext = SINGLE) -> Model:
        """Bind loaded weights and bound kernels into a runnable model; with ``parallel``
        (opt-in as for :meth:`tensor_specs`) the weights are this rank's shards and the
        model's forward calls the context's collectives."""
        ...
