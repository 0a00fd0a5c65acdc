"""From a config to a runnable model: the one load pipeline every entry point uses.

Order matters and is the contract: open the checkpoint (headers only) -> find the family by
architecture -> parse its spec -> compute needed capabilities from tensor formats ->
select the backend (capability check) -> construct it and check what its device cannot run
-> bind kernels -> only then read weights.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import psutil
import torch

from zllm.capabilities import Capability
from zllm.capabilities.backend import Backend
from zllm.capabilities.parallel import SINGLE, ParallelContext
from zllm.domain.family import FamilyInfo, model_kv_spec
from zllm.domain.kv_cache import KVCacheSpec
from zllm.domain.ops import without_retired
from zllm.engine.distributed import (
    Launch,
    PipelineModel,
    agree_num_blocks,
    check_launch,
    join_group,
)
from zllm.kernels.bound import BoundOps
from zllm.plugins.host import PluginHost
from zllm.plugins.selection import BackendChoice, select_backend
from zllm.spec.config import ZllmConfig
from zllm.spec.errors import (
    CapabilityError,
    CheckpointError,
    ConfigError,
    PluginError,
    UnknownArchitectureError,
)
from zllm.spec.tensor_spec import TensorSpec
from zllm.tokenizer import Tokenizer
from zllm.weights import Checkpoint, load_weights, open_checkpoint
from zllm.weights.checkpoint import check_block_shard
from zllm.weights.formats import DTYPE_OF_FORMAT, FORMATS, QuantizedTensor
from zllm.weights.loading import check_present

#: Share of the memory available before the weights are read that weights and an automatically
#: sized KV cache (``runtime.kv_cache.num_blocks: null``) may take together; the rest is left
#: to activations, the allocator and (on a CPU) the rest of the machine. vLLM's
#: ``gpu_memory_utilization`` defaults to 0.9 of a GPU; zllm shares a CPU with the OS too.
AUTO_KV_MEMORY_FRACTION = 0.8


@attrs.define
class LoadedModel:
    """Everything a runtime needs, plus what ``--explain`` and ``zllm card`` report."""

    config: ZllmConfig
    checkpoint: Checkpoint
    family_info: FamilyInfo
    spec: object
    backend_choice: BackendChoice
    backend: Backend
    ops: BoundOps
    model: object
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    context_length: int
    load_seconds: float
    #: KV blocks to allocate: ``runtime.kv_cache.num_blocks``, or when it is null
    #: :func:`auto_num_blocks` of the memory the backend reported before the weights were read
    #: (with several ranks, the fewest any rank can hold).
    kv_num_blocks: int
    #: This rank's shard of the model (:data:`~zllm.capabilities.parallel.SINGLE` for one process).
    parallel: ParallelContext = SINGLE


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


def _sharded_specs(family: Any, spec: object, parallel: ParallelContext, family_name: str) -> dict[str, TensorSpec]:
    """The family's tensor specs for this rank's shard.

    Raises:
        ConfigError: (``parallel.tensor``) the family has no tensor-parallel layer code, or
            its sizes do not fit (the family's own check).
    """
    if parallel.tp_size == 1 and parallel.pp_size == 1:
        return family.tensor_specs(spec)
    if "parallel" not in inspect.signature(family.tensor_specs).parameters:
        key, n = ("parallel.tensor", parallel.tp_size) if parallel.tp_size > 1 else ("parallel.pipeline",
                                                                                      parallel.pp_size)
        raise ConfigError(key, f"{n}: model family {family_name!r} has no parallel layer code; use {key}: 1")
    if parallel.pp_size > 1 and not getattr(family, "pipeline_stages", False):
        raise ConfigError("parallel.pipeline", f"{parallel.pp_size}: model family {family_name!r} has no "
                                               f"pipeline-stage layer code; use parallel.pipeline: 1")
    return family.tensor_specs(spec, parallel=parallel)


def _check_stage_count(cfg: ZllmConfig, ckpt: Checkpoint) -> None:
    """Raises ConfigError (``parallel.pipeline``): more stages than the checkpoint has layers."""
    layers = ckpt.config.get("num_hidden_layers")
    if isinstance(layers, int) and cfg.parallel.pipeline > layers:
        raise ConfigError("parallel.pipeline", f"{cfg.parallel.pipeline} stages exceed the {layers} layers of "
                                               f"{ckpt.path}; each stage holds at least one layer")


def check_parallel_fits(cfg: ZllmConfig, host: PluginHost) -> None:
    """Refuse ``cfg.parallel`` sizes the model cannot be split by, reading only the
    checkpoint's headers (before any process is started or weight read).

    Raises:
        ConfigError: ``parallel.pipeline`` exceeds the layers, or ``parallel.tensor`` does not
            fit the heads, KV heads or FFN widths (naming both numbers).
        TensorError: a row-parallel shard of a block-quantized weight would fall inside a
            block (names the tensor; such a weight is refused, not replicated).
        CheckpointError, UnknownArchitectureError: as :func:`load_model`.
    """
    ckpt = open_checkpoint(cfg.model.path, cfg.model.format, gguf_maps=host.gguf_maps)
    _check_stage_count(cfg, ckpt)
    info = resolve_family(host, ckpt)
    family = info.load()
    present = set(ckpt.tensor_names())
    spec = family.parse_config(ckpt.config, str(ckpt.path))
    for rank in range(cfg.parallel.tensor):
        plan = ParallelContext(rank, cfg.parallel.tensor, pp_rank=0, pp_size=cfg.parallel.pipeline)
        specs = _sharded_specs(family, spec, plan, info.name)
        for name, tspec in specs.items():
            if tspec.shard is not None and name in present:
                shape, fmt = ckpt.tensor_shape_format(name)
                check_block_shard(name, shape, _stored_format(fmt, cfg.model.dtype), tspec.shard,
                                  str(ckpt.file_of(name)))


def load_model(cfg: ZllmConfig, host: PluginHost, on_tensor: Callable[[str, int], None] | None = None,
               on_start: Callable[[int], None] | None = None, launch: Launch | None = None) -> LoadedModel:
    """Load the configured model on the configured backend.

    Args:
        on_start: called with the total weight bytes before reading (for a progress bar).
        on_tensor: called with each tensor's name and byte count as it is read.
        launch: this process's rank when ``cfg.parallel`` spreads the model over several
            (:mod:`zllm.engine.distributed`): it joins the ranks' process group once the backend
            is constructed and loads only its shard of each weight.

    Raises:
        CheckpointError, UnknownArchitectureError, CapabilityError, PluginError,
        BackendUnavailable, KernelNotFound, ConfigError — all before any weight is read,
        except TensorError for mis-shaped data found while reading.
    """
    t0 = time.perf_counter()
    if launch is not None:
        check_launch(cfg, launch)
    ckpt = open_checkpoint(cfg.model.path, cfg.model.format, gguf_maps=host.gguf_maps)
    if launch is not None:
        _check_stage_count(cfg, ckpt)
    info = resolve_family(host, ckpt)
    family = info.load()
    spec = family.parse_config(ckpt.config, str(ckpt.path))
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    planned = ParallelContext(launch.rank % tp, tp, pp_rank=launch.rank // tp, pp_size=pp) if launch else SINGLE
    specs = _sharded_specs(family, spec, planned, info.name)
    check_present(ckpt, specs)
    present = set(ckpt.tensor_names())
    formats = {n: _stored_format(ckpt.tensor_shape_format(n)[1], cfg.model.dtype) for n in specs if n in present}
    needed = without_retired(family.required_capabilities(spec, formats))
    choice = select_backend(host, cfg.backend.name, needed, info.name)
    backend = _construct_backend(choice.cls, cfg, launch)
    check_backend_instance(backend, choice.info.name)
    check_device_capabilities(backend, needed, choice.info.name, info.name)
    parallel = SINGLE
    if launch is not None:
        parallel = join_group(backend, choice.info.name, launch, cfg.parallel.startup_timeout_s, cfg.parallel.tensor)
        specs = _sharded_specs(family, spec, parallel, info.name)
    ops = BoundOps(host.kernels, choice.info.name, needed, cfg.backend.force_reference,
                   batch_invariant=cfg.runtime.batch_invariant, ops=host.ops)

    model_ctx = spec.context_length
    ctx = cfg.runtime.context_length or model_ctx
    if ctx > model_ctx:
        raise ConfigError("runtime.context_length", f"{ctx} exceeds the model's context window of {model_ctx} tokens")
    # Queried before the weights take their share; with the size of the weights this rank holds
    # (its shards, after the dtype conversion) it sizes a cache the config leaves to memory.
    available = None if cfg.runtime.kv_cache.num_blocks else available_memory_bytes(
        backend, choice.info.name, local_ranks=launch.local_world_size if launch is not None else 1)
    if on_start is not None:
        on_start(sum(_nbytes(ckpt, n) for n in specs if n in present))
    weights = load_weights(ckpt, specs, cfg.model.dtype, on_tensor=on_tensor)
    weights = {k: _place(backend, v) for k, v in weights.items()}
    model: Any
    if parallel is SINGLE:
        model = family.build(spec, weights, ops)
    else:
        model = family.build(spec, weights, ops, parallel=parallel)
    if parallel.pp_size > 1:
        model = PipelineModel(model, parallel, backend.device)
    tokenizer = ckpt.load_tokenizer()
    if available is None:
        blocks = cfg.runtime.kv_cache.num_blocks
        assert blocks is not None  # memory is queried exactly when the config leaves the size to it
    else:
        blocks = auto_num_blocks(model_kv_spec(model), block_size=cfg.runtime.kv_cache.block_size,
                                 itemsize=kv_cache_dtype(cfg).itemsize, context_length=ctx,
                                 max_seqs=cfg.runtime.max_num_seqs + cfg.runtime.prefix_cache_seqs,
                                 available_bytes=available,
                                 weight_bytes=sum(_held_bytes(w) for w in weights.values()),
                                 device=str(backend.device))
    if launch is not None:
        blocks = agree_num_blocks(blocks, backend.device, parallel, cfg.parallel.timeout_s)
    return LoadedModel(cfg, ckpt, info, spec, choice, backend, ops, model, tokenizer, _eos_ids(ckpt, tokenizer),
                       ctx, time.perf_counter() - t0, blocks, parallel)


def _construct_backend(cls: type, cfg: ZllmConfig, launch: Launch | None) -> Any:
    """``cls(threads=...)``, on device ``backend.device + local rank`` for a backend of a
    device family (its class names a ``device_type``) when either is set.

    Raises:
        ConfigError: (``backend.device``) the backend refuses that device (names the devices it sees).
    """
    device_type = getattr(cls, "device_type", None)
    local_rank = launch.local_rank if launch is not None else 0
    if device_type is None or (cfg.backend.device is None and launch is None):
        return cls(threads=cfg.backend.threads)
    device = f"{device_type}:{(cfg.backend.device or 0) + local_rank}"
    try:
        return cls(threads=cfg.backend.threads, device=device)
    except ValueError as exc:
        raise ConfigError("backend.device", f"{exc} (rank {local_rank} of this node runs on backend.device + "
                                            f"its local rank; each rank needs a device of its own)") from None


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
    """Bytes of tensor ``name`` as the checkpoint stores it."""
    shape, stored = ckpt.tensor_shape_format(name)
    if stored in FORMATS:
        return ckpt.tensor_nbytes(name)
    return math.prod(shape) * DTYPE_OF_FORMAT[stored].itemsize


def _held_bytes(weight: torch.Tensor | QuantizedTensor) -> int:
    """Bytes a loaded weight (or this rank's shard of it) occupies."""
    if isinstance(weight, QuantizedTensor):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def _place(backend, w):
    if isinstance(w, QuantizedTensor):
        return w.map(backend.place)
    return backend.place(w)


def kv_cache_dtype(cfg: ZllmConfig) -> torch.dtype:
    """The torch dtype of ``runtime.kv_cache.dtype``."""
    return DTYPE_OF_FORMAT[cfg.runtime.kv_cache.dtype]


def available_memory_bytes(backend: object, name: str, local_ranks: int = 1) -> int:
    """Bytes the backend's device can still allocate: the backend instance's optional
    ``available_memory_bytes()`` (a GPU backend asks its driver about its own device), else
    this rank's share of the host's available RAM (``psutil.virtual_memory().available``:
    free plus reclaimable page cache, divided among the ``local_ranks`` ranks of this node,
    which all allocate from it), what a CPU — or a unified-memory GPU — allocates from.

    Raises:
        PluginError: the backend's method raised or returned no int >= 0 (names the backend).
    """
    query = getattr(backend, "available_memory_bytes", None)
    if query is None:
        return int(psutil.virtual_memory().available) // max(1, local_ranks)
    try:
        value = query()
    except Exception as exc:  # a failing device query is the plugin's error, reported as one
        raise PluginError(f"backend {name!r}: available_memory_bytes() failed: {type(exc).__name__}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PluginError(f"backend {name!r}: available_memory_bytes() returned {value!r}, not an int >= 0")
    return value


def auto_num_blocks(kv_spec: KVCacheSpec, *, block_size: int, itemsize: int, context_length: int, max_seqs: int,
                    available_bytes: int, weight_bytes: int, device: str,
                    fraction: float = AUTO_KV_MEMORY_FRACTION) -> int:
    """KV blocks for ``runtime.kv_cache.num_blocks: null``.

    ``min(ceil(context_length / block_size) * max_seqs, (fraction * available_bytes -
    weight_bytes) // block_bytes)``: as many blocks as ``max_seqs`` full-context sequences
    can ever use (running plus parked in the prefix cache), within the share ``fraction`` of
    the memory available before the weights were read, less the weights. ``block_bytes`` is
    :meth:`KVCacheSpec.block_bytes`.

    Raises:
        ConfigError: (``runtime.kv_cache.num_blocks``) that memory does not hold one
            full-context sequence; says how much it needs and has, and what to set.
    """
    per_seq = math.ceil(context_length / block_size)
    block_bytes = kv_spec.block_bytes(block_size, itemsize)
    budget = int(available_bytes * fraction) - weight_bytes
    fit = max(0, budget) // block_bytes
    if fit < per_seq:
        raise ConfigError(
            "runtime.kv_cache.num_blocks",
            f"null sizes the KV cache from memory, but one {context_length}-token sequence needs "
            f"{per_seq * block_bytes / 2**20:.1f} MiB and {fraction:g} of the {available_bytes / 2**30:.2f} GiB "
            f"available on {device}, less {weight_bytes / 2**30:.2f} GiB of weights, leaves "
            f"{max(0, budget) / 2**20:.1f} MiB; set runtime.context_length lower or runtime.kv_cache.num_blocks",
        )
    return min(per_seq * max_seqs, fit)
