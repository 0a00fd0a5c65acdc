"""The hook contract: every hook is documented, in the plugin guide and tested; each hook
works through the real installed plugins."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from zllm.capabilities import Capability
from zllm.kernels.registry import KernelRegistry
from zllm.plugins import hookspecs
from zllm.plugins.host import PluginHost

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "writing-a-backend-plugin.md"
DOC_SECTIONS = ("Called:", "Parameters:", "Returns:", "Semantics:")


def hook_names() -> list[str]:
    return sorted(
        name for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
    )


def test_hookspecs_module_defines_hooks():
    # guards the walk below against matching nothing and passing vacuously
    assert hook_names() == ["zllm_backends", "zllm_model_families", "zllm_register_kernels"]


def _test_functions_under_tests() -> set[str]:
    names = set()
    for path in REPO.joinpath("tests").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_is_documented_in_the_guide_and_has_a_test(hook):
    fn = getattr(hookspecs, hook)
    doc = inspect.getdoc(fn) or ""
    problems = [f"docstring lacks {s!r}" for s in DOC_SECTIONS if s not in doc]
    params = list(inspect.signature(fn).parameters)
    problems += [f"docstring does not describe parameter {p!r}" for p in params if not re.search(rf"\b{p}\b", doc)]
    if not params and "none" not in doc.split("Parameters:")[-1].splitlines()[0].lower():
        problems.append("docstring should say 'Parameters: none'")
    guide = GUIDE.read_text(encoding="utf-8")
    if not re.search(rf"^#+ .*`{hook}`|^\s*`{hook}(\(|`)", guide, re.MULTILINE):
        problems.append(f"{GUIDE.relative_to(REPO)} has no heading or code entry for `{hook}`")
    if f"test_hook_{hook}" not in _test_functions_under_tests():
        problems.append(f"no test function named test_hook_{hook} under tests/")
    assert not problems, f"hook {hook}: " + "; ".join(problems)


# ---------------------------------------------------------------------------- one test per hook


def test_hook_zllm_backends():
    host = PluginHost()
    results = host.pm.hook.zllm_backends()  # one list per implementing plugin
    infos = {info.name: info for result in results for info in result}
    cpu = infos["cpu"]
    assert cpu.factory == "zllm_backend_cpu.backend:CpuBackend"
    assert Capability("linear", "q8_0") in cpu.capabilities
    # pure data: reading it did not import the backend class's module's device code path
    assert host.backends["cpu"] == cpu


def test_hook_zllm_model_families():
    host = PluginHost()
    infos = {info.name: info for result in host.pm.hook.zllm_model_families() for info in result}
    llama = infos["llama"]
    assert llama.model_types == ("llama",)
    family = llama.load()
    assert family.name == "llama"
    assert Capability("linear", "q4_0") in family.format_capabilities("q4_0")


def test_hook_zllm_register_kernels():
    host = PluginHost()
    fresh = KernelRegistry()
    host.pm.hook.zllm_register_kernels(registry=fresh)
    cpu_entries = [e for e in fresh.entries() if e.backend == "cpu"]
    assert cpu_entries and {e.registered_by for e in cpu_entries} == {"zllm-backend-cpu"}
    registered = {Capability(e.op, f) for e in cpu_entries for f in e.formats}
    assert registered == host.backends["cpu"].capabilities
    # lazy references: every one of them resolves to a callable
    assert all(callable(e.resolve()) for e in cpu_entries)
