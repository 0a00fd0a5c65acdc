"""Real ``zllm serve`` subprocesses on free loopback ports.

Two servers for the whole session (stories260K, and a copy with a chat template), not one
per module: each start costs seconds of model loading, and every test reads metrics as
before/after differences, so sharing them is safe.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_DIR, write_config

STARTUP_TIMEOUT_S = 60
_SCRIPT = Path(sys.executable).with_name("zllm")
ZLLM = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "zllm.cli.main"]

# A ChatML-like template (the stories260K vocabulary has no chat tokens, so the markers are
# plain text). Tests only need a template that renders every role.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running ``zllm serve``: ``url``, ``model`` (the served name), ``metrics()``."""

    def __init__(self, config: Path, model: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [*ZLLM, "serve", "--config", str(config), "--port", str(self.port),
             "--log-level", "warning"],
            stdout=self._log_file, stderr=subprocess.STDOUT, env={**os.environ, "ZLLM_PLUGINS": "cpu,llama"},
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zllm serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"zllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log.read_text()}")

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=5).json() == {"status": "ok"}

    def metrics(self) -> dict[str, float]:
        """Samples of ``/metrics`` as ``{'name{label="v",...}': value}`` (labels sorted)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def start_server(tmp_path: Path, model_dir: Path, **sections) -> Server:
    config = write_config(tmp_path, model_dir, **sections)
    name = (sections.get("server") or {}).get("model_name") or model_dir.name
    return Server(config, name, tmp_path / "server.log")


def chat_model_dir(dst: Path) -> Path:
    """A copy of the stories260K HF checkpoint whose tokenizer_config has a chat template."""
    shutil.copytree(MODEL_DIR / "hf", dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


def messages_supported() -> bool:
    """Whether the engine's Request JSON accepts ``messages`` yet (another change adds it)."""
    from zllm.spec.config import GenerationDefaults
    from zllm.spec.errors import RequestError
    from zllm.spec.request import parse_request

    try:
        parse_request({"messages": [{"role": "user", "content": "hi"}]}, GenerationDefaults())
    except RequestError:
        return False
    return True


needs_messages = pytest.mark.skipif(
    not messages_supported(),
    reason="the engine's Request JSON does not accept `messages` yet (chat-template prompts are being added "
    "in zllm.spec.request / zllm.engine); chat routes pass messages through to it",
)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """stories260K (HF) served under its folder's name, ``hf``."""
    srv = start_server(tmp_path_factory.mktemp("serve"), MODEL_DIR / "hf")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def chat_server(tmp_path_factory) -> Server:
    """stories260K with a chat template, served as ``stories-chat``."""
    tmp = tmp_path_factory.mktemp("serve-chat")
    srv = start_server(tmp, chat_model_dir(tmp / "stories-chat"), server={"model_name": "stories-chat"})
    yield srv
    srv.stop()
