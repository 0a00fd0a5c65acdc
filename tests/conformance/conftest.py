"""Helpers for the conformance-kit tests: plugin distributions on disk for a ``zllm`` subprocess.

A distribution here is real in every way ``importlib.metadata`` can see: a ``*.dist-info``
folder with ``METADATA`` and ``entry_points.txt`` in a site folder put on ``PYTHONPATH``, so
the subprocess's plugin host discovers it through the entry-point group ``zllm`` like any
installed plugin.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.cli.conftest import zllm


def install_plugin(site: Path, ep_name: str, module: str, source: str | None = None, *, dist: str | None = None,
                   version: str = "0.0.1") -> Path:
    """Make distribution ``dist`` (default ``zllm-test-<ep_name>``) with entry point ``ep_name =
    module`` visible from ``site``; ``source`` becomes ``site/<module>.py`` when given (else the
    module must be importable from elsewhere on ``PYTHONPATH``). Returns ``site``."""
    dist = dist or f"zllm-test-{ep_name}"
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                                   "Requires-Dist: zllm-core>=0.1,<0.2\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[zllm]\n{ep_name} = {module}\n", encoding="utf-8")
    if source is not None:
        (site / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    return site


def conformance(*args: str, pythonpath: list[Path] = (), timeout: float = 540):
    """``zllm conformance ARGS`` in a subprocess with extra ``PYTHONPATH`` entries."""
    env = {"PYTHONPATH": ":".join(map(str, pythonpath))} if pythonpath else None
    return zllm("conformance", *args, env=env, timeout=timeout)


def read_report(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))
