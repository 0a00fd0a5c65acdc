"""llama.cpp as a benchmark peer: its sources, its ``llama-bench`` tool and its GGUF converter.

The llama.cpp sources come from the ``llama-cpp-python`` source distribution, which vendors a
pinned llama.cpp under ``vendor/llama.cpp`` (``pip download --no-binary :all: --no-deps
llama-cpp-python``). Everything lives in a cache directory (``$ZLLM_BENCH_CACHE/llama-cpp``,
default ``~/.cache/zllm-bench/llama-cpp``)::

    llama_cpp_python-<v>.tar.gz        the sdist
    llama_cpp_python-<v>/vendor/llama.cpp/
        build/bin/llama-bench          built once by :func:`build_llama_bench`
        build.log                      the build's output
        convert_hf_to_gguf.py, gguf-py/  the converter and the gguf-py copy it works with
    pydeps/                            ``sentencepiece`` for the converter (pip --target)

``llama-bench`` is built with CMake, ``-DGGML_NATIVE=ON`` (the machine's own ISA, as a user
building llama.cpp gets), static libraries, only the ``llama-bench`` target: 10-20 minutes on
2 cores. :func:`run_llama_bench` runs it for one measurement.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

SDIST = "llama-cpp-python"
CACHE = Path(os.environ.get("ZLLM_BENCH_CACHE", Path.home() / ".cache" / "zllm-bench")) / "llama-cpp"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TOOLS=ON",
)


def _log(msg: str) -> None:
    print(f"[bench] llama.cpp: {msg}", flush=True)


def sources(fetch: bool = False) -> Path | None:
    """The vendored llama.cpp source directory from the cached sdist (the newest one), or None.

    With ``fetch``, downloads and unpacks the sdist first when none is cached.

    Raises:
        RuntimeError: ``fetch`` was asked and pip could not download the sdist.
    """
    found = sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[-1].parent
    archives = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    if not archives and fetch:
        CACHE.mkdir(parents=True, exist_ok=True)
        _log(f"downloading the {SDIST} sdist into {CACHE} ...")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                               "--quiet", "-d", str(CACHE), SDIST], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {SDIST} failed:\n{proc.stderr[-2000:]}")
        archives = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        return None
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(CACHE, filter="data")
    return sources(fetch=False)


def sdist_version(src: Path) -> str:
    """``llama-cpp-python`` version of a source tree (from its directory name)."""
    return src.parents[1].name.removeprefix("llama_cpp_python-")


def bench_binary(src: Path) -> Path:
    return src / "build" / "bin" / "llama-bench"


def build_llama_bench(src: Path, jobs: int | None = None) -> Path:
    """Configure and build ``llama-bench`` (only that target) under ``src/build``; its path.

    Raises:
        RuntimeError: cmake or a compiler is missing, or the build failed (the log tail).
    """
    binary = bench_binary(src)
    if binary.exists():
        return binary
    for tool in ("cmake", "c++", "cc"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-bench needs {tool!r} on PATH")
    log = src / "build.log"
    jobs = jobs or os.cpu_count() or 1
    _log(f"building llama-bench from {src} with {jobs} jobs (10-20 minutes on 2 cores; log: {log}) ...")
    started = time.time()
    with log.open("w") as out:
        for cmd in (["cmake", "-S", str(src), "-B", str(src / "build"), *CMAKE_FLAGS],
                    ["cmake", "--build", str(src / "build"), "--target", "llama-bench", "-j", str(jobs)]):
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                tail = "\n".join(log.read_text().splitlines()[-20:])
                raise RuntimeError(f"llama-bench build failed ({' '.join(cmd[:2])}):\n{tail}")
    _log(f"built {binary} in {time.time() - started:.0f} s")
    return binary


def converter_command(src: Path) -> tuple[list[str], dict[str, str]]:
    """Command prefix and environment to run the sdist's ``convert_hf_to_gguf.py``.

    The converter needs the ``gguf-py`` copy bundled beside it (PyPI ``gguf`` 0.19 lacks
    names it uses) and ``sentencepiece`` (imported before it looks for a tokenizer), which is
    installed once into the cache with ``pip --target`` so the environment stays untouched.

    Raises:
        RuntimeError: sentencepiece cannot be installed.
    """
    pydeps = CACHE / "pydeps"
    if not (pydeps / "sentencepiece").exists():
        _log(f"installing sentencepiece for the converter into {pydeps} ...")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(pydeps),
                               "sentencepiece"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install sentencepiece failed:\n{proc.stderr[-2000:]}")
    env = dict(os.environ)
    paths = [str(src / "gguf-py"), str(pydeps), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return [sys.executable, str(src / "convert_hf_to_gguf.py")], env


def _wait_rusage(proc: subprocess.Popen, timeout: float) -> tuple[int, int]:
    """Wait for ``proc``; ``(exit status, peak RSS bytes)`` from ``wait4``."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.02)


def _bench_once(binary: Path, args: list[str], timeout: float) -> tuple[dict[str, Any], int]:
    """One ``llama-bench`` process with ``-o json``; its single result row and its peak RSS."""
    cmd = [str(binary), *args, "-r", "1", "-o", "json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        rc, peak = _wait_rusage(subprocess.Popen(cmd, stdout=out, stderr=err, text=True), timeout)
        out.seek(0)
        err.seek(0)
        text, err_text = out.read(), err.read()
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {rc}: {err_text[-1500:]}")
    rows = json.loads(text)
    assert len(rows) == 1, rows
    return rows[0], peak


def run_llama_bench(binary: Path, model: Path, prompt_tokens: int, new_tokens: int, threads: int,
                    timeout: float) -> dict[str, Any]:
    """Prefill and decode speed of llama.cpp on ``model``, as a worker result dict.

    Two ``llama-bench`` processes: ``-p P -n 0`` (prompt processing of P tokens in one batch)
    and ``-p 0 -n N -d P`` (N tokens generated one at a time after P tokens of context, the
    state a request is in after its prompt). Each repeats once after llama-bench's own
    warm-up run. ``ttft_s`` is derived as P / prefill rate; ``peak_rss_growth_bytes`` is the
    decode process's whole peak RSS (a C++ program's start-up RSS is a few MiB); load time
    is not measured by llama-bench.
    """
    common = ["-m", str(model), "-t", str(threads), "-ngl", "0"]
    pp, _ = _bench_once(binary, [*common, "-p", str(prompt_tokens), "-n", "0"], timeout)
    tg, peak = _bench_once(binary, [*common, "-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens)], timeout)
    prefill = float(pp["avg_ts"])
    return {
        "engine": "llama.cpp",
        "prompt_tokens": prompt_tokens,
        "generated_tokens": int(tg["n_gen"]),
        "finish_reason": "length",
        "token_ids": None,
        "load_s": None,
        "ttft_s": prompt_tokens / prefill,
        "prefill_tok_s": prefill,
        "decode_tok_s": float(tg["avg_ts"]),
        "peak_rss_growth_bytes": peak,
        "peak_reset": False,
        "threads": int(tg["n_threads"]),
        "versions": {"llama.cpp": f"{tg.get('build_commit', '?')} (build {tg.get('build_number', '?')})",
                     "cpu_info": tg.get("cpu_info", "")},
        "how": "llama-bench",
    }
