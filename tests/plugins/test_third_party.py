"""A third-party backend, installed the way a user would: build its wheel, pip-install it into
a throwaway virtual environment, and use it there through the real entry-point path.

The throwaway venv sees this environment's packages through a ``.pth`` file (so zllm-core,
torch and the default plugins need no second install) and nothing is installed into the
test environment itself. A second copy declaring ``ZLLM_PLUGIN_API = "2.0"`` shows the
handshake skipping a plugin whose API major the core does not speak.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "third-party-backend"
CONFIG = REPO / "configs" / "stories260k-hf.yaml"

pytestmark = pytest.mark.timeout(300)


def sh(*cmd, cwd=None, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def api2_copy(dst: Path) -> Path:
    """The example renamed (distribution, package, entry point, backend) and declaring API 2.0."""
    shutil.copytree(EXAMPLE, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    pkg = dst / "src" / "zllm_backend_example"
    pkg.rename(dst / "src" / "zllm_backend_example2")
    for path in [dst / "pyproject.toml", *(dst / "src" / "zllm_backend_example2").glob("*.py")]:
        text = path.read_text(encoding="utf-8")
        text = (text.replace("zllm-backend-example", "zllm-backend-example2")
                .replace("zllm_backend_example", "zllm_backend_example2")
                .replace('example = "', 'example2 = "').replace('BACKEND = "example"', 'BACKEND = "example2"')
                .replace('ZLLM_PLUGIN_API = "1.3"', 'ZLLM_PLUGIN_API = "2.0"'))
        path.write_text(text, encoding="utf-8")
    assert 'ZLLM_PLUGIN_API = "2.0"' in (dst / "src" / "zllm_backend_example2" / "plugin.py").read_text()
    return dst


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv holding the two example wheels; returns its python."""
    work = tmp_path_factory.mktemp("third-party")
    # Build from copies: an in-tree build would leave build/ and *.egg-info in examples/.
    v1 = shutil.copytree(EXAMPLE, work / "example", ignore=shutil.ignore_patterns("__pycache__"))
    v2 = api2_copy(work / "example2")
    wheels = work / "wheels"
    for project in (v1, v2):
        # --no-build-isolation: build with this environment's setuptools instead of fetching one
        sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, project)

    env_dir = work / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", env_dir)
    python = env_dir / "bin" / "python"
    site = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # addsitedir (not a bare path) so the test environment's own .pth files — the editable
    # installs of zllm-core and the default plugins — are processed too.
    ours = sysconfig.get_paths()["purelib"]
    (site / "zllm-test-env.pth").write_text(f"import site; site.addsitedir({ours!r})\n", encoding="utf-8")
    sh(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *sorted(wheels.glob("*.whl")))
    return python


def in_venv(python: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)


def test_wheel_installs_only_into_the_throwaway_venv(venv):
    located = in_venv(venv, "import zllm_backend_example, sys; print(zllm_backend_example.__file__); print(sys.prefix)")
    assert located.returncode == 0, located.stderr
    module_file, prefix = located.stdout.split()
    assert module_file.startswith(prefix)
    # ...and not into the test environment
    outside = subprocess.run([sys.executable, "-c", "import zllm_backend_example"], capture_output=True, text=True)
    assert outside.returncode != 0 and "No module named 'zllm_backend_example'" in outside.stderr


def test_example_backend_is_discovered_and_api2_copy_is_skipped_with_warning(venv):
    proc = subprocess.run(
        [str(venv), "-m", "zllm.cli.main", "plugins", "--json"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["example"]["status"] == "loaded", rows["example"]
    assert (rows["example"]["distribution"], rows["example"]["version"]) == ("zllm-backend-example", "0.1.0")
    assert rows["example"]["kind"] == "backend:example" and rows["example"]["api"] == "1.3"
    assert set(rows["example"]["requires_core"].split(",")) == {">=0.1", "<0.2"}
    assert rows["cpu"]["status"] == rows["llama"]["status"] == "loaded"

    assert rows["example2"]["status"] == "skipped"
    assert (
        "warning: zllm plugin 'example2' (zllm-backend-example2 0.1.0) skipped: "
        "targets plugin API 2.0 but this zllm-core speaks 1.3"
    ) in proc.stderr


def test_example_backend_is_capability_checked_and_selectable(venv):
    proc = in_venv(venv, """
        import warnings
        from zllm.plugins.host import PluginHost
        from zllm.plugins.selection import select_backend
        from zllm.spec.errors import CapabilityError

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the API 2.0 copy's warning is checked elsewhere
            host = PluginHost()
        llama = host.families["llama"].load()
        try:
            select_backend(host, "example", llama.format_capabilities("q8_0"), "llama")
        except CapabilityError as exc:
            print("REJECTED", exc.missing, exc.backend, exc.family, "|", exc)
        choice = select_backend(host, "example", llama.format_capabilities("f32"), "llama")
        print("CHOSEN", choice.info.name, choice.cls.__name__, "|", choice.reason)
        for cap in sorted(choice.info.capabilities):
            print("KERNEL", cap, host.kernels.lookup(cap.op, "example", cap.variant).entry.registered_by)
    """)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert ("REJECTED ['embedding[q8_0]', 'linear[q8_0]'] example llama | backend 'example' lacks capabilities "
            "embedding[q8_0], linear[q8_0] needed by model family 'llama'") in out
    assert "CHOSEN example ExampleBackend | backend 'example' named in config" in out
    assert out.count("zllm-backend-example\n") == 8  # one kernel per declared capability


@pytest.mark.skipif(not CONFIG.exists(), reason="shipped stories260k config not present")
def test_example_backend_generates_the_same_text_as_the_cpu_backend(venv):
    def run(backend: str) -> str:
        proc = subprocess.run(
            [str(venv), "-m", "zllm.cli.main", "run", "--config", str(CONFIG), "--backend", backend,
             "--max-new-tokens", "24"],
            capture_output=True, text=True, timeout=240,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    text = run("example")
    assert text.strip(), "no text came out"
    assert text == run("cpu")  # greedy f32: same tokens as the CPU backend


def test_example_kernels_match_the_f32_references(monkeypatch):
    # In-process, from the example's source (no install needed to check math): every kernel
    # against the core's reference of its op, fetched from one registry.
    from importlib import metadata

    import torch

    from zllm.capabilities.ops import AttentionMetadata
    from zllm.plugins.host import PluginHost

    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    host = PluginHost(
        entry_points=[metadata.EntryPoint(name="example", value="zllm_backend_example.plugin", group="zllm")]
    )

    def both(op: str, variant: str):
        return (host.kernels.lookup(op, "example", variant).fn,
                host.kernels.lookup(op, "example", variant, force_reference=True).fn)

    g = torch.Generator().manual_seed(0)
    t, h, hkv, d, k, n, v = 7, 4, 2, 8, 16, 12, 20
    close = dict(atol=1e-2, rtol=1e-2)

    mine, ref = both("embedding", "f32")
    table, ids = torch.randn(v, k, generator=g), torch.randint(0, v, (t,), generator=g)
    torch.testing.assert_close(mine(table, ids), ref(table, ids), **close)
    mine, ref = both("linear", "f32")
    x, w, b = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(mine(x, w, b), ref(x, w, b), **close)
    torch.testing.assert_close(mine(x, w, None), ref(x, w, None), **close)
    mine, ref = both("rms_norm", "f32")
    wn = torch.randn(k, generator=g)
    torch.testing.assert_close(mine(x, wn, 1e-6), ref(x, wn, 1e-6), **close)
    mine, ref = both("rope", "neox")
    q = torch.randn(t, h, d, generator=g)
    ang = torch.randn(t, d // 2, generator=g)
    torch.testing.assert_close(mine(q, ang.cos(), ang.sin()), ref(q, ang.cos(), ang.sin()), **close)
    mine, ref = both("silu_mul", "f32")
    gate, up = torch.randn(t, n, generator=g), torch.randn(t, n, generator=g)
    torch.testing.assert_close(mine(gate, up), ref(gate, up), **close)

    # attention: sequence 0 is a New Prefill of 4 tokens, sequence 1 an Append Prefill of 3
    # tokens onto 2 cached ones; block size 2, blocks handed out out of order
    mine, ref = both("attention", "paged")
    nb, bs = 8, 2
    kk, vv = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    tables = torch.tensor([[5, 1, -1], [2, 7, 0]])
    slots = torch.tensor([10, 11, 2, 3, 14, 15, 0])  # seq0 tokens 0-3 in blocks 5, 1; seq1 tokens 2-4 in blocks 7, 0
    meta = AttentionMetadata(slots, tables, (4, 3), (4, 5), d ** -0.5)
    cache0 = torch.randn(nb, bs, hkv, d, generator=g)  # seq1's first 2 tokens already cached in block 2
    outs = []
    for fn in (mine, ref):
        kc, vc = cache0.clone(), cache0.clone() * 0.5
        outs.append((fn(q, kk, vv, kc, vc, meta), kc, vc))
    for a, b_ in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(a, b_, **close)
