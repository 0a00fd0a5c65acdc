"""Every distribution builds a wheel with the right metadata, and zllm-core installs and runs
with just one plugin beside it.

The wheels are built once per module from copies of the distribution folders (so no
``build/`` or ``*.egg-info`` appears in the repository). The install tests use throwaway
venvs that see the test environment's third-party packages (torch, tokenizers ...) through
a ``.pth`` file pointing at a folder of symlinks, but none of the editable zllm packages:
only the wheels installed into them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from email.parser import Parser
from pathlib import Path
from zipfile import ZipFile

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "stories260k-hf.yaml"

# distribution folder -> (distribution name, wheel file prefix, entry-point name or None)
DISTS = {
    "zllm-core": ("zllm-core", "zllm_core", None),
    "zllm-backend-cpu": ("zllm-backend-cpu", "zllm_backend_cpu", "cpu"),
    "zllm-models/llama": ("zllm-model-llama", "zllm_model_llama", "llama"),
    "zllm-models/deepseek": ("zllm-model-deepseek", "zllm_model_deepseek", "deepseek"),
    "zllm-models/gpt_oss": ("zllm-model-gpt-oss", "zllm_model_gpt_oss", "gpt_oss"),
    "zllm-kernels-torch": ("zllm-kernels-torch", "zllm_kernels_torch", None),
    "zllm-kernels-triton": ("zllm-kernels-triton", "zllm_kernels_triton", None),
    "zllm-backend-cuda": ("zllm-backend-cuda", "zllm_backend_cuda", "cuda"),
    "zllm-backend-rocm": ("zllm-backend-rocm", "zllm_backend_rocm", "rocm"),
    "zllm-backend-metal": ("zllm-backend-metal", "zllm_backend_metal", "metal"),
}
PLUGIN_DISTS = [folder for folder, (_, _, ep) in DISTS.items() if ep]
# The CPU backend's wheel holds its native kernel library (built by its setup.py): tied to the
# platform, not to a Python version or ABI. The others are pure Python.
WHEEL_TAGS = {"zllm-backend-cpu": "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")}


def _clean_env() -> dict[str, str]:
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ZLLM_PLUGINS", "PIP_REQUIRE_VIRTUALENV"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(cmd: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def _build_leftovers() -> set[Path]:
    """build/, dist/ and *.egg-info under the distribution folders (the editable installs' own
    egg-info already exists; a build must add nothing)."""
    found = set()
    for folder in DISTS:
        root = REPO / folder
        found |= {p for p in (root / "build", root / "dist") if p.exists()}
        found |= set(root.glob("*.egg-info")) | set(root.glob("src/*.egg-info"))
    return found


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """distribution folder -> its built wheel. The builds run at once."""
    tmp = tmp_path_factory.mktemp("wheels")
    before = _build_leftovers()
    out = tmp / "dist"
    procs = {}
    for folder in DISTS:
        copy = tmp / "src" / folder
        shutil.copytree(REPO / folder, copy,
                        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "tests"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
               "--quiet", "-w", out / folder.replace("/", "-"), copy]
        procs[folder] = subprocess.Popen([str(c) for c in cmd], cwd=tmp, env=_clean_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    built = {}
    for folder, proc in procs.items():
        log, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"pip wheel {folder} failed:\n{log}"
        (wheel,) = (out / folder.replace("/", "-")).glob("*.whl")
        built[folder] = wheel
    assert _build_leftovers() == before, "building a wheel left build output in the repository"
    return built


def _dist_info(wheel: Path) -> dict[str, str]:
    """The wheel's .dist-info files (METADATA, entry_points.txt ...) by base name."""
    with ZipFile(wheel) as z:
        return {
            name.rsplit("/", 1)[1]: z.read(name).decode()
            for name in z.namelist()
            if name.split("/")[0].endswith(".dist-info") and name.count("/") == 1
        }


@pytest.mark.parametrize("folder", list(DISTS))
def test_wheel_metadata_names_the_distribution_and_version_0_1_0(wheels, folder):
    name, prefix, _ = DISTS[folder]
    wheel = wheels[folder]
    tag = WHEEL_TAGS.get(folder, "py3-none-any")
    assert wheel.name.startswith(f"{prefix}-0.1.0-") and wheel.name.endswith(f"-{tag}.whl"), wheel.name
    meta = Parser().parsestr(_dist_info(wheel)["METADATA"])
    assert meta["Name"] == name
    assert meta["Version"] == "0.1.0"


@pytest.mark.parametrize("folder", PLUGIN_DISTS)
def test_plugin_wheel_requires_core_0_1_and_declares_a_zllm_entry_point(wheels, folder):
    _, prefix, ep_name = DISTS[folder]
    info = _dist_info(wheels[folder])
    requires = [Requirement(r) for r in Parser().parsestr(info["METADATA"]).get_all("Requires-Dist")]
    core = [r for r in requires if r.name == "zllm-core"]
    assert len(core) == 1, requires
    assert core[0].specifier == SpecifierSet(">=0.1,<0.2"), str(core[0])
    entry_points = info["entry_points.txt"]
    group = entry_points.split("[zllm]", 1)[1].split("\n[", 1)[0]
    assert f"{ep_name} = {prefix}.plugin" in [line.strip() for line in group.splitlines()], entry_points


def test_core_wheel_ships_the_zllm_console_script(wheels):
    info = _dist_info(wheels["zllm-core"])
    assert "zllm = zllm.cli.main:main" in info["entry_points.txt"]
    assert not [r for r in Parser().parsestr(info["METADATA"]).get_all("Requires-Dist") if r.startswith("zllm")]


# ----------------------------------------------------------------------------- core + one plugin


def _third_party_only(dst: Path) -> Path:
    """A folder of symlinks to this test venv's site-packages, zllm and editable hooks left out."""
    site = Path(sysconfig.get_paths()["purelib"])
    dst.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("zllm", "__editable__", "_zllm")) or name.endswith(".pth") or name == "__pycache__":
            continue
        (dst / entry.name).symlink_to(entry)
    return dst


def _venv_with(tmp: Path, wheel_files: list[Path]) -> Path:
    """A fresh venv seeing the third-party packages plus only ``wheel_files``; returns its bin/."""
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp).stdout.strip())
    (site / "zz_third_party.pth").write_text(f"{_third_party_only(tmp / 'third-party')}\n")
    installed = _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
                      "--quiet", *wheel_files], cwd=tmp)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv / "bin"


def _error_line(proc: subprocess.CompletedProcess) -> str:
    shown = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr, shown
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    return lines[0]


def test_core_with_only_the_llama_family_lists_it_and_says_cpu_is_not_installed(wheels, tmp_path):
    bin_dir = _venv_with(tmp_path, [wheels["zllm-core"], wheels["zllm-models/llama"]])
    proc = _run([bin_dir / "zllm", "plugins", "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["name"], r["distribution"], r["status"]) for r in rows] == [("llama", "zllm-model-llama", "loaded")]

    line = _error_line(_run([bin_dir / "zllm", "run", "--config", DEFAULT_CONFIG], cwd=tmp_path))
    assert "backend 'cpu' is not provided by any loaded plugin" in line
    assert "loaded backends: none" in line


def test_core_with_only_the_cpu_backend_lists_it_and_knows_no_architecture(wheels, tmp_path):
    bin_dir = _venv_with(tmp_path, [wheels["zllm-core"], wheels["zllm-backend-cpu"]])
    # zllm comes from the installed wheel, not from the repository's editable source.
    where = _run([bin_dir / "python", "-c",
                  "import zllm, zllm_backend_cpu; print(zllm.__file__); print(zllm_backend_cpu.__file__)"],
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).is_relative_to(tmp_path / "venv"), where.stdout
    # the wheel's native kernel library loads (None: no reason it cannot be used)
    native = _run([bin_dir / "python", "-c",
                   "from zllm_backend_cpu.kernels.native import unavailable_reason as r; print(r())"],
                  cwd=tmp_path)
    assert native.stdout.strip() == "None", native.stdout + native.stderr

    proc = _run([bin_dir / "zllm", "plugins"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.strip().splitlines()
    assert header.split() == ["NAME", "DISTRIBUTION", "VERSION", "KIND", "STATUS", "REASON"]
    assert [row.split()[:5] for row in rows] == [["cpu", "zllm-backend-cpu", "0.1.0", "backend:cpu", "loaded"]]

    line = _error_line(_run([bin_dir / "zllm", "run", "--config", DEFAULT_CONFIG], cwd=tmp_path))
    assert "unknown architecture 'llama'" in line
    assert "known architectures: none" in line
