"""``zllm serve`` user errors: one line on stderr, exit 2, before any model is loaded."""

from __future__ import annotations

import socket

from tests.cli.conftest import one_line_error, zllm
from tests.conftest import CONFIGS


def test_bad_port_names_the_key():
    line = one_line_error(zllm("serve", "--config", str(CONFIGS / "stories260k-hf.yaml"), "--port", "70000"))
    assert "server.port" in line and "70000" in line


def test_missing_config_file():
    line = one_line_error(zllm("serve", "--config", "no-such-config.yaml"))
    assert "no-such-config.yaml" in line


def test_address_in_use_fails_before_loading():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = one_line_error(zllm("serve", "--config", str(CONFIGS / "stories260k-hf.yaml"), "--port", str(port)))
    assert f"127.0.0.1:{port}" in line and "server.port" in line


def test_data_parallel_under_torchrun_is_refused_naming_the_key(tmp_path):
    from tests.conftest import MODEL_DIR, write_config

    config = write_config(tmp_path, MODEL_DIR / "hf", parallel={"data": 2})
    line = one_line_error(zllm("serve", "--config", str(config), env={"WORLD_SIZE": "2", "RANK": "0"}))
    assert "parallel.data" in line and "torchrun" in line
