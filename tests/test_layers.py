"""The import contracts of DESIGN.md ("Layers inside zllm-core"), enforced by import-linter.

The contracts live in the root pyproject.toml under [tool.importlinter]; this test runs the
real `lint-imports` and shows its report when a contract is broken.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
SOURCES = {
    "zllm": REPO / "zllm-core" / "src" / "zllm",
    "zllm_backend_cpu": REPO / "zllm-backend-cpu" / "src" / "zllm_backend_cpu",
    "zllm_model_llama": REPO / "zllm-models" / "llama" / "src" / "zllm_model_llama",
    "zllm_model_deepseek": REPO / "zllm-models" / "deepseek" / "src" / "zllm_model_deepseek",
    "zllm_model_gpt_oss": REPO / "zllm-models" / "gpt_oss" / "src" / "zllm_model_gpt_oss",
    "zllm_kernels_triton": REPO / "zllm-kernels-triton" / "src" / "zllm_kernels_triton",
    "zllm_kernels_torch": REPO / "zllm-kernels-torch" / "src" / "zllm_kernels_torch",
    "zllm_backend_cuda": REPO / "zllm-backend-cuda" / "src" / "zllm_backend_cuda",
    "zllm_backend_rocm": REPO / "zllm-backend-rocm" / "src" / "zllm_backend_rocm",
    "zllm_backend_metal": REPO / "zllm-backend-metal" / "src" / "zllm_backend_metal",
}


def lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        # ahead of the editable installs, so grimp analyses the copies
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def contracts() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]


def test_import_contracts_hold():
    proc = lint(REPO)
    assert proc.returncode == 0, f"lint-imports failed:\n{proc.stdout}\n{proc.stderr}"


def test_plugin_contract_forbids_every_zllm_module_except_plugin_api():
    # "plugins import only zllm.plugin_api" is spelled as a forbidden list; a core module
    # missing from it would be silently allowed.
    (contract,) = [c for c in contracts()["contracts"] if c["id"] == "plugins-import-only-plugin-api"]
    modules = {p.stem for p in SOURCES["zllm"].iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())}
    expected = {f"zllm.{m}" for m in modules - {"__init__", "plugin_api"}}
    assert set(contract["forbidden_modules"]) == expected
    assert set(contract["source_modules"]) == set(SOURCES) - {"zllm"}


@pytest.fixture
def copied(tmp_path: Path) -> Path:
    """The three packages' sources and the contracts, copied to a temp tree."""
    src = tmp_path / "src"
    for name, path in SOURCES.items():
        shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("zllm_backend_cpu/plugin.py", "import zllm.runtime.scheduler", "Plugins import only zllm.plugin_api from zllm"),
    ("zllm_model_llama/family.py", "import zllm_backend_cpu.backend", "Backends never import model families"),
    ("zllm/plugins/selection.py", "import zllm_backend_cpu.plugin", "The core never imports a plugin package"),
    ("zllm/spec/errors.py", "import zllm.weights.formats", "zllm-core layers, top to bottom"),
])
def test_injected_forbidden_import_is_caught_and_named(copied, module, line, contract):
    target = copied / "src" / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{line}  # injected by test_layers\n", encoding="utf-8")

    proc = lint(copied, pythonpath=copied / "src")

    assert proc.returncode != 0, proc.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    imported = line.split()[-1]
    assert f"{contract}" in proc.stdout and "BROKEN" in proc.stdout
    assert f"{importer} -> {imported}" in proc.stdout, proc.stdout
