"""`zllm compat`: the matrix's statuses, where evidence comes from, and the committed COMPATIBILITY.md."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from zllm.compat import FORMAT_AXIS, column_capabilities, compute_matrix, find_verified_file, load_verified, render
from zllm.plugins.host import PluginHost
from zllm.spec.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
ZLLM = Path(sys.executable).parent / "zllm"  # the installed console script of this environment
EXAMPLE_SRC = REPO / "examples" / "third-party-backend" / "src"


def test_committed_compatibility_md_equals_zllm_compat_output():
    env = {k: v for k, v in os.environ.items() if k != "ZLLM_PLUGINS"}  # every installed plugin
    proc = subprocess.run(
        [str(ZLLM), "compat", "--format", "md"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    committed = (REPO / "COMPATIBILITY.md").read_text(encoding="utf-8")
    if proc.stdout != committed:
        diff = "".join(difflib.unified_diff(
            committed.splitlines(keepends=True), proc.stdout.splitlines(keepends=True),
            "COMPATIBILITY.md (committed)", "zllm compat --format md",
        ))
        pytest.fail(f"COMPATIBILITY.md is stale; regenerate with `make compat`:\n{diff}")


@pytest.fixture
def host(monkeypatch) -> PluginHost:
    """The real llama family plus the example backend (f32 only), loaded from its source."""
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    eps = [ep for ep in metadata.entry_points(group="zllm") if ep.name == "llama"]
    eps.append(metadata.EntryPoint(name="example", value="zllm_backend_example.plugin", group="zllm"))
    return PluginHost(entry_points=eps)


def cell(matrix, fmt: str, backend: str = "example"):
    (c,) = [c for c in matrix.cells if (c.family, c.backend, c.format) == ("llama", backend, fmt)]
    return c


def write_verified(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "compat" / "verified.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body, encoding="utf-8")
    return path


def test_cells_are_declared_where_capabilities_match_and_unsupported_naming_what_is_missing(host, tmp_path):
    matrix = compute_matrix(host, write_verified(tmp_path, ""))
    assert [c.format for c in matrix.cells if c.family == "llama"] == list(FORMAT_AXIS)
    assert cell(matrix, "hf-f32").label == "declared"
    # The example backend has no sliding-window attention, which mistral/qwen2/qwen3 may need.
    (mistral,) = [c for c in matrix.cells if (c.family, c.format) == ("mistral", "hf-f32")]
    assert mistral.label == "unsupported (missing: attention_sliding[paged])"
    assert cell(matrix, "gguf-F32").label == "declared"
    assert cell(matrix, "gguf-Q4_0").label == "unsupported (missing: embedding[q4_0], linear[q4_0])"
    assert cell(matrix, "hf-bf16").missing == ("embedding[bf16]", "linear[bf16]")


def kernel_tables(backend: str, caps, test: str = "tests/k.py::t") -> str:
    return "".join(f'[[kernel]]\nbackend = "{backend}"\ncapability = "{c}"\ntests = ["{test}[{c}]"]\n' for c in caps)


def test_listed_tests_make_a_cell_verified(host, tmp_path):
    path = write_verified(tmp_path, '[[cell]]\nfamily = "llama"\nbackend = "example"\nformat = "hf-f32"\n'
                                    'tests = ["tests/e2e/test_x.py::test_y"]\n')
    matrix = compute_matrix(host, path)
    assert cell(matrix, "hf-f32").status == "verified"
    assert cell(matrix, "hf-f32").tests == ("tests/e2e/test_x.py::test_y",)
    assert cell(matrix, "gguf-F32").status == "declared"
    assert matrix.notes == ()


def test_a_cell_is_kernel_verified_only_when_every_kernel_it_binds_has_tests(host, tmp_path):
    needed = sorted(map(str, host.families["llama"].load().format_capabilities("f32")))
    matrix = compute_matrix(host, write_verified(tmp_path, kernel_tables("example", needed)))
    for fmt in ("hf-f32", "gguf-F32"):  # the same capabilities bind both
        assert cell(matrix, fmt).status == "kernel-verified"
        assert cell(matrix, fmt).tests == tuple(sorted(f"tests/k.py::t[{c}]" for c in needed))
    assert cell(matrix, "gguf-Q4_0").status == "unsupported"  # evidence never outweighs a missing capability

    one_short = compute_matrix(host, write_verified(tmp_path, kernel_tables("example", needed[1:])))
    assert cell(one_short, "hf-f32").status == "declared"
    assert one_short.notes == ()


def test_kernel_evidence_for_an_undeclared_capability_or_unloaded_backend_is_reported(host, tmp_path):
    body = kernel_tables("example", ["linear[q4_0]"]) + kernel_tables("gpu9", ["linear[f32]"])
    matrix = compute_matrix(host, write_verified(tmp_path, body))
    assert matrix.notes == (
        "kernel linear[q4_0] on example: listed as kernel-verified but the backend does not declare it",
        "kernel linear[f32] on gpu9: listed as kernel-verified but the backend is not loaded",
    )


def test_a_claim_the_capabilities_contradict_stays_unsupported_and_is_reported(host, tmp_path):
    path = write_verified(tmp_path,
                          '[[cell]]\nfamily = "llama"\nbackend = "example"\nformat = "gguf-Q8_0"\ntests = ["t.py::t"]\n'
                          '[[cell]]\nfamily = "gpt9"\nbackend = "example"\nformat = "hf-f32"\ntests = ["t.py::u"]\n')
    matrix = compute_matrix(host, path)
    assert cell(matrix, "gguf-Q8_0").status == "unsupported"
    assert matrix.notes == (
        "gpt9 x example x hf-f32: listed as verified but family or backend is not loaded",
        "llama x example x gguf-Q8_0: listed as verified but the backend lacks needed capabilities",
    )
    assert "## Notes" in render(matrix, "md")


@pytest.mark.parametrize(("body", "key"), [
    ('[[cell]]\nfamily = "llama"\nbackend = "cpu"\nformat = "hf-f8"\ntests = ["t.py::t"]\n', "cell[0].format"),
    ('[[cell]]\nfamily = "llama"\nbackend = "cpu"\nformat = "hf-f32"\n', "cell[0].tests"),
    ('[[cell]]\nfamily = "llama"\nbackend = "cpu"\nformat = "hf-f32"\nstatus = "declared"\ntests = ["t.py::t"]\n',
     "cell[0].status"),
    ('[[cell]]\nfamily = "llama"\nformat = "hf-f32"\ntests = ["t.py::t"]\n', "cell[0].backend"),
    ('[[cell]]\nfamily = "llama"\nbackend = "cpu"\nformat = "hf-f32"\ntest = ["t.py::t"]\n', "cell[0].test"),
    ('[[cells]]\nfamily = "llama"\n', "cells"),
    ('[[cell]]\nfamily = "llama"\nbackend = "cpu"\nformat = "hf-f32"\nstatus = "kernel-verified"\n'
     'tests = ["t.py::t"]\n', "cell[0].status"),
    ('[[kernel]]\nbackend = "cuda"\ncapability = "rms_norm"\ntests = ["t.py::t"]\n', "kernel[0].capability"),
    ('[[kernel]]\nbackend = "cuda"\ncapability = "rms_norm[f32]"\n', "kernel[0].tests"),
    ('[[kernel]]\ncapability = "rms_norm[f32]"\ntests = ["t.py::t"]\n', "kernel[0].backend"),
    ('[[kernel]]\nbackend = "cuda"\ncapability = "rms_norm[f32]"\nformat = "hf-f32"\ntests = ["t.py::t"]\n',
     "kernel[0].format"),
    ('kernel = "all of them"\n', "kernel"),
])
def test_malformed_verified_file_raises_naming_the_key_path(tmp_path, body, key):
    with pytest.raises(ConfigError) as info:
        load_verified(write_verified(tmp_path, body))
    assert info.value.path == key


def test_verified_file_is_found_walking_up_from_the_current_directory(tmp_path, monkeypatch):
    path = write_verified(tmp_path, "")
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert find_verified_file(deep) == path.resolve()
    monkeypatch.chdir(deep)
    assert find_verified_file() == path.resolve()


def test_without_a_verified_file_no_cell_is_verified_and_output_says_so(host, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tmp dirs have no compat/verified.toml above them
    if find_verified_file() is not None:
        pytest.skip("a compat/verified.toml exists above the temp dir")
    matrix = compute_matrix(host)
    assert matrix.verified_file is None
    assert {c.status for c in matrix.cells} == {"declared", "unsupported"}
    assert "none (no compat/verified.toml found)" in render(matrix, "md")


def test_render_reports_core_api_and_each_plugins_distribution_version_api_and_core_range(host, tmp_path):
    matrix = compute_matrix(host, write_verified(tmp_path, ""))
    md = render(matrix, "md")
    assert "Core plugin API: **1.3**" in md
    llama = next(p for p in matrix.plugins if p.name == "llama")
    families = ("family:llama, family:mistral, family:qwen2, family:qwen3, family:mixtral, family:qwen2_moe, "
                "family:qwen3_moe")
    assert f"| llama | zllm-model-llama | {llama.version} | {families} | loaded | 1.3 | {llama.requires_core} |" in md
    assert md.count("| example | declared |") == 1

    data = json.loads(render(matrix, "json"))
    assert data["core_api"] == "1.3"
    assert {c["format"] for c in data["cells"]} == set(FORMAT_AXIS)
    text = render(matrix, "text")
    assert "core plugin API 1.3" in text and "unsupported (missing: embedding[q8_0], linear[q8_0])" in text
    with pytest.raises(ValueError, match="expected text, md or json"):
        render(matrix, "html")


def test_cli_verified_option_names_the_file_and_rejects_a_missing_one(tmp_path):
    path = write_verified(tmp_path, "")
    ok = subprocess.run(
        [str(ZLLM), "compat", "--format", "json", "--verified", str(path)], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["verified_file"] == str(path)
    bad = subprocess.run(
        [str(ZLLM), "compat", "--verified", str(tmp_path / "nope.toml")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "nope.toml: no such file" in bad.stderr


def test_a_quantized_hf_column_needs_a_dense_embedding_and_a_gguf_column_the_quantized_one():
    family = PluginHost().families["llama"].load()
    hf = {str(c) for c in column_capabilities(family, "hf-fp8", "fp8_e4m3")}
    assert "embedding[bf16]" in hf and "embedding[fp8_e4m3]" not in hf and "linear[fp8_e4m3]" in hf
    gguf = {str(c) for c in column_capabilities(family, "gguf-Q8_0", "q8_0")}
    assert "embedding[q8_0]" in gguf and "linear[q8_0]" in gguf
