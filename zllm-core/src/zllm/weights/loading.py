"""load_weights: the checked hand-over from a checkpoint to a model's TensorSpecs."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from zllm.spec.errors import TensorError
from zllm.spec.tensor_spec import TensorSpec
from zllm.weights.checkpoint import Checkpoint, check_block_shard
from zllm.weights.formats import DENSE_FORMATS, DTYPE_OF_FORMAT, QuantizedTensor

LOAD_DTYPES = ("auto", *DENSE_FORMATS.values())
_LISTED = 5  # how many further names an error lists


def _more(names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:_LISTED])
    return f" (and {len(names)} more: {shown}{', …' if len(names) > _LISTED else ''})"


def load_weights(
    checkpoint: Checkpoint,
    specs: dict[str, TensorSpec],
    dtype: str = "auto",
    on_tensor: Callable[[str, int], None] | None = None,
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Load every tensor of ``checkpoint`` that ``specs`` names, checking all of them first.

    Every tensor is accounted for before any data is read: each non-optional spec must be
    in the checkpoint, each checkpoint tensor must have a spec, and each shape and format
    must satisfy its spec (checked on the format the model will receive, i.e. after the
    ``dtype`` conversion).

    Args:
        checkpoint: an opened checkpoint.
        specs: canonical tensor name → expected shape and formats.
        dtype: ``"auto"`` keeps each tensor's stored dtype; ``"f32"``, ``"f16"`` or ``"bf16"``
            converts dense tensors (a copy); quantized tensors stay quantized either way.
        on_tensor: called as ``on_tensor(name, nbytes)`` after each tensor is loaded, with
            the bytes it occupies (for a progress bar).

    Returns:
        canonical name → dense ``torch.Tensor`` (file-mapped unless converted) or
        :class:`QuantizedTensor`, in checkpoint order; optional specs absent from the
        checkpoint are absent here. A spec with a ``shard`` gets only that slice
        (:meth:`Checkpoint.tensor_slice`; the whole tensor is never read); one marked
        ``elsewhere`` (another pipeline stage's) is checked and left out.

    Raises:
        ValueError: ``dtype`` is not one of :data:`LOAD_DTYPES`.
        TensorError: a required tensor is missing, a checkpoint tensor is unused (not part
            of the model), a tensor is mis-shaped, in a format the spec refuses or stored in
            a type zllm does not support, or a quantized shard falls off its block boundaries.
            The error names the tensor and the file holding it
            (the checkpoint path for a missing tensor) and lists further offenders.
    """
    if dtype not in LOAD_DTYPES:
        raise ValueError(f"unknown load dtype {dtype!r}; expected one of {', '.join(LOAD_DTYPES)}")
    check_present(checkpoint, specs)
    names = checkpoint.tensor_names()
    unused = [n for n in names if n not in specs]
    if unused:
        raise TensorError(
            str(checkpoint.file_of(unused[0])), unused[0], f"unused (not part of the model){_more(unused[1:])}",
            checkpoint.file_tensor_name(unused[0]),
        )
    for name in names:
        shape, fmt = checkpoint.tensor_shape_format(name)
        file = str(checkpoint.file_of(name))
        loaded_fmt = fmt if dtype == "auto" or fmt not in DTYPE_OF_FORMAT else dtype
        specs[name].check(name, shape, loaded_fmt, file, checkpoint.file_tensor_name(name))
        shard = specs[name].shard
        if shard is not None:
            check_block_shard(name, shape, loaded_fmt, shard, file)

    weights: dict[str, torch.Tensor | QuantizedTensor] = {}
    for name in names:
        if specs[name].elsewhere:
            continue
        shard = specs[name].shard
        weight = checkpoint.tensor(name) if shard is None else checkpoint.tensor_slice(name, shard)
        if dtype != "auto" and isinstance(weight, torch.Tensor):
            weight = weight.to(DTYPE_OF_FORMAT[dtype])
        weights[name] = weight
        if on_tensor is not None:
            nbytes = weight.nbytes if isinstance(weight, QuantizedTensor) else weight.numel() * weight.element_size()
            on_tensor(name, nbytes)
    return weights


def check_present(checkpoint: Checkpoint, specs: Mapping[str, TensorSpec]) -> None:
    """Raise unless ``checkpoint`` holds every tensor ``specs`` requires (before any is read).

    Raises:
        TensorError: names the first missing tensor, the name the checkpoint's file would give
            it where that differs (a GGUF file's ``blk.0.attn_q.bias``), and the others missing.
    """
    present = set(checkpoint.tensor_names())
    missing = [n for n, s in specs.items() if not s.optional and n not in present]
    if missing:
        stored = checkpoint.file_tensor_name(missing[0])
        would = f" (which would name it {stored!r})" if stored != missing[0] else ""
        raise TensorError(str(checkpoint.path), missing[0], f"missing from the checkpoint{would}{_more(missing[1:])}")


def parameter_count(checkpoint: Checkpoint) -> int:
    """Number of weights in ``checkpoint``: the sum of its tensors' logical element counts.

    Tied embeddings count once, also when a tied checkpoint stores ``lm_head.weight`` too.
    """
    tied = bool(checkpoint.config.get("tie_word_embeddings"))
    return sum(math.prod(checkpoint.tensor_shape(n)) for n in checkpoint.tensor_names()
               if not (tied and n == "lm_head.weight"))
