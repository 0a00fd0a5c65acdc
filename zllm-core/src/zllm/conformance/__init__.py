"""The backend conformance kit: checks an installed backend against zllm's f32 references.

A backend author runs ``zllm conformance --backend NAME`` on their hardware (or calls
:func:`run_conformance`). The kit

1. runs every kernel the backend registers — every registry entry, lower-priority ones such
   as batch-invariant kernels included — on generated cases per op
   (:mod:`zllm.conformance.cases`) against the f32 reference of the op, reporting the
   measured errors per case (:mod:`zllm.conformance.kernels`);
2. runs small models end to end on the backend and on the references and compares logits
   and greedy tokens (:mod:`zllm.conformance.e2e`);
3. returns a :class:`~zllm.conformance.report.ConformanceReport` (JSON and Markdown).

Modules: ``cases`` (input generators), ``kernels`` (kernel checks), ``e2e`` (model checks),
``report`` (results and their rendering).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import zllm
from zllm.conformance.report import CaseResult, ConformanceReport, E2EResult
from zllm.plugins.host import PluginHost
from zllm.spec.errors import ConfigError, PluginError

__all__ = ["CaseResult", "ConformanceReport", "E2EResult", "run_conformance"]

DTYPES = ("auto", "f32", "f16", "bf16")
#: ``torch.Generator.manual_seed`` takes 64 bits; the range config ``generation.seed`` allows.
SEED_LIMIT = 2**64


def run_conformance(
    backend: str,
    *,
    device: str | None = None,
    threads: int | None = None,
    ops: Iterable[str] | None = None,
    quick: bool = False,
    seed: int = 0,
    dtype: str = "auto",
    models: Iterable[str | Path] = (),
    host: PluginHost | None = None,
    on_kernel: Callable[[CaseResult], None] | None = None,
    on_model: Callable[[E2EResult], None] | None = None,
) -> ConformanceReport:
    """Check backend ``backend`` against the f32 references.

    Args:
        backend: the backend's name as published by its plugin (``cpu``, ``cuda`` ...), or
            ``auto``: the highest-priority backend that can run here (the report names it).
        device: passed to the backend's constructor, ``cls(threads=threads, device=device)``;
            None constructs it as ``cls(threads=threads)`` (its default device).
        threads: passed to the backend's constructor.
        ops: op names whose kernels are checked (None = all); given, the end-to-end check
            is not run (it needs every op).
        quick: fewer cases per op.
        seed: seeds every generated input, weight and tiny checkpoint; in ``[0, 2**64)``.
        dtype: load dtype of dense model weights end to end (``auto`` keeps the stored one).
        models: extra checkpoints (HF directories or GGUF files) for the end-to-end check.
        host: a plugin host (default: discover installed plugins, honouring ``ZLLM_PLUGINS``).
        on_kernel, on_model: called with each result as it is made (progress output).

    Returns:
        The report; ``report.passed`` is the verdict.

    Raises:
        PluginError: no loaded plugin provides ``backend`` (lists the loaded ones), its
            class cannot be imported or constructed, or the instance lacks ``device`` or
            ``place`` (the Backend protocol).
        BackendUnavailable: the backend cannot run here; the message is its own reason.
        ConfigError: ``ops`` names no op or an op the backend registers no kernel for, the
            backend rejects ``device``, ``dtype`` is unknown, ``seed`` is outside
            ``[0, 2**64)``, or a ``models`` path is empty or does not exist.
    """
    from zllm.conformance.e2e import ModelSource, check_model, default_models
    from zllm.conformance.kernels import backend_entries, check_kernels
    from zllm.engine.engine import plugin_allowlist_from_env
    from zllm.engine.loader import check_backend_instance
    from zllm.plugins.selection import select_backend

    if dtype not in DTYPES:
        raise ConfigError("--dtype", f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError("--seed", f"expected an integer in [0, 2**64), got {seed!r}")
    if any(not str(m).strip() for m in models):  # Path("") is the current directory: never what was meant
        raise ConfigError("--model", "needs a path (an HF checkpoint directory or a GGUF file)")
    extra = [Path(m) for m in models]
    for path in extra:
        if not path.exists():
            raise ConfigError("--model", f"{path}: no such file or directory")
    host = host or PluginHost(allowlist=plugin_allowlist_from_env())
    # Needing no capability, this raises only for a backend that is not installed or cannot run here.
    choice = select_backend(host, backend, frozenset(), family="")
    info = choice.info
    name = info.name  # what ``auto`` resolved to
    known_ops = {e.op for e in backend_entries(host.kernels, name)} | {c.op for c in info.capabilities}
    op_filter = _op_filter(ops, known_ops, name)
    instance = _construct(choice.cls, name, threads, device)
    check_backend_instance(instance, name)

    settings: dict[str, Any] = {"seed": seed, "quick": quick, "ops": sorted(op_filter) if op_filter else "all",
                                "dtype": dtype, "threads": threads, "device": device}
    if name != backend:
        settings["backend"] = f"{backend} (chose {name}: {choice.reason})"
    report = ConformanceReport(name, str(instance.device), settings, _environment(host, name))
    report.kernels = check_kernels(host.kernels, info, instance, seed=seed, quick=quick, ops=op_filter,
                                   on_result=on_kernel, declarations=host.ops)
    if op_filter is not None:
        settings["e2e"] = "not run: --ops limits the run to kernel checks"
        return report
    with tempfile.TemporaryDirectory(prefix="zllm-conformance-") as tmp:
        sources = default_models(Path(tmp), seed) + [ModelSource(p.name or str(p), p) for p in extra]
        for source in sources:
            result = check_model(host, info, instance, source, dtype=dtype, seed=seed)
            report.e2e.append(result)
            if on_model is not None:
                on_model(result)
    return report


def _op_filter(ops: Iterable[str] | None, known: set[str], backend: str) -> set[str] | None:
    if ops is None:
        return None
    if isinstance(ops, str):  # "rope,linear", as the CLI takes it
        ops = ops.split(",")
    wanted = {o.strip() for o in ops if o.strip()}
    if not wanted:
        raise ConfigError("--ops", "names no op")
    unknown = sorted(wanted - known)
    if unknown:
        raise ConfigError("--ops", f"{', '.join(unknown)} matches no op backend {backend!r} registers kernels for "
                                   f"(its ops: {', '.join(sorted(known)) or 'none'})")
    return wanted


def _construct(cls: type, backend: str, threads: int | None, device: str | None) -> Any:
    """``cls(threads=threads, device=device)`` (``device`` only when given: a backend of one
    device need not take it); a rejected argument is a usage error naming it."""
    try:
        return cls(threads=threads) if device is None else cls(threads=threads, device=device)
    except ValueError as exc:
        raise ConfigError("--device" if device is not None else "--threads", f"backend {backend!r}: {exc}") from None
    except TypeError as exc:
        call = f"{cls.__name__}(threads=..." + (", device=...)" if device is not None else ")")
        raise PluginError(f"backend {backend!r} cannot be constructed as {call}: {exc}") from None
    except Exception as exc:  # a device that fails to initialise: report it, never a traceback
        raise PluginError(f"backend {backend!r} failed to start (threads={threads}, device={device!r}): "
                          f"{type(exc).__name__}: {exc}") from None


def _environment(host: PluginHost, backend: str) -> dict[str, str]:
    env = {"zllm-core": zllm.__version__, "torch": torch.__version__}
    for rec in host.records:
        if f"backend:{backend}" in rec.kinds:
            env[rec.distribution] = rec.version
    return env
