"""The replica processes behind a data-parallel front end: each a full ``zllm serve`` of the
same config on its own loopback port.

A replica is started as ``python -m zllm.cli.main serve`` with a config file written for it
(:func:`replica_config`): the user's config with ``parallel.data: 1`` (so it serves alone, as
``parallel.tensor`` x ``parallel.pipeline`` ranks of its own), its own loopback port, its own
devices, and ``backend.threads``, when unset, its ranks' share of this machine's cores (R
replicas each taking every core would only slow one another down). Its output goes to the
front end's stderr.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx

from zllm.spec.config import ZllmConfig, config_to_dict
from zllm.spec.errors import ZllmError

log = logging.getLogger(__name__)

REPLICA_HOST = "127.0.0.1"
POLL_S = 0.2


class ReplicaStartError(ZllmError):
    """A replica exited before it served: carries its index and exit status."""

    def __init__(self, index: int, returncode: int):
        super().__init__(f"data-parallel replica {index} exited with status {returncode} before it was ready "
                         "(its log is above)")
        self.index, self.returncode = index, returncode


def free_port(host: str = REPLICA_HOST) -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cores() -> int:
    """CPU cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def replica_config(cfg: ZllmConfig, index: int, port: int) -> dict:
    """The config of replica ``index`` of ``cfg``, listening on ``port``: one replica
    (``parallel.data: 1``) of ``parallel.tensor * parallel.pipeline`` ranks, on the devices
    after those of the replicas before it, with ``backend.threads`` (per rank), when unset,
    this machine's cores shared among every rank of every replica."""
    par = cfg.parallel
    ranks = par.tensor * par.pipeline
    data = config_to_dict(cfg)
    data["parallel"]["data"] = 1
    data["server"]["host"] = REPLICA_HOST
    data["server"]["port"] = port
    data["backend"]["device"] = (cfg.backend.device or 0) + index * ranks
    if data["backend"]["threads"] is None:
        data["backend"]["threads"] = max(1, cores() // (par.data * ranks))
    return data


def _die_with_parent() -> None:
    """In the child before exec: on Linux, have the kernel send it SIGTERM when the front end
    dies, however it dies (prctl ``PR_SET_PDEATHSIG``), so no replica outlives it."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@attrs.define
class Replica:
    """One running replica: its index, URL and process."""

    index: int
    url: str
    process: subprocess.Popen


class ReplicaSet:
    """Start ``replicas`` replicas of ``cfg`` and watch them.

    Args:
        cfg: the user's config (``model.path`` absolute, as :func:`zllm.spec.config.load_config`
            returns it); ``parallel.data`` replicas are started.
        log_level: uvicorn log level of every replica.
    """

    def __init__(self, cfg: ZllmConfig, log_level: str = "warning"):
        self._dir = tempfile.TemporaryDirectory(prefix="zllm-dp-")
        self.replicas: list[Replica] = []
        try:
            for i in range(cfg.parallel.data):
                port = free_port()
                config = Path(self._dir.name) / f"replica-{i}.yaml"
                # JSON is YAML; the file only lives as long as the replica set.
                config.write_text(json.dumps(replica_config(cfg, i, port)))
                proc = subprocess.Popen(
                    [sys.executable, "-m", "zllm.cli.main", "serve", "--config", str(config),
                     "--log-level", log_level],
                    stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                )
                self.replicas.append(Replica(i, f"http://{REPLICA_HOST}:{port}", proc))
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> None:
        """Return once every replica answers ``/health``.

        Raises:
            ReplicaStartError: a replica exited first (the others are stopped).
        """
        pending = list(self.replicas)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for replica in list(pending):
                    code = replica.process.poll()
                    if code is not None:
                        self.stop()
                        raise ReplicaStartError(replica.index, code)
                    try:
                        if client.get(f"{replica.url}/health").status_code == 200:
                            pending.remove(replica)
                    except httpx.TransportError:
                        pass
                if pending:
                    time.sleep(POLL_S)

    def watch(self, on_exit: Callable[[int, int], None]) -> None:
        """Call ``on_exit(index, returncode)`` from a daemon thread when a replica exits."""
        for replica in self.replicas:
            def wait(r: Replica = replica) -> None:
                on_exit(r.index, r.process.wait())

            threading.Thread(target=wait, name=f"zllm-dp-replica-{replica.index}", daemon=True).start()

    def terminate(self) -> None:
        """Ask every replica to shut down gracefully (SIGTERM: each drains its own requests)."""
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.terminate()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate every replica, kill any still running after ``timeout_s``, and remove
        the replicas' config files."""
        self.terminate()
        deadline = time.monotonic() + timeout_s
        for replica in self.replicas:
            try:
                replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("data-parallel replica %d did not stop in %g s; killing it", replica.index, timeout_s)
                replica.process.kill()
                replica.process.wait()
        self._dir.cleanup()
