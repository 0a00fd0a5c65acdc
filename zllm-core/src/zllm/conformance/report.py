"""The conformance report: per-case kernel results, per-model end-to-end results, JSON and Markdown.

The JSON form (``ConformanceReport.to_dict``) is the machine-readable record; its keys are
stable: ``backend``, ``device``, ``passed``, ``settings``, ``environment``, ``kernels``
(one object per kernel case), ``e2e`` (one per model) and ``failures`` (one line each).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

#: States of a kernel case or a model: ``skipped`` is neither a pass nor a failure and says why.
STATUSES = ("passed", "failed", "skipped")


@attrs.frozen
class CaseResult:
    """One (kernel, op[variant], case) check.

    Attributes:
        kernel: the registry's name of the kernel (``module:function``).
        capability: ``op[variant]`` it was run as.
        case: what the case covers (shapes, layout, batch kind).
        status: ``passed`` (every element within tolerance),
            ``failed``, or ``skipped`` (the backend instance says its device cannot run this
            capability: ``unsupported_capabilities()``; ``detail`` is its reason).
        max_abs_err, max_rel_err: measured errors; ``inf`` when the kernel raised or returned
            the wrong shape/dtype/device.
        atol, rtol: the tolerance applied (None for exact/contract checks).
        detail: why it failed, or what a contract check verified.
        priority, batch_invariant: as registered.
    """

    kernel: str
    capability: str
    case: str
    status: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    atol: float | None = None
    rtol: float | None = None
    detail: str = ""
    priority: int = 0
    batch_invariant: bool = False

    def __attrs_post_init__(self) -> None:
        assert self.status in STATUSES, self.status

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @property
    def title(self) -> str:
        """``kernel op[variant]``: how the kernel is named in messages."""
        return f"{self.kernel} {self.capability}"


@attrs.frozen
class E2EResult:
    """End-to-end logits check of one model on the backend against the f32 reference.

    Attributes:
        model: short name (``tiny-llama``, ``stories260k`` or the path's folder name).
        path: the checkpoint, or None for a model that was not found.
        status: one of :data:`STATUSES`.
        mode: ``exact`` (f32 weights: greedy tokens must be identical) or ``top1`` (16-bit or
            quantized weights: teacher-forced top-1 agreement must reach ``threshold``).
        max_abs_err, max_rel_err: logits error over the compared positions.
        atol, rtol: the logits tolerance.
        tokens, reference_tokens: greedy tokens of the backend and of the reference.
        top1_agreement: fraction of positions whose argmax agrees (``top1`` mode).
        threshold: the agreement required in ``top1`` mode.
        detail: why it failed or was skipped, or what it compared.
    """

    model: str
    path: str | None
    status: str
    mode: str = ""
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    atol: float | None = None
    rtol: float | None = None
    tokens: list[int] = attrs.Factory(list)
    reference_tokens: list[int] = attrs.Factory(list)
    top1_agreement: float | None = None
    threshold: float | None = None
    detail: str = ""

    def __attrs_post_init__(self) -> None:
        assert self.status in STATUSES, self.status


@attrs.define
class ConformanceReport:
    """Everything one ``zllm conformance`` run found.

    Attributes:
        backend: backend name; ``device``: what it ran on (``str(backend.device)``).
        settings: the run's options (seed, quick, ops, dtype, threads, requested device).
        environment: versions (zllm, torch, the backend's distribution).
        kernels: every kernel case result; ``e2e``: every model result.
    """

    backend: str
    device: str
    settings: dict[str, Any] = attrs.Factory(dict)
    environment: dict[str, Any] = attrs.Factory(dict)
    kernels: list[CaseResult] = attrs.Factory(list)
    e2e: list[E2EResult] = attrs.Factory(list)

    @property
    def passed(self) -> bool:
        """No kernel case and no model failed (skipped ones do not fail a run)."""
        return not any(r.failed for r in self.kernels) and all(r.status != "failed" for r in self.e2e)

    def failures(self) -> list[str]:
        """One line per failing kernel case and per failing model, naming it."""
        lines = [f"FAIL kernel {r.title} [{r.case}]: {r.detail}" for r in self.kernels if r.failed]
        lines += [f"FAIL e2e {r.model} {_parenthesised(r.path)}: {r.detail}" for r in self.e2e if r.status == "failed"]
        return lines

    def kernel_summary(self) -> list[dict[str, Any]]:
        """Per (kernel, op[variant]): cases run, passed and skipped, and the worst errors."""
        # One registry entry per group: the same function may be registered twice, at two priorities.
        groups: dict[tuple[str, str, int], list[CaseResult]] = {}
        for r in self.kernels:
            groups.setdefault((r.kernel, r.capability, r.priority), []).append(r)
        rows = []
        for (kernel, cap, _), rs in groups.items():
            rows.append({
                "kernel": kernel, "capability": cap, "cases": len(rs), "passed": sum(r.passed for r in rs),
                "skipped": sum(r.status == "skipped" for r in rs),
                "max_abs_err": _worst(r.max_abs_err for r in rs), "max_rel_err": _worst(r.max_rel_err for r in rs),
                "priority": rs[0].priority, "batch_invariant": rs[0].batch_invariant,
            })
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "passed": self.passed,
            "settings": self.settings,
            "environment": self.environment,
            "summary": {
                "kernel_cases": len(self.kernels),
                "kernel_cases_by_status": {s: sum(r.status == s for r in self.kernels) for s in STATUSES},
                "models_by_status": {s: sum(r.status == s for r in self.e2e) for s in STATUSES},
            },
            "kernels": [_json_safe(attrs.asdict(r) | {"passed": r.passed}) for r in self.kernels],
            "kernel_summary": [_json_safe(r) for r in self.kernel_summary()],
            "e2e": [_json_safe(attrs.asdict(r)) for r in self.e2e],
            "failures": self.failures(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def to_markdown(self) -> str:
        s = self.settings
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"# zllm conformance: backend `{self.backend}` — {verdict}",
            "",
            f"- device: `{self.device}`",
            "- settings: " + ", ".join(f"{k}={v}" for k, v in s.items()),
            "- environment: " + ", ".join(f"{k} {v}" for k, v in self.environment.items()),
            f"- kernel cases: {sum(r.passed for r in self.kernels)}/{len(self.kernels)} passed; "
            f"tolerance |out - ref| <= atol + rtol * |ref| with atol = rtol = 1e-2 unless a row says otherwise",
            "",
            "## Kernels",
            "",
            "| kernel | capability | priority | cases passed | max abs err | max rel err |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in self.kernel_summary():
            prio = f"{row['priority']}{' (batch-invariant)' if row['batch_invariant'] else ''}"
            skipped = f" ({row['skipped']} skipped)" if row["skipped"] else ""
            lines.append(f"| `{row['kernel']}` | {row['capability']} | {prio} | "
                         f"{row['passed']}/{row['cases']}{skipped} | "
                         f"{_fmt(row['max_abs_err'])} | {_fmt(row['max_rel_err'])} |")
        lines += ["", "## End to end", ""]
        if self.e2e:
            lines += ["| model | status | mode | max abs err | tolerance | tokens / agreement | detail |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in self.e2e:
                tol = "" if r.atol is None else f"atol={r.atol:g} rtol={r.rtol:g}"
                agree = (f"top-1 {r.top1_agreement:.3f} (>= {r.threshold:g})" if r.top1_agreement is not None
                         else f"{len(r.tokens)} greedy tokens" if r.tokens else "")
                lines.append(f"| {r.model} | {r.status} | {r.mode} | {_fmt(r.max_abs_err)} | {tol} | {agree} | "
                             f"{_md(r.detail)} |")
        else:
            lines.append("(no end-to-end check in this run)")
        lines += ["", "## Kernel cases", "",
                  "| kernel | capability | case | result | max abs err | max rel err | detail |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for c in self.kernels:
            shown = {"passed": "pass", "failed": "**FAIL**", "skipped": "skipped"}[c.status]
            lines.append(f"| `{c.kernel}` | {c.capability} | {_md(c.case)} | {shown} | "
                         f"{_fmt(c.max_abs_err)} | {_fmt(c.max_rel_err)} | {_md(c.detail)} |")
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path) -> tuple[Path, Path]:
        """Write the JSON and Markdown reports; returns their paths.

        ``FILE.json`` or ``FILE.md`` gives ``FILE.json`` and ``FILE.md``; any other ``FILE``
        gives ``FILE.json`` and ``FILE.md`` beside it.

        Raises:
            OSError: a file cannot be written.
        """
        json_path, md_path = report_paths(path)
        json_path.write_text(self.to_json() + "\n", encoding="utf-8")
        md_path.write_text(self.to_markdown(), encoding="utf-8")
        return json_path, md_path


def report_paths(path: str | Path) -> tuple[Path, Path]:
    """``(json path, markdown path)`` for ``--report FILE``: a ``.json`` or ``.md`` suffix
    (any case) is replaced, any other name gets both appended."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        return path, path.with_suffix(".md")
    if path.suffix.lower() == ".md":
        return path.with_suffix(".json"), path
    return Path(f"{path}.json"), Path(f"{path}.md")


def _parenthesised(path: str | None) -> str:
    """``(path)``, once: a generated model's shown path is already in parentheses."""
    text = str(path)
    return text if text.startswith("(") and text.endswith(")") else f"({text})"


def _worst(values) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _fmt(v: float | None) -> str:
    if v is None:
        return "—"
    return "inf" if math.isinf(v) else f"{v:.3g}"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _json_safe(obj: Any) -> Any:
    """JSON has no infinity: an infinite error is written as the string ``"inf"``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else "-inf" if obj < 0 else "nan"
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj
