"""The official openai SDK against ``zllm serve`` with two tensor-parallel ranks it spawned
itself (real processes, gloo on 127.0.0.1): completions, chat, streaming, eight concurrent
streams, cancellation; and a rank that dies or hangs ends the requests in flight with a 503 and
the server with a non-zero status naming what failed, never a silent hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import MODEL_DIR, REFERENCE_TEXT, write_config
from tests.server.conftest import Server, chat_model_dir, free_port, start_server
from tests.server.test_concurrency import PROMPTS, stream_text, wait_until
from zllm.cli.serve import EXIT_RANK_FAILED


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the server and the ranks it spawns: one thread each
        yield


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, one_thread) -> Server:
    tmp = tmp_path_factory.mktemp("tp-serve")
    srv = start_server(tmp, chat_model_dir(tmp / "stories-chat"), parallel={"tensor": 2},
                       server={"served_model_name": "stories-chat"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tp_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _rank_processes(server: Server) -> list[psutil.Process]:
    """The ranks ``zllm serve`` spawned (its multiprocessing children, not its resource tracker)."""
    return [p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]


def test_completions_chat_and_streaming_through_two_ranks(client, tp_server):
    text = client.completions.create(model=tp_server.model, prompt="", max_tokens=40, temperature=0).choices[0].text
    assert REFERENCE_TEXT.startswith(text) and len(text) > 100
    assert stream_text(client, tp_server.model, "", 40) == text
    chat = client.chat.completions.create(model=tp_server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 16
    assert len(_rank_processes(tp_server)) == 1


def test_eight_concurrent_streams_each_equal_the_request_run_alone(client, tp_server):
    prompts = PROMPTS[:8]
    alone = [stream_text(client, tp_server.model, p, 24) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: stream_text(client, tp_server.model, p, 24), prompts))
    assert together == alone and len(set(alone)) == len(prompts)


def test_cancelled_stream_frees_its_kv_blocks_and_the_ranks_keep_serving(client, tp_server):
    # Every rank's KV cache is addressed by rank 0's block ids: blocks rank 0 frees are free on all.
    idle = tp_server.metrics()
    body = {"model": tp_server.model, "prompt": [311, 42, 43], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{tp_server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert tp_server.metrics()["zllm_kv_blocks_running"] >= 1
    assert wait_until(lambda: tp_server.metrics()["zllm_num_requests_running"] == 0)
    after = tp_server.metrics()
    assert after["zllm_kv_blocks_running"] == 0 and after["zllm_kv_blocks_free"] == idle["zllm_kv_blocks_free"]
    assert stream_text(client, tp_server.model, "", 40) == client.completions.create(
        model=tp_server.model, prompt="", max_tokens=40, temperature=0).choices[0].text


# --- a rank that dies or hangs ---------------------------------------------------------------


def _fails_in_flight(tmp_path: Path, break_rank, timeout_s: float,
                     idle_s: float = 0.0) -> tuple[Server, BaseException, str]:
    """Start a TP = 2 server, leave it idle ``idle_s`` seconds, begin a long stream, break its rank 1
    with ``break_rank`` mid-stream; return the server (exited), the stream's error and the server's log."""
    srv = start_server(tmp_path, chat_model_dir(tmp_path / "m"), parallel={"tensor": 2, "timeout_s": timeout_s})
    (rank,) = _rank_processes(srv)
    time.sleep(idle_s)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        stream = client.completions.create(model=srv.model, prompt="", max_tokens=100_000, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        threading.Timer(0.2, break_rank, args=(rank,)).start()
        with pytest.raises(openai.APIError) as exc:
            for _ in chunks:
                pass
        srv.proc.wait(timeout=60)  # raises if the server hangs instead of exiting
        return srv, exc.value, srv.log.read_text()
    finally:
        if rank.is_running():
            rank.kill()
        srv.stop()


@pytest.mark.slow
def test_a_rank_that_dies_ends_requests_in_flight_with_503_and_the_server_exits_naming_it(tmp_path):
    srv, error, log = _fails_in_flight(tmp_path, lambda p: p.send_signal(signal.SIGKILL), timeout_s=30)
    assert isinstance(error, openai.APIError) and "engine failed" in str(error)
    assert srv.proc.returncode == EXIT_RANK_FAILED, log
    assert f"rank 1 (pid {rank_pid(log)}) exited with code {-signal.SIGKILL}" in log


@pytest.mark.slow
def test_a_rank_that_hangs_is_given_up_on_after_the_process_group_timeout(tmp_path):
    # SIGSTOP: the rank is alive but never answers; rank 0's collective times out (parallel.timeout_s,
    # which bounds each step only: parallel.startup_timeout_s leaves the spawned rank time to import torch).
    # Idle longer than that first: the idle rank 0's beats keep the rank waiting for the next step.
    srv, error, log = _fails_in_flight(tmp_path, lambda p: p.send_signal(signal.SIGSTOP), timeout_s=3, idle_s=4)
    assert isinstance(error, openai.APIError) and "engine failed" in str(error)
    assert srv.proc.returncode == EXIT_RANK_FAILED, log
    assert "rank 1 stopped answering" in log


@pytest.mark.slow
def test_under_torchrun_only_rank_0_serves_and_a_dead_rank_fails_every_rank_naming_it(tmp_path):
    port = free_port()
    config = write_config(tmp_path, MODEL_DIR / "hf", parallel={"tensor": 2}, server={"port": port})
    torchrun = Path(sys.executable).with_name("torchrun")
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        job = subprocess.Popen([str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                                "--master-port", str(free_port()), "-m", "zllm", "serve", "--config", str(config)],
                               stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            assert wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), timeout_s=120), log.read_text()
            (rank_1,) = [p for p in psutil.Process(job.pid).children() if p.environ().get("RANK") == "1"]
            rank_1.kill()
            assert job.wait(timeout=120) != 0
        finally:
            if job.poll() is None:
                job.kill()
    text = log.read_text()
    assert text.count("zllm: serving") == 1  # only rank 0 serves and prints
    assert "error: rank 1 stopped answering" in text  # rank 0's own last line
    assert "exitcode  : 3" in text and "exitcode  : -9" in text  # torchrun's report: rank 0 failed too


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def rank_pid(log: str) -> str:
    """The pid the server's log gives for rank 1."""
    return log.split("rank 1 (pid ", 1)[1].split(")", 1)[0]
