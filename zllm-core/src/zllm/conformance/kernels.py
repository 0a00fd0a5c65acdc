"""Kernel checks: every kernel a backend registers, run on generated cases against the f32 reference.

For each registry entry of the backend (lower-priority ones included, e.g. batch-invariant
kernels) and each variant it is registered for, the cases of :mod:`zllm.conformance.cases`
are run twice: on the backend (inputs moved there as the runtime moves them) and through
the reference registered under ``reference`` on CPU copies. Outputs, and the KV caches an
attention kernel writes, are compared element-wise, and every other argument must come back
unchanged. Sampling is no backend op: the runtime's sampler is the core's own
(:mod:`zllm.runtime.sampler`), tested in the core's suite.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

import torch

from zllm.capabilities import Capability
from zllm.capabilities.backend import BackendInfo
from zllm.capabilities.ops import AttentionMetadata, OpTable
from zllm.conformance.cases import Case, NoCases, cases_for
from zllm.conformance.report import CaseResult
from zllm.domain.moe import SharedExperts
from zllm.domain.ops import CORE_OPS
from zllm.kernels.registry import KernelEntry, KernelRegistry
from zllm.weights.formats import QuantizedTensor

# ---------------------------------------------------------------------------- moving inputs


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` with the same sizes, strides and storage offset (a view stays a
    view over a copy of its whole storage, so kernels see the strides real batches have)."""
    if t.is_contiguous():
        return t.to(device, copy=True)
    storage = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())  # the whole base buffer, 1-D
    return storage.to(device, copy=True).as_strided(t.size(), t.stride(), t.storage_offset())


def place_weight(backend: Any, w: torch.Tensor | QuantizedTensor, copy: bool = False) -> torch.Tensor | QuantizedTensor:
    """A weight or cache where the backend's kernels expect it; a quantized weight keeps its
    format and shape around the placed bytes (as the engine's loader places weights).
    ``copy`` first copies it, so that a kernel writing it (a KV cache) cannot change the
    original when ``place`` returns its argument."""
    if isinstance(w, QuantizedTensor):
        return w.map(lambda t: backend.place(t.clone() if copy else t))
    return backend.place(w.clone() if copy else w)


def _shared_parts(shared: SharedExperts) -> tuple:
    return shared.gate_proj, shared.up_proj, shared.down_proj, shared.shared_expert_gate


def _placed(backend: Any, a: Any) -> Any:
    """A placed copy of a weight, or of MoE shared experts with each of their weights placed."""
    if isinstance(a, SharedExperts):
        gate = a.shared_expert_gate
        return SharedExperts(place_weight(backend, a.gate_proj, True), place_weight(backend, a.up_proj, True),
                             place_weight(backend, a.down_proj, True),
                             None if gate is None else backend.place(gate.clone()))
    return place_weight(backend, a, copy=True)


def _cloned(a: Any) -> Any:
    """A CPU copy of a tensor, a quantized weight or shared experts (anything else as is)."""
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, QuantizedTensor):
        return a.map(torch.Tensor.clone)
    if isinstance(a, SharedExperts):
        return SharedExperts(_cloned(a.gate_proj), _cloned(a.up_proj), _cloned(a.down_proj),
                             _cloned(a.shared_expert_gate))
    return a


def backend_args(case: Case, backend: Any) -> list:
    """The case's inputs on the backend: weights and caches through ``backend.place()``,
    activations and metadata to ``backend.device``."""
    device = backend.device
    out: list = []
    for i, a in enumerate(case.args):
        if i in case.placed and a is not None:
            out.append(_placed(backend, a))
        elif isinstance(a, torch.Tensor):
            out.append(_to_device(a, device))
        elif isinstance(a, AttentionMetadata):
            # Copies even on the CPU: a kernel that writes the metadata must not change the case.
            out.append(AttentionMetadata(a.slot_mapping.to(device, copy=True), a.block_tables.to(device, copy=True),
                                         a.query_lens, a.context_lens, a.scale))
        else:
            out.append(a)
    return out


def reference_args(case: Case) -> list:
    """CPU copies of the case's inputs for the f32 reference (caches copied: it writes them)."""
    out: list = []
    for a in case.args:
        out.append(_cloned(a))
    return out


# ---------------------------------------------------------------------------- comparing

def _same_values(original: torch.Tensor, given: torch.Tensor) -> bool:
    """``given`` (any device) holds exactly ``original``'s values (NaN equals NaN)."""
    given = given.detach().cpu()
    if given.shape != original.shape or given.dtype != original.dtype:
        return False
    same = given == original
    if original.is_floating_point():
        same |= torch.isnan(given) & torch.isnan(original)
    return bool(same.all())


def changed_inputs(case: Case, given: list) -> list[str]:
    """Names of the case's inputs that ``given`` (the arguments the kernel received, after the
    call) no longer equals, leaving out those the op writes (``case.written``). A kernel may
    write only what its op's signature says it writes: the runtime reuses activations (the
    residual stream), weights and metadata after the call."""
    names = case.arg_names
    changed = []
    for i, (original, arg) in enumerate(zip(case.args, given, strict=True)):
        if i in case.written:
            continue
        if isinstance(original, torch.Tensor) and isinstance(arg, torch.Tensor):
            pairs = [(original, arg)]
        elif isinstance(original, QuantizedTensor) and isinstance(arg, QuantizedTensor):
            pairs = list(zip(_data(original), _data(arg), strict=True))
        elif isinstance(original, AttentionMetadata) and isinstance(arg, AttentionMetadata):
            pairs = [(original.slot_mapping, arg.slot_mapping), (original.block_tables, arg.block_tables)]
        elif isinstance(original, SharedExperts) and isinstance(arg, SharedExperts):
            pairs = [pair for o, a in zip(_shared_parts(original), _shared_parts(arg), strict=True)
                     if o is not None and a is not None for pair in zip(_data(o), _data(a), strict=True)]
        else:
            continue
        if not all(_same_values(o, a) for o, a in pairs):
            changed.append(names[i] if i < len(names) else f"argument {i}")
    return changed



def _data(w: torch.Tensor | QuantizedTensor) -> list[torch.Tensor]:
    """The tensors a weight is made of: a dense tensor, or every part of a quantized one."""
    return [w.parts[name] for name in sorted(w.parts)] if isinstance(w, QuantizedTensor) else [w]


def _tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _tensors(r)]
    return [result]


def compare(outs: list, refs: list, atol: float, rtol: float, devices: list | None = None,
            device: torch.device | None = None) -> tuple[bool, float, float, str]:
    """Element-wise comparison of kernel outputs (brought to the CPU) with reference outputs.

    Args:
        outs, refs: tensors, paired in order.
        devices: where each of ``outs`` was produced; each must have ``device``'s type.

    Returns ``(passed, max abs error, max rel error, detail)``. An element passes when
    ``|out - ref| <= atol + rtol * |ref|`` (``torch.isclose``; NaN equals NaN). The relative
    error is taken over elements with ``|ref| > atol`` (near zero it says nothing). A
    count, shape, dtype or device mismatch fails with infinite errors and says which.
    """
    if len(outs) != len(refs):
        return False, math.inf, math.inf, f"returned {len(outs)} tensors, the reference {len(refs)}"
    max_abs = max_rel = 0.0
    bad: list[str] = []
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        name = f"output {i}" if len(outs) > 1 else "output"
        if not isinstance(o, torch.Tensor):
            return False, math.inf, math.inf, f"{name} is {type(o).__name__}, not a tensor"
        if tuple(o.shape) != tuple(r.shape):
            return False, math.inf, math.inf, f"{name} has shape {tuple(o.shape)}, expected {tuple(r.shape)}"
        if o.dtype != r.dtype:
            return False, math.inf, math.inf, f"{name} has dtype {o.dtype}, expected {r.dtype}"
        if devices is not None and device is not None and devices[i].type != device.type:
            return False, math.inf, math.inf, f"{name} is on {devices[i]}, expected the backend's device {device}"
        a, b = o.detach().cpu().double(), r.detach().double()
        ok = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        err = (a - b).abs()
        err = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(err), err.nan_to_num(nan=math.inf))
        if err.numel():
            max_abs = max(max_abs, float(err.max()))
            big = b.abs() > atol
            if bool(big.any()):
                max_rel = max(max_rel, float((err[big] / b.abs()[big]).max()))
        if not bool(ok.all()):
            idx = tuple(int(j) for j in torch.nonzero(~ok)[0])
            bad.append(f"{name}: {int((~ok).sum())} of {ok.numel()} elements outside tolerance, "
                       f"first at {list(idx)}: {float(a[idx]):.6g} vs reference {float(b[idx]):.6g}")
    return not bad, max_abs, max_rel, "; ".join(bad)


# ---------------------------------------------------------------------------- running


def run_case(fn: Callable, ref_fn: Callable, case: Case, backend: Any) -> tuple[bool, float | None, float | None, str]:
    """One case on the kernel and on the reference: ``(passed, max abs err, max rel err, detail)``.
    An exception from the kernel is a failure whose detail names it; so is an argument other
    than the KV caches an attention kernel writes (:func:`changed_inputs`) changed by the call."""
    try:
        dev_args = backend_args(case, backend)
        outs = _tensors(fn(*dev_args)) + [dev_args[i] for i in case.written]
        devices = [o.device if isinstance(o, torch.Tensor) else None for o in outs]
        # Copying back inside the try: an asynchronous device kernel reports its errors here.
        outs = [o.detach().cpu() if isinstance(o, torch.Tensor) else o for o in outs]
        changed = changed_inputs(case, dev_args)
    # A kernel failing is a result to report, not a crash of the kit; SystemExit included
    # (a native extension may call exit), KeyboardInterrupt still stops the run.
    except (Exception, SystemExit) as exc:
        return False, math.inf, math.inf, f"raised {type(exc).__name__}: {exc}".strip() + where_raised(exc)
    ref_args = reference_args(case)
    refs = _tensors(ref_fn(*ref_args)) + [ref_args[i] for i in case.written]
    passed, max_abs, max_rel, detail = compare(outs, refs, case.atol, case.rtol, devices, torch.device(backend.device))
    if case.written and not passed:
        detail = f"(outputs: {len(refs) - len(case.written)}, then the written KV caches) {detail}"
    if changed:
        wrote = (f"changed its input{'s' if len(changed) > 1 else ''} {', '.join(changed)} (a kernel writes only "
                 f"its outputs and, for attention, the KV caches)")
        passed, detail = False, wrote + (f"; {detail}" if detail else "")
    return passed, max_abs, max_rel, detail


def where_raised(exc: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost frame ``exc`` was raised in, or ``""``."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def backend_entries(registry: KernelRegistry, backend: str) -> list[KernelEntry]:
    """Every kernel entry registered for ``backend``, in the registry's stable order."""
    return [e for e in registry.entries() if e.backend == backend]


def check_kernels(registry: KernelRegistry, info: BackendInfo, backend: Any, *, seed: int, quick: bool,
                  ops: set[str] | None = None,
                  on_result: Callable[[CaseResult], None] | None = None,
                  declarations: OpTable = CORE_OPS) -> list[CaseResult]:
    """Run every kernel ``info.name`` registers (only ``ops`` when given) on its cases.

    Also fails each declared capability that has no registered kernel, and each registered
    op[variant] the kit has no case generator for (never skipped silently). A capability the
    backend instance reports its device cannot run (``unsupported_capabilities()``) is
    skipped with that reason.

    Args:
        registry: the plugin host's kernel registry (holds the references too).
        info: the backend as published (its declared capabilities).
        backend: the constructed backend instance (``place``, ``device``).
        seed: seeds the case generators.
        quick: fewer cases per op.
        ops: op names to check; None = all.
        on_result: called with each result as it is made (progress output).
        declarations: the op declarations naming each op's case generator (the host's ``ops``).

    Returns:
        One :class:`CaseResult` per (kernel, op[variant], case).
    """
    results: list[CaseResult] = []

    def add(r: CaseResult) -> None:
        results.append(r)
        if on_result is not None:
            on_result(r)

    entries = [e for e in backend_entries(registry, info.name) if ops is None or e.op in ops]
    registered = {Capability(e.op, f) for e in entries for f in e.formats}
    for cap in sorted(c for c in info.capabilities if (ops is None or c.op in ops) and c not in registered):
        add(CaseResult("(none)", str(cap), "declared capability", "failed",
                       detail=f"backend {info.name!r} declares {cap} but registers no kernel for it"))
    unsupported = device_unsupported(backend)
    for entry in entries:
        for variant in entry.formats:
            name = f"{entry.op}[{variant}]"
            if name in unsupported:
                add(CaseResult(entry.name, name, "device", "skipped", priority=entry.priority,
                               batch_invariant=entry.batch_invariant,
                               detail=f"the backend says this device cannot run {name}: {unsupported[name]}"))
                continue
            for r in _check_entry_variant(registry, entry, variant, backend, seed, quick, declarations):
                add(r)
    return results


def device_unsupported(backend: Any) -> dict[str, str]:
    """``op[variant]`` -> reason, for declared capabilities the backend instance says its device
    cannot run (the optional ``unsupported_capabilities()`` of the Backend protocol).

    Raises:
        PluginError: ``unsupported_capabilities()`` raised or returned no mapping.
    """
    from zllm.engine.loader import device_unsupported_capabilities

    return device_unsupported_capabilities(backend)


def _check_entry_variant(registry: KernelRegistry, entry: KernelEntry, variant: str, backend: Any,
                         seed: int, quick: bool, declarations: OpTable) -> list[CaseResult]:
    cap = f"{entry.op}[{variant}]"

    def result(case: str, passed: bool, max_abs=None, max_rel=None, detail="", atol=None, rtol=None) -> CaseResult:
        return CaseResult(entry.name, cap, case, "passed" if passed else "failed", max_abs, max_rel, atol, rtol, detail,
                          priority=entry.priority, batch_invariant=entry.batch_invariant)

    try:
        cases = cases_for(entry.op, variant, seed, quick, declarations)
    except NoCases as exc:
        return [result("no cases", False, detail=str(exc))]
    try:
        ref_fn = registry.lookup(entry.op, entry.backend, variant, force_reference=True).fn
    except Exception as exc:
        return [result("no reference", False, detail=f"no f32 reference for {cap}: {exc}")]
    try:
        fn = entry.resolve()
    except Exception as exc:
        return [result("import", False, detail=f"kernel {entry.name} failed to import: {type(exc).__name__}: {exc}")]
    out = []
    for case in cases:
        passed, max_abs, max_rel, detail = run_case(fn, ref_fn, case, backend)
        out.append(result(case.label, passed, max_abs, max_rel, detail, case.atol, case.rtol))
    return out
