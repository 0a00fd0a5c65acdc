"""What a model caches per token: the per-layer KV cache declaration a family makes.

Dimension legend: ``NB`` cache blocks, ``BS`` block size (tokens per block), ``Hc`` heads of
one cached tensor, ``Dc`` its width per head.

A family declares, for each layer, the named per-token tensors it caches and their widths,
and the layer's sliding window; the runtime's paged cache allocates ``[NB, BS, Hc, Dc]`` per
tensor and layer from it, and its byte accounting (:meth:`KVCacheSpec.block_bytes`) is the
only place cache sizes are computed. Examples:

- GQA / MHA / MQA (Ainslie et al. 2023): ``k`` and ``v`` of ``Hkv`` heads of ``D``
  (:meth:`KVLayerSpec.gqa`), the layout the ``attention`` ops read;
- MLA (DeepSeek-V2, arXiv:2405.04434, Section 2.1): one ``latent`` row of one "head" of
  width ``kv_lora_rank + qk_rope_head_dim`` and no V;
- a layer that caches nothing: no tensors.

The softmax scale belongs with it (:attr:`KVCacheSpec.attention_scale`): the family knows
it — ``D ** -0.5`` for llama-style heads, ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``
times YaRN's ``mscale ** 2`` for DeepSeek — and the width of a cached tensor need not be the
head dim the scores are scaled by.
"""

from __future__ import annotations

import attrs


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an int > 0, got {value!r}")


@attrs.frozen
class KVTensor:
    """One tensor cached per token: ``name`` (``k``, ``v``, ``latent``), ``num_heads`` x ``head_dim``.

    Raises:
        ValueError: a head count or width that is not an int > 0.
    """

    name: str
    num_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)

    @property
    def token_elements(self) -> int:
        """Elements one token takes: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim


@attrs.frozen
class KVLayerSpec:
    """What one layer caches per token, in the order the layer receives the cache tensors.

    Attributes:
        tensors: the cached tensors (empty: the layer caches nothing).
        sliding_window: the layer attends only to its last ``sliding_window`` tokens; None
            for full attention.

    Raises:
        ValueError: two tensors share a name, or the window is not an int > 0.
    """

    tensors: tuple[KVTensor, ...]
    sliding_window: int | None = None

    def __attrs_post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"KVLayerSpec caches two tensors of one name: {names}")
        if self.sliding_window is not None:
            _positive(self, attrs.fields(KVLayerSpec).sliding_window, self.sliding_window)

    @classmethod
    def gqa(cls, num_kv_heads: int, head_dim: int, sliding_window: int | None = None) -> KVLayerSpec:
        """K and V of ``num_kv_heads`` heads of ``head_dim``: what the ``attention`` ops read."""
        return cls((KVTensor("k", num_kv_heads, head_dim), KVTensor("v", num_kv_heads, head_dim)), sliding_window)

    @property
    def token_elements(self) -> int:
        """Elements one token takes in this layer, over all its tensors."""
        return sum(t.token_elements for t in self.tensors)


@attrs.frozen
class KVCacheSpec:
    """A model's KV cache: one :class:`KVLayerSpec` per layer and the softmax scale.

    Attributes:
        layers: per layer, what it caches (``model.forward`` receives, per layer, one cache
            tensor ``[NB, BS, Hc, Dc]`` per declared tensor, in declaration order).
        attention_scale: the scale of ``q . k`` before the softmax (goes to
            ``AttentionMetadata.scale``).

    Raises:
        ValueError: no layer, or a scale that is not a finite number > 0.
    """

    layers: tuple[KVLayerSpec, ...]
    attention_scale: float

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise ValueError("KVCacheSpec needs at least one layer")
        scale = self.attention_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"KVCacheSpec.attention_scale must be a finite number > 0, got {scale!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def evictable_window(self) -> int | None:
        """The window when *every* layer slides (the widest of them): blocks wholly before it
        may be freed, since no layer reads them again. None when a layer attends to the whole
        context (every block is kept)."""
        windows = [layer.sliding_window for layer in self.layers]
        return None if None in windows else max(w for w in windows if w is not None)

    def token_bytes(self, itemsize: int) -> int:
        """Bytes one token takes in every layer, cache elements of ``itemsize`` bytes."""
        return sum(layer.token_elements for layer in self.layers) * itemsize

    def block_bytes(self, block_size: int, itemsize: int) -> int:
        """Bytes of one block of ``block_size`` tokens across every layer and cached tensor."""
        return self.token_bytes(itemsize) * block_size
