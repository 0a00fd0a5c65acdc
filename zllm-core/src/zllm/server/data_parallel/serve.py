"""``zllm serve`` with ``parallel.data`` > 1: start the replicas, then serve the front end."""

from __future__ import annotations

import math
import sys

import uvicorn

from zllm.server.data_parallel.frontend import FrontEnd, create_frontend_app
from zllm.server.data_parallel.replicas import ReplicaSet
from zllm.server.uvicorn_server import SHUTDOWN_GRACE_S, Server, protocol_class
from zllm.spec.config import ZllmConfig


def serve_data_parallel(cfg: ZllmConfig, replica_set: ReplicaSet, *, log_level: str = "info",
                        access_log: bool = False) -> None:
    """Serve the replicas of ``cfg`` in ``replica_set`` (just started: the caller starts them
    before importing this module, so that their start overlaps this import) behind one front
    end on ``cfg.server.host:port`` until SIGTERM or SIGINT, which every replica gets too (each
    drains its requests for ``server.shutdown_timeout_s``); returns once they have stopped.

    Raises:
        ReplicaStartError: a replica exited before it was ready (the others are stopped).
    """
    server = cfg.server
    replicas = len(replica_set.replicas)
    try:
        replica_set.wait_ready()
        frontend = FrontEnd([r.url for r in replica_set.replicas], cfg.generation.max_new_tokens,
                            server.max_connections, [r.process.pid for r in replica_set.replicas])
        frontend.on_startup.append(lambda fe: replica_set.watch(fe.replica_exited_threadsafe))
        frontend.on_shutdown.append(lambda _timeout_s: replica_set.terminate())
        app = create_frontend_app(frontend)
        print(f"zllm: serving {replicas} data-parallel replicas on http://{server.host}:{server.port} "
              f"({', '.join(r.url for r in replica_set.replicas)})", file=sys.stderr, flush=True)
        config = uvicorn.Config(
            app, host=server.host, port=server.port, log_level=log_level, access_log=access_log,
            http=protocol_class(server.header_timeout_s, server.max_connections),
            timeout_graceful_shutdown=math.ceil(server.shutdown_timeout_s + SHUTDOWN_GRACE_S), lifespan="on",
        )
        Server(config, frontend, server.shutdown_timeout_s).run()
    finally:
        replica_set.stop(server.shutdown_timeout_s + SHUTDOWN_GRACE_S)
