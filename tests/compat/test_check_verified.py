"""tools/check_verified.py against junit reports that pytest really wrote."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKER = REPO / "tools" / "check_verified.py"

SAMPLE_TESTS = '''
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

class TestGroup:
    @pytest.mark.parametrize("fmt", ["f32", "q8_0"])
    def test_param(self, fmt):
        assert fmt != "q8_0"
'''


@pytest.fixture(scope="module")
def junit(tmp_path_factory) -> Path:
    """A junit report from pytest run in a subprocess on a tiny test file under ``e2e/``."""
    root = tmp_path_factory.mktemp("sample")
    (root / "e2e").mkdir()
    (root / "e2e" / "test_sample.py").write_text(textwrap.dedent(SAMPLE_TESTS), encoding="utf-8")
    (root / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")  # makes root the rootdir
    report = root / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "e2e"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_fails failed, as intended
    return report


def verified(tmp_path: Path, *tests: str) -> Path:
    path = tmp_path / "verified.toml"
    listed = ", ".join(f'"{t}"' for t in tests)
    path.write_text(f'[[cell]]\nfamily = "llama"\nbackend = "cpu"\nformat = "hf-f32"\ntests = [{listed}]\n',
                    encoding="utf-8")
    return path


def run_checker(*args: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_checker_passes_when_every_listed_test_passed(junit, tmp_path):
    proc = run_checker(junit, verified(tmp_path, "e2e/test_sample.py::test_passes",
                                       "e2e/test_sample.py::TestGroup::test_param[f32]"))
    assert proc.returncode == 0, proc.stderr
    assert "2 tests listed" in proc.stdout and "all ran and passed" in proc.stdout


def test_checker_fails_naming_each_test_that_failed_was_skipped_or_did_not_run(junit, tmp_path):
    nodes = [
        "e2e/test_sample.py::test_passes",
        "e2e/test_sample.py::test_fails",
        "e2e/test_sample.py::test_skipped",
        "e2e/test_sample.py::TestGroup::test_param[q8_0]",
        "e2e/test_sample.py::test_renamed_long_ago",
    ]
    proc = run_checker(junit, verified(tmp_path, *nodes))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("4 of 5 tests listed")
    assert "  e2e/test_sample.py::test_fails: failed (listed for llama x cpu x hf-f32 (verified))" in lines
    assert any(line.startswith("  e2e/test_sample.py::test_skipped: skipped") for line in lines)
    assert any(line.startswith("  e2e/test_sample.py::TestGroup::test_param[q8_0]: failed") for line in lines)
    assert any(line.startswith("  e2e/test_sample.py::test_renamed_long_ago: did not run") for line in lines)
    assert not any("::test_passes" in line for line in lines)


def test_checker_rejects_a_malformed_verified_file_naming_the_key(junit, tmp_path):
    bad = tmp_path / "verified.toml"
    bad.write_text('[[cell]]\nfamily = "llama"\nbackend = "cpu"\nformat = "hf-f8"\ntests = ["a.py::t"]\n',
                   encoding="utf-8")
    proc = run_checker(junit, bad)
    assert proc.returncode == 2
    assert "cell[0].format" in proc.stderr and "'hf-f8'" in proc.stderr


def test_checker_accepts_the_committed_verified_file_schema(junit):
    # the committed file parses; whether its tests pass is `make test`'s job
    proc = run_checker(junit, REPO / "compat" / "verified.toml")
    assert proc.returncode in (0, 1), proc.stderr


def test_checker_holds_kernel_evidence_to_the_same_bar(junit, tmp_path):
    path = tmp_path / "verified.toml"
    path.write_text('[[kernel]]\nbackend = "cuda"\ncapability = "rms_norm[f32]"\n'
                    'tests = ["e2e/test_sample.py::test_passes", "e2e/test_sample.py::test_fails"]\n', encoding="utf-8")
    proc = run_checker(junit, path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[1:] == [
        "  e2e/test_sample.py::test_fails: failed (listed for cuda rms_norm[f32] (kernel-verified))"]
