"""TensorSpec: what a model expects of one weight tensor — shape and allowed storage formats.

Pure data: no torch. Format names are zllm's (``f32``, ``f16``, ``bf16``, ``q8_0``,
``q4_0``; see ``zllm.weights.formats``). The weights layer calls :meth:`TensorSpec.check`
with a tensor's *logical* shape (a quantized weight's dequantized ``(rows, cols)``) before
any tensor data is read.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from zllm.spec.errors import TensorError


def _shape(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _formats(value: Iterable[str] | None) -> frozenset[str] | None:
    return None if value is None else frozenset(value)


@attrs.frozen
class Shard:
    """The part of a weight one tensor-parallel rank holds: ``size`` indices of dimension
    ``dim`` from ``start`` (``zllm.capabilities.parallel.ParallelContext.split``)."""

    dim: int
    start: int
    size: int


@attrs.frozen
class TensorSpec:
    """The expected shape and storage of one named weight.

    Attributes:
        shape: logical shape, e.g. ``(vocab, hidden)``; a quantized weight's logical shape is
            its dequantized ``(rows, cols)``.
        formats: the formats the model accepts for this weight; ``None`` accepts any of
            zllm's formats.
        optional: the checkpoint may omit this tensor (e.g. ``lm_head.weight`` of a model
            with tied embeddings).
        shard: the slice of the weight this process loads (tensor parallelism); ``None``
            loads it whole. :attr:`shape` stays the whole weight's shape, which is what the
            checkpoint is checked against.
        elsewhere: another pipeline stage holds this weight: it is checked against the
            checkpoint like every other, but not loaded here.
    """

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    formats: frozenset[str] | None = attrs.field(default=None, converter=_formats)
    optional: bool = False
    shard: Shard | None = None
    elsewhere: bool = False

    def __attrs_post_init__(self) -> None:
        if self.shard is not None:
            s = self.shard
            assert 0 <= s.dim < len(self.shape) and 0 <= s.start <= s.start + s.size <= self.shape[s.dim], (self, s)

    def check(
        self, name: str, tensor_shape: Iterable[int], fmt: str, file: str, file_tensor: str | None = None
    ) -> None:
        """Raise unless a tensor of ``tensor_shape`` stored as ``fmt`` satisfies this spec.

        Args:
            name: the tensor's canonical name, for the error.
            tensor_shape: the tensor's logical shape.
            fmt: the tensor's format name (``f32``, ``q8_0`` …).
            file: the checkpoint file holding the tensor, for the error.
            file_tensor: the file's own name for the tensor where it differs (GGUF), for the error.

        Raises:
            TensorError: the shape differs (the message names expected and actual shapes) or
                the format is not one of :attr:`formats` (the message lists those).
        """
        actual = _shape(tensor_shape)
        if actual != self.shape:
            raise TensorError(file, name, f"mis-shaped: expected shape {list(self.shape)}, got {list(actual)}",
                              file_tensor)
        if self.formats is not None and fmt not in self.formats:
            raise TensorError(
                file, name, f"format {fmt!r} not accepted; expected one of {', '.join(sorted(self.formats))}",
                file_tensor,
            )
