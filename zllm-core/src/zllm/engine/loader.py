"""From a config to a runnable model: the one load pipeline every entry point uses.

Order matters and is the contract: open the checkpoint (headers only) -> find the family by
architecture -> parse its spec -> compute needed capabilities from tensor formats ->
select the backend (capability check) -> construct it and check what its device cannot run
-> bind kernels -> only then read weights.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import attrs
import torch

from zllm.capabilities import Capability
from zllm.domain.family import FamilyInfo
from zllm.kernels.bound import BoundOps
from zllm.plugins.host import PluginHost
from zllm.plugins.selection import BackendChoice, select_backend
from zllm.spec.config import ZllmConfig
from zllm.spec.errors import (CapabilityError, CheckpointError, ConfigError, PluginError, TensorError,
                              UnknownArchitectureError)
from zllm.weights import Checkpoint, load_weights, open_checkpoint
from zllm.weights.formats import BLOCK_LAYOUTS, DTYPE_OF_FORMAT, QuantizedTensor

#: Upper bound for an automatically sized KV cache.
AUTO_KV_BUDGET_BYTES = 1 << 30


@attrs.define
class LoadedModel:
    """Everything a runtime needs, plus what ``--explain`` and ``zllm card`` report."""

    config: ZllmConfig
    checkpoint: Checkpoint
    family_info: FamilyInfo
    spec: object
    backend_choice: BackendChoice
    backend: object
    ops: BoundOps
    model: object
    tokenizer: object
    eos_token_ids: frozenset[int]
    context_length: int
    load_seconds: float


def _stored_format(fmt: str, dtype: str) -> str:
    """The format a tensor has in memory after the config's dtype conversion."""
    return fmt if dtype == "auto" or fmt not in DTYPE_OF_FORMAT else dtype


def resolve_family(host: PluginHost, ckpt: Checkpoint) -> FamilyInfo:
    """The installed family for the checkpoint's architecture.

    Raises:
        UnknownArchitectureError: no family handles it (lists the known architectures).
    """
    model_type = ckpt.config.get("model_type")
    info = host.family_for(model_type) if isinstance(model_type, str) else None
    if info is None:
        known = ", ".join(host.known_model_types()) or "none (no model family plugin loaded)"
        extra = host.not_loaded_reasons()
        raise UnknownArchitectureError(
            str(ckpt.path), f"unknown architecture {ckpt.architecture!r}; known architectures: {known}"
            + (f"; plugins not loaded: {'; '.join(extra)}" if extra else "")
        )
    return info


def _eos_ids(ckpt: Checkpoint, tokenizer) -> frozenset[int]:
    """Raises CheckpointError: ``eos_token_id`` is not an id or a list of ids."""
    in_generation_config = "eos_token_id" in ckpt.generation_config
    eos = ckpt.generation_config.get("eos_token_id", ckpt.config.get("eos_token_id"))
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        file = "generation_config.json" if in_generation_config else "config.json"
        where = ckpt.path / file if ckpt.format == "hf" else ckpt.path
        raise CheckpointError(str(where), f"eos_token_id {eos!r} is not a token id (int >= 0) or a list of them")
    return frozenset(int(i) for i in set(ids) | set(tokenizer.eos_token_ids))


def load_model(cfg: ZllmConfig, host: PluginHost, on_tensor: Callable[[str, int], None] | None = None,
               on_start: Callable[[int], None] | None = None) -> LoadedModel:
    """Load the configured model on the configured backend.

    Args:
        on_start: called with the total weight bytes before reading (for a progress bar).
        on_tensor: called with each tensor's name and byte count as it is read.

    Raises:
        CheckpointError, UnknownArchitectureError, CapabilityError, PluginError,
        BackendUnavailable, KernelNotFound, ConfigError — all before any weight is read,
        except TensorError for mis-shaped data found while reading.
    """
    t0 = time.perf_counter()
    ckpt = open_checkpoint(cfg.model.path, cfg.model.format)
    info = resolve_family(host, ckpt)
    family = info.load()
    spec = family.parse_config(ckpt.config, str(ckpt.path))
    specs = family.tensor_specs(spec)
    present = set(ckpt.tensor_names())
    for name, tspec in specs.items():
        if name not in present and not tspec.optional:
            raise TensorError(str(ckpt.path), name, "missing from the checkpoint")
    formats = {n: _stored_format(ckpt.tensor_shape_format(n)[1], cfg.model.dtype) for n in specs if n in present}
    needed = family.required_capabilities(spec, formats)
    choice = select_backend(host, cfg.backend.name, needed, info.name)
    backend = choice.cls(threads=cfg.backend.threads)
    check_backend_instance(backend, choice.info.name)
    check_device_capabilities(backend, needed, choice.info.name, info.name)
    ops = BoundOps(host.kernels, choice.info.name, needed, cfg.backend.force_reference,
                   batch_invariant=cfg.runtime.batch_invariant, ops=host.ops)

    model_ctx = spec.context_length
    ctx = cfg.runtime.context_length or model_ctx
    if ctx > model_ctx:
        raise ConfigError("runtime.context_length", f"{ctx} exceeds the model's context window of {model_ctx} tokens")
    if on_start is not None:
        on_start(sum(_nbytes(ckpt, n) for n in specs if n in present))
    weights = load_weights(ckpt, specs, cfg.model.dtype, on_tensor=on_tensor)
    weights = {k: _place(backend, v) for k, v in weights.items()}
    model = family.build(spec, weights, ops)
    tokenizer = ckpt.load_tokenizer()
    return LoadedModel(cfg, ckpt, info, spec, choice, backend, ops, model, tokenizer, _eos_ids(ckpt, tokenizer),
                       ctx, time.perf_counter() - t0)


def check_backend_instance(backend: object, name: str) -> None:
    """Reject a constructed backend that lacks what the runtime uses: a ``device`` attribute
    and a ``place`` method (the :class:`~zllm.capabilities.backend.Backend` protocol).

    Raises:
        PluginError: names the backend, its class and what is missing.
    """
    missing = [m for m, ok in (("'device' attribute", getattr(backend, "device", None) is not None),
                               ("place(tensor) method", callable(getattr(backend, "place", None)))) if not ok]
    if missing:
        raise PluginError(f"backend {name!r} ({type(backend).__module__}:{type(backend).__qualname__}) has no "
                          f"{' and no '.join(missing)}; a backend instance needs 'device' (the torch device its "
                          f"kernels run on) and place(tensor) (puts a weight there)")


def check_device_capabilities(backend: object, needed: frozenset[Capability], backend_name: str, family: str) -> None:
    """Reject capabilities the backend declares but this device cannot run.

    Asks the backend instance's optional ``unsupported_capabilities()`` (see
    :class:`~zllm.capabilities.backend.Backend`); a backend without it runs all it declares.

    Raises:
        CapabilityError: ``needed`` holds some of them; names each, the backend, the family
            and the device's reasons.
    """
    unsupported = device_unsupported_capabilities(backend)
    missing = {str(c): unsupported[str(c)] for c in needed if str(c) in unsupported}
    if missing:
        raise CapabilityError(list(missing), backend_name, family, reasons=missing)


def device_unsupported_capabilities(backend: object) -> dict[str, str]:
    """The backend instance's optional ``unsupported_capabilities()``: ``op[variant]`` ->
    reason (``{}`` for a backend without the method).

    Raises:
        PluginError: the method raised or returned something other than a mapping; names
            the backend's class and the error.
    """
    report = getattr(backend, "unsupported_capabilities", None)
    if report is None:
        return {}
    try:
        return {str(cap): str(why) for cap, why in dict(report()).items()}
    except Exception as exc:  # a device query that fails is the plugin's error, reported as one
        cls = f"{type(backend).__module__}:{type(backend).__qualname__}"
        raise PluginError(f"{cls}.unsupported_capabilities() failed: {type(exc).__name__}: {exc}") from None


def _nbytes(ckpt: Checkpoint, name: str) -> int:
    shape, fmt = ckpt.tensor_shape_format(name)
    n = math.prod(shape)
    if fmt in BLOCK_LAYOUTS:
        layout = BLOCK_LAYOUTS[fmt]
        return n // layout.block_size * layout.type_size
    return n * DTYPE_OF_FORMAT[fmt].itemsize


def _place(backend, w):
    if isinstance(w, QuantizedTensor):
        return QuantizedTensor(backend.place(w.data), w.fmt, w.shape)
    return backend.place(w)


def kv_cache_dtype(cfg: ZllmConfig) -> torch.dtype:
    """The torch dtype of ``runtime.kv_cache.dtype``."""
    return DTYPE_OF_FORMAT[cfg.runtime.kv_cache.dtype]


def auto_num_blocks(cfg: ZllmConfig, loaded: LoadedModel) -> int:
    """KV blocks for ``max_num_seqs + prefix_cache_seqs`` full-context sequences, capped at
    :data:`AUTO_KV_BUDGET_BYTES` but never below one full-context sequence."""
    shape = loaded.model.kv_shape
    bs = cfg.runtime.kv_cache.block_size
    per_seq = math.ceil(loaded.context_length / bs)
    block_bytes = 2 * shape.num_layers * bs * shape.num_kv_heads * shape.head_dim * kv_cache_dtype(cfg).itemsize
    want = per_seq * (cfg.runtime.max_num_seqs + cfg.runtime.prefix_cache_seqs)
    return max(per_seq, min(want, AUTO_KV_BUDGET_BYTES // block_bytes))
