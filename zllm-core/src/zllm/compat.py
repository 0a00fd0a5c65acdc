"""The compatibility matrix: model families x backends x weight formats, and what is true of each cell.

A cell's status is the strongest claim the evidence supports:

- ``verified``: a ``[[cell]]`` of ``compat/verified.toml`` names pytest node IDs that ran this
  family on this backend with this weight format against the oracle, and the capabilities
  match.
- ``kernel-verified``: every capability the cell binds (the family's needs for the format)
  has a ``[[kernel]]`` entry for this backend, naming the tests that ran that backend's
  registered kernel against the f32 reference without a device — Triton kernels under
  Triton's interpreter, torch kernels on CPU tensors. No device ran the model.
- ``declared``: the backend declares every capability the family needs; nothing ran.
- ``unsupported (missing: linear[q4_0], ...)``: the capabilities the backend lacks.

``tools/check_verified.py`` checks, against a junit report, that every test either table
names ran and passed.

Capabilities come from the same code the loader uses (the family's ``format_capabilities``
and the backend's static ``BackendInfo.capabilities``), so the matrix cannot claim a cell
that loading would reject. Nothing here touches a device.

Where the verified file is found: ``zllm compat --verified PATH`` names it; otherwise the
nearest ``compat/verified.toml`` found walking up from the current directory (as git
finds ``.git``), so running from anywhere inside the repository gives the same answer and
an installed ``zllm`` outside any checkout reports no verified cells instead of guessing.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from zllm.spec.errors import ConfigError
from zllm.weights.formats import FORMATS

if TYPE_CHECKING:
    from zllm.capabilities import Capability
    from zllm.plugins.host import PluginHost

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

#: Matrix columns: how a checkpoint is stored -> the weight format its tensors have. The
#: quantized columns are the weight-format registry's (``WeightFormat.columns``).
FORMAT_AXIS: dict[str, str] = {
    "hf-f32": "f32",
    "hf-f16": "f16",
    "hf-bf16": "bf16",
    "gguf-F32": "f32",
    "gguf-F16": "f16",
    "gguf-BF16": "bf16",
    **{column: name for name, fmt in FORMATS.items() for column in fmt.columns},
}

#: Statuses a ``[[cell]]`` of the verified file may claim; ``kernel-verified`` is derived from
#: ``[[kernel]]`` entries instead.
CLAIMABLE = ("verified",)

VERIFIED_RELPATH = Path("compat") / "verified.toml"


@attrs.frozen
class VerifiedEntry:
    """One ``[[cell]]`` of the verified file: tests that exercised (family, backend, format)."""

    family: str
    backend: str
    format: str
    status: str
    tests: tuple[str, ...]


@attrs.frozen
class KernelEvidence:
    """One ``[[kernel]]`` of the verified file: tests that ran ``backend``'s kernel for
    ``capability`` (``op[variant]``) against the reference without a device."""

    backend: str
    capability: str
    tests: tuple[str, ...]


@attrs.frozen
class Evidence:
    """The parsed verified file: ``[[cell]]`` claims and ``[[kernel]]`` evidence."""

    cells: tuple[VerifiedEntry, ...] = ()
    kernels: tuple[KernelEvidence, ...] = ()

    def tests(self) -> list[tuple[str, str]]:
        """``(what it backs, node_id)`` for every listed test, cells first."""
        return [(f"{e.family} x {e.backend} x {e.format} ({e.status})", t) for e in self.cells for t in e.tests] + [
            (f"{k.backend} {k.capability} (kernel-verified)", t) for k in self.kernels for t in k.tests]


@attrs.frozen
class Cell:
    """One (family, backend, format) cell. ``missing`` is empty unless unsupported."""

    family: str
    backend: str
    format: str
    weight_format: str
    status: str
    missing: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.status == "unsupported":
            return f"unsupported (missing: {', '.join(self.missing)})"
        return self.status


@attrs.frozen
class PluginRow:
    """An installed plugin as the matrix reports it (from :class:`~zllm.plugins.host.PluginRecord`)."""

    name: str
    distribution: str
    version: str
    status: str
    api: str
    requires_core: str
    kind: str


@attrs.frozen
class CompatMatrix:
    """Everything ``zllm compat`` prints.

    Attributes:
        core_api: the plugin API the core speaks (``"1.0"``).
        core_version: the installed zllm-core version.
        verified_file: the verified file as shown to users (relative to its repository), or
            ``None`` when none was found.
        plugins, cells: sorted rows.
        notes: verified-file entries that could not be applied, each saying why.
    """

    core_api: str
    core_version: str
    verified_file: str | None
    plugins: tuple[PluginRow, ...]
    cells: tuple[Cell, ...]
    notes: tuple[str, ...] = ()


def find_verified_file(start: Path | None = None) -> Path | None:
    """The nearest ``compat/verified.toml`` in ``start`` (default: the current directory) or a parent."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / VERIFIED_RELPATH
        if candidate.is_file():
            return candidate
    return None


def load_verified(path: Path) -> Evidence:
    """Parse the verified file.

    Raises:
        ConfigError: the file is not TOML or an entry is malformed; the key path names it
            (``cell[2].format``, ``kernel[0].capability``).
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("", f"{path}: cannot read verified file: {exc}") from None
    unknown = sorted(set(data) - {"cell", "kernel"})
    if unknown:
        raise ConfigError(unknown[0], f"{path}: unknown top-level key; expected [[cell]] and [[kernel]] tables")
    cells = [_cell_entry(path, f"cell[{i}]", raw) for i, raw in enumerate(_tables(path, data, "cell"))]
    kernels = [_kernel_entry(path, f"kernel[{i}]", raw) for i, raw in enumerate(_tables(path, data, "kernel"))]
    return Evidence(tuple(cells), tuple(kernels))


def _tables(path: Path, data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    tables = data.get(key, [])
    if not isinstance(tables, list):
        raise ConfigError(key, f"{path}: expected [[{key}]] tables, got {type(tables).__name__}")
    for i, raw in enumerate(tables):
        if not isinstance(raw, dict):
            raise ConfigError(f"{key}[{i}]", f"{path}: expected a [[{key}]] table, got {type(raw).__name__}")
    return tables


def _fields(
    path: Path, where: str, raw: dict[str, Any], strings: tuple[str, ...], optional: tuple[str, ...]
) -> tuple[str, ...]:
    """Check the keys of one table and its required strings; return its ``tests`` list."""
    extra = sorted(set(raw) - {*strings, *optional, "tests"})
    if extra:
        raise ConfigError(
            f"{where}.{extra[0]}", f"{path}: unknown key; expected {', '.join((*strings, *optional, 'tests'))}"
        )
    for key in strings:
        if not isinstance(raw.get(key), str):
            raise ConfigError(f"{where}.{key}", f"{path}: required string")
    tests = raw.get("tests", [])
    if not (isinstance(tests, list) and all(isinstance(t, str) and t for t in tests)):
        raise ConfigError(f"{where}.tests", f"{path}: must be a list of pytest node IDs")
    if not tests:
        raise ConfigError(f"{where}.tests", f"{path}: needs at least one pytest node ID")
    return tuple(tests)


def _cell_entry(path: Path, where: str, raw: dict[str, Any]) -> VerifiedEntry:
    tests = _fields(path, where, raw, ("family", "backend", "format"), ("status",))
    status = raw.get("status", "verified")
    if status not in CLAIMABLE:
        derived = " (kernel-verified is derived from [[kernel]] entries)" if status == "kernel-verified" else ""
        raise ConfigError(f"{where}.status", f"{path}: {status!r} is not one of {', '.join(CLAIMABLE)}{derived}")
    if raw["format"] not in FORMAT_AXIS:
        raise ConfigError(f"{where}.format", f"{path}: {raw['format']!r} is not one of {', '.join(FORMAT_AXIS)}")
    return VerifiedEntry(raw["family"], raw["backend"], raw["format"], status, tests)


def _kernel_entry(path: Path, where: str, raw: dict[str, Any]) -> KernelEvidence:
    tests = _fields(path, where, raw, ("backend", "capability"), ())
    cap = raw["capability"]
    op, bracket, variant = cap.partition("[")
    if not (op and bracket and variant.endswith("]") and len(variant) > 1):
        raise ConfigError(f"{where}.capability", f"{path}: {cap!r} is not a capability 'op[variant]'")
    return KernelEvidence(raw["backend"], cap, tests)


def _core_version() -> str:
    try:
        return metadata.version("zllm-core")
    except metadata.PackageNotFoundError:  # running from a source tree without installing
        return "unknown"


#: The dense format a quantized HF checkpoint keeps its embeddings in: no HF quantization method
#: zllm reads quantizes the embedding table (transformers' ``fp8``, compressed-tensors, GPTQ,
#: AWQ, modelopt and gpt-oss's ``mxfp4`` quantize linear layers or experts only).
HF_EMBEDDING_FORMAT = "bf16"


def column_capabilities(family: Any, column: str, weight_fmt: str) -> frozenset[Capability]:
    """What a model of ``family`` stored as matrix column ``column`` needs: every weight in
    ``weight_fmt`` (``format_capabilities``), except that a quantized HF checkpoint's embedding
    table stays dense (:data:`HF_EMBEDDING_FORMAT`), as the loader will find it."""
    from zllm.capabilities import Capability
    from zllm.domain.ops import without_retired

    needed = frozenset(without_retired(family.format_capabilities(weight_fmt)))
    if column.startswith("hf-") and weight_fmt in FORMATS:
        return frozenset(c for c in needed if c.op != "embedding") | {Capability("embedding", HF_EMBEDDING_FORMAT)}
    return needed


def compute_matrix(host: PluginHost, verified: Path | None = None) -> CompatMatrix:
    """Build the matrix for every loaded family and backend of ``host``.

    Args:
        verified: the verified file; ``None`` looks it up with :func:`find_verified_file`.

    Raises:
        ConfigError: the verified file is malformed (see :func:`load_verified`).
    """
    # Imported here, not at module level, so that tools/check_verified.py can use
    # load_verified without importing torch.
    from zllm.capabilities import missing_capabilities
    from zllm.plugins.hookspecs import PLUGIN_API_VERSION

    if verified is not None:
        if not verified.is_file():
            raise ConfigError("--verified", f"{verified}: no such file")
        path: Path | None = verified
        shown = str(verified)
    else:
        # Shown relative to the repository root so COMPATIBILITY.md does not depend on
        # where the checkout lives.
        path, shown = find_verified_file(), VERIFIED_RELPATH.as_posix()
    evidence = load_verified(path) if path is not None else Evidence()
    claims = {(e.family, e.backend, e.format): e for e in evidence.cells}
    checked: dict[tuple[str, str], tuple[str, ...]] = {}  # (backend, capability) -> tests
    for k in evidence.kernels:
        checked[(k.backend, k.capability)] = checked.get((k.backend, k.capability), ()) + k.tests

    cells = []
    for fam_name in sorted(host.families):
        family = host.families[fam_name].load()
        for be_name in sorted(host.backends):
            provided = host.backends[be_name].capabilities
            for fmt, weight_fmt in FORMAT_AXIS.items():
                needed = column_capabilities(family, fmt, weight_fmt)
                missing = tuple(missing_capabilities(needed, provided))
                claim = claims.pop((fam_name, be_name, fmt), None)
                kernel_tests = [checked.get((be_name, str(c))) for c in sorted(needed)]
                if missing:
                    cells.append(Cell(fam_name, be_name, fmt, weight_fmt, "unsupported", missing))
                    if claim is not None:
                        claims[(fam_name, be_name, fmt)] = claim  # reported below: a claim the capabilities contradict
                elif claim is not None:
                    cells.append(Cell(fam_name, be_name, fmt, weight_fmt, claim.status, (), claim.tests))
                elif all(kernel_tests):
                    tests = tuple(sorted({t for ts in kernel_tests if ts for t in ts}))
                    cells.append(Cell(fam_name, be_name, fmt, weight_fmt, "kernel-verified", (), tests))
                else:
                    cells.append(Cell(fam_name, be_name, fmt, weight_fmt, "declared"))

    notes = []
    for k in evidence.kernels:
        if k.backend not in host.backends:
            notes.append(
                f"kernel {k.capability} on {k.backend}: listed as kernel-verified but the backend is not loaded"
            )
        elif k.capability not in {str(c) for c in host.backends[k.backend].capabilities}:
            notes.append(
                f"kernel {k.capability} on {k.backend}: listed as kernel-verified but the backend does not declare it"
            )
    for (fam, be, fmt), e in sorted(claims.items()):
        if fam in host.families and be in host.backends:
            notes.append(f"{fam} x {be} x {fmt}: listed as {e.status} but the backend lacks needed capabilities")
        else:
            notes.append(f"{fam} x {be} x {fmt}: listed as {e.status} but family or backend is not loaded")

    plugins = tuple(
        PluginRow(r.name, r.distribution, r.version, r.status, r.api, r.requires_core, r.kind)
        for r in sorted(host.records, key=lambda r: r.name)
    )
    return CompatMatrix(
        core_api=f"{PLUGIN_API_VERSION[0]}.{PLUGIN_API_VERSION[1]}",
        core_version=_core_version(),
        verified_file=shown if path is not None else None,
        plugins=plugins,
        cells=tuple(cells),
        notes=tuple(notes),
    )


# ---------------------------------------------------------------------------- rendering


def _grid(matrix: CompatMatrix, family: str) -> list[list[str]]:
    """Rows ``[backend, cell label per format]`` for one family."""
    rows: dict[str, list[str]] = {}
    for c in matrix.cells:
        if c.family == family:
            rows.setdefault(c.backend, [c.backend]).append(c.label)
    return list(rows.values())


def _families(matrix: CompatMatrix) -> list[str]:
    return sorted({c.family for c in matrix.cells})


def _plugin_table(matrix: CompatMatrix) -> tuple[list[str], list[list[str]]]:
    head = ["plugin", "distribution", "version", "provides", "status", "plugin API", "accepts zllm-core"]
    rows = [
        [p.name, p.distribution, p.version, p.kind, p.status, p.api or "-", p.requires_core or "any"]
        for p in matrix.plugins
    ]
    return head, rows


def _render_md(matrix: CompatMatrix) -> str:
    def table(head: list[str], rows: list[list[str]]) -> list[str]:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return out

    lines = [
        "# zllm compatibility matrix",
        "",
        "<!-- Generated by `zllm compat --format md`; do not edit. tests/compat checks this file"
        " equals the command's output. -->",
        "",
        f"Core plugin API: **{matrix.core_api}** (zllm-core {matrix.core_version})",
        "",
        "Evidence for verified cells: "
        + (f"`{matrix.verified_file}`" if matrix.verified_file else "none (no compat/verified.toml found)"),
        "",
        "Statuses: *verified* (a listed test ran the model on this backend against the oracle),"
        " *kernel-verified* (every kernel the cell binds ran against the f32 reference without a device:"
        " Triton kernels in Triton's interpreter, torch kernels on CPU tensors; no device ran the model),"
        " *declared* (capabilities match, nothing ran), *unsupported* (names the missing capabilities).",
        "",
        "A column is how a checkpoint stores its weights; a quantized HF column (`hf-fp8`, `hf-gptq-int4` ...)"
        f" keeps its embedding table in {HF_EMBEDDING_FORMAT}, as those quantization methods do.",
        "",
        "## Plugins",
        "",
        *table(*_plugin_table(matrix)),
    ]
    for fam in _families(matrix):
        lines += ["", f"## Family `{fam}`", "", *table(["backend", *FORMAT_AXIS], _grid(matrix, fam))]
    if not matrix.cells:
        lines += ["", "No family x backend pair is loaded."]
    if matrix.notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in matrix.notes)]
    return "\n".join(lines) + "\n"


def _render_text(matrix: CompatMatrix) -> str:
    def table(head: list[str], rows: list[list[str]]) -> list[str]:
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        return ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in (head, *rows)]

    lines = [
        f"core plugin API {matrix.core_api} (zllm-core {matrix.core_version})",
        f"verified file: {matrix.verified_file or 'none found'}",
        "",
        *table(*_plugin_table(matrix)),
    ]
    for fam in _families(matrix):
        lines += ["", f"family {fam}:"]
        rows = [[c.backend, c.format, c.label] for c in matrix.cells if c.family == fam]
        lines += table(["backend", "format", "status"], rows)
    for n in matrix.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines) + "\n"


def _as_json(matrix: CompatMatrix) -> dict[str, Any]:
    return {
        "core_api": matrix.core_api,
        "core_version": matrix.core_version,
        "verified_file": matrix.verified_file,
        "plugins": [attrs.asdict(p) for p in matrix.plugins],
        "cells": [{**attrs.asdict(c), "missing": list(c.missing), "tests": list(c.tests)} for c in matrix.cells],
        "notes": list(matrix.notes),
    }


def render(matrix: CompatMatrix, fmt: str) -> str:
    """The matrix as ``text``, ``md`` (what COMPATIBILITY.md holds) or ``json``.

    Raises:
        ValueError: another ``fmt`` (names the valid ones).
    """
    if fmt == "md":
        return _render_md(matrix)
    if fmt == "text":
        return _render_text(matrix)
    if fmt == "json":
        return json.dumps(_as_json(matrix), indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r}; expected text, md or json")
